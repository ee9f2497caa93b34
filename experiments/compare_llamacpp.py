"""Benchmark: spec_jax against llama.cpp on the same GGUF weights; writes JSON.

  python -m experiments.compare_llamacpp --config=configs/compare_llamacpp.py --workdir=DIR
"""

import os
import pathlib

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import compare_llamacpp, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where to write compare_llamacpp.json (and the F32 and "
    "F16 GGUF files llama.cpp reads).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  report = compare_llamacpp.compare_llamacpp(config,
                                             pathlib.Path(_WORKDIR.value))
  print(compare_llamacpp.format_table(report))
  path = os.path.join(_WORKDIR.value, "compare_llamacpp.json")
  records.write_results(path, config, report)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
