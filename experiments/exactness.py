"""Lossless check: are SD's samples distributed as AR's? Writes tokens and a
report to the workdir, and exits nonzero unless SD passes every test and the
negative control fails one.

  python -m experiments.exactness --config=configs/exactness.py --workdir=DIR
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import exactness, loading, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Exactness config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the samples.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  exactness.settings(config)  # bad settings fail before any loading
  records.check_writable(_WORKDIR.value)
  loaded = loading.load_models(config)
  report = exactness.exactness(config, loaded, _WORKDIR.value)
  for setting in report["settings"]:
    print(exactness.describe(setting))
  path = os.path.join(_WORKDIR.value, "report.json")
  records.write_results(path, config, report)
  print(f"wrote {path}")
  if not report["passed"]:
    sys.exit("exactness check failed: see the lines above.")


if __name__ == "__main__":
  app.run(main)
