"""A target step and a verify against the memory roofline, per model; writes
bench_step.json and prints a table.

  python -m experiments.bench_step --config=configs/bench_step.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import bench_step, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  report = bench_step.bench_step(config)
  print(bench_step.format_table(report))
  path = os.path.join(_WORKDIR.value, "bench_step.json")
  records.write_results(path, config, report)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
