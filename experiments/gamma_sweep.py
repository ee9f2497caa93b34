"""The gamma ablation: sweep.json, sweep.csv and plots in the workdir.

  python -m experiments.gamma_sweep --config=configs/gamma_sweep.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from spec_jax import evaluation, plots, records, sweep

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines drown progress.
  config = _CONFIG.value
  sweep.parse_gammas(config.gammas)  # bad gammas fail before any loading
  records.check_writable(_WORKDIR.value)
  target, drafter, tokenizer = evaluation.load_models(config)
  prompts = evaluation.load_prompts(config, tokenizer)
  print(f"{evaluation.describe(target, drafter)}, {len(prompts)} prompts",
        flush=True)
  result = sweep.gamma_sweep(config, target, drafter, tokenizer, prompts,
                             log=lambda line: print(line, flush=True))
  print(sweep.format_table(result["rows"]))
  for name in ("best_gamma_measured", "best_gamma_predicted"):
    print(f"{name}: {result[name]}")
  workdir = _WORKDIR.value
  records.write_json(os.path.join(workdir, "sweep.json"), {
      "code_version": records.code_version(), "config": config.to_dict(),
      **result})
  records.write_csv(os.path.join(workdir, "sweep.csv"), result["rows"])
  paths = plots.save_figures(result["rows"], workdir)
  print(f"wrote sweep.json, sweep.csv, {', '.join(map(os.path.basename, paths))}"
        f" to {workdir}")


if __name__ == "__main__":
  app.run(main)
