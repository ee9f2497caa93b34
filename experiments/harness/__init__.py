"""The experiment harness: configs become objects in one place (config.py,
loading.py), timing lives in one place (timing.py), results files and plots in
one place (records.py, plots.py). The absl entry points in experiments/ and the
notebooks call these; spec_jax itself never imports them."""

import logging


def setup_logging() -> None:
  """Progress lines from the harness at INFO; orbax's INFO lines (through
  absl's logger) stay quiet. Call from an entry point's main."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("experiments").setLevel(logging.INFO)
