"""Benchmark: spec_jax against HF transformers on the same weights; writes JSON.

  python -m experiments.compare_hf --config=configs/compare_hf.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import compare_hf, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Where to write compare_hf.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  report = compare_hf.compare(config, _WORKDIR.value)
  print(compare_hf.format_table(report))
  path = os.path.join(_WORKDIR.value, "compare_hf.json")
  records.write_results(path, config, report)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
