"""Drafters side by side: drafters.json and drafters.png in the workdir.

  python -m experiments.compare_drafters --config=configs/compare_drafters.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import compare_drafters, plots, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Comparison config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  rows = compare_drafters.compare_drafters(config)
  print(compare_drafters.format_table(rows))
  workdir = _WORKDIR.value
  records.write_results(os.path.join(workdir, "drafters.json"), config,
                        {"rows": rows})
  plots.save_figures(rows, workdir, {"drafters.png": plots.drafters_figure})
  print(f"wrote drafters.json and drafters.png to {workdir}")


if __name__ == "__main__":
  app.run(main)
