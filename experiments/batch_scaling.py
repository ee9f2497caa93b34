"""The batch-scaling ablation: batch_scaling.json and batch_scaling.png in the
workdir, and a table.

  python -m experiments.batch_scaling --config=configs/batch_scaling.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import batch_scaling
from experiments.harness import config as config_lib
from experiments.harness import loading, plots, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Ablation config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  config_lib.check(config)  # bad batch sizes fail before any loading
  records.check_writable(_WORKDIR.value)
  loaded, prompts = loading.load_experiment(config)
  print(f"{loaded.describe()}, {len(prompts.texts)} prompts", flush=True)
  result = batch_scaling.batch_scaling(config, loaded, prompts)
  print(batch_scaling.format_table(result["rows"]))
  print(f"SD slower than AR from batch: {result['crossover']}")
  workdir = _WORKDIR.value
  records.write_results(os.path.join(workdir, "batch_scaling.json"), config,
                        result)
  paths = plots.save_figures(
      result["rows"], workdir,
      {"batch_scaling.png": plots.batch_scaling_figure})
  print(f"wrote batch_scaling.json, {os.path.basename(paths[0])} to {workdir}")


if __name__ == "__main__":
  app.run(main)
