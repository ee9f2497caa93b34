"""The gamma ablation: sweep.json, sweep.csv and plots in the workdir.

  python -m experiments.gamma_sweep --config=configs/gamma_sweep.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import config as config_lib
from experiments.harness import gamma_sweep, loading, plots, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  config_lib.check(config)  # bad gammas fail before any loading
  records.check_writable(_WORKDIR.value)
  loaded, prompts = loading.load_experiment(config)
  print(f"{loaded.describe()}, {len(prompts.texts)} prompts", flush=True)
  result = gamma_sweep.gamma_sweep(config, loaded, prompts)
  print(gamma_sweep.format_table(result["rows"]))
  adaptive_rows = result.get("adaptive_rows", [])
  if adaptive_rows:
    print(gamma_sweep.format_adaptive_table(adaptive_rows))
  for name in ("best_gamma_measured", "best_gamma_predicted",
               "adaptive_over_best_measured", "head_to_head"):
    if name in result:
      print(f"{name}: {result[name]}")
  workdir = _WORKDIR.value
  records.write_results(os.path.join(workdir, "sweep.json"), config, result)
  records.write_csv(os.path.join(workdir, "sweep.csv"), result["rows"])
  paths = plots.save_figures(result["rows"] + adaptive_rows, workdir)
  print(f"wrote sweep.json, sweep.csv, {', '.join(map(os.path.basename, paths))}"
        f" to {workdir}")


if __name__ == "__main__":
  app.run(main)
