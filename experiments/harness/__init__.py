"""The experiment harness: configs become objects in one place (config.py,
loading.py), timing lives in one place (timing.py), results files and plots in
one place (records.py, plots.py). The absl entry points in experiments/ and the
notebooks call these; spec_jax itself never imports them."""

import logging
import os

from absl import flags

# Defined once per process, even when a notebook reloads this module.
if "compilation_cache" not in flags.FLAGS:
  flags.DEFINE_string(
      "compilation_cache",
      os.environ.get("JAX_COMPILATION_CACHE_DIR")
      or os.path.expanduser("~/.cache/spec_jax/xla"),
      "Directory of JAX's persistent compilation cache, so that a second run "
      "of a command loads its compiled programs instead of compiling them "
      "again; by default $JAX_COMPILATION_CACHE_DIR where set (as the tests "
      "set it), else ~/.cache/spec_jax/xla; '' turns it off.")


def setup() -> None:
  """What every entry point's main does first: progress lines from the
  harness at INFO, with orbax's INFO lines (through absl's logger) kept
  quiet, and the persistent compilation cache."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("experiments").setLevel(logging.INFO)
  cache_dir = flags.FLAGS.compilation_cache
  if cache_dir:
    # JAX caches the programs that took a second or more to compile (its
    # JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS; the tests set 0).
    jax.config.update("jax_compilation_cache_dir", cache_dir)
