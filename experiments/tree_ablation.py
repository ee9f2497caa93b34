"""The tree ablation: trees.json, trees.csv and trees.png in the workdir.

  python -m experiments.tree_ablation --config=configs/tree_ablation.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import loading, plots, records, tree_ablation

_CONFIG = config_flags.DEFINE_config_file("config", None, "Ablation config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  tree_ablation.shapes(config)  # bad shapes fail before any loading
  records.check_writable(_WORKDIR.value)
  loaded, prompts = loading.load_experiment(config)
  print(f"{loaded.describe()}, {len(prompts.texts)} prompts", flush=True)
  rows = tree_ablation.tree_ablation(config, loaded, prompts)
  print(tree_ablation.format_table(rows))
  workdir = _WORKDIR.value
  records.write_results(os.path.join(workdir, "trees.json"), config,
                        {"rows": rows})
  records.write_csv(os.path.join(workdir, "trees.csv"), rows)
  paths = plots.save_figures(rows, workdir,
                             {"trees.png": plots.tree_ablation_figure})
  print(f"wrote trees.json, trees.csv, {os.path.basename(paths[0])} to "
        f"{workdir}")


if __name__ == "__main__":
  app.run(main)
