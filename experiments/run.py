"""The main job: AR and SD on held-out prompts; prints a table, writes JSON.

  python -m experiments.run --config=configs/quickstart.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from spec_jax import evaluation, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write results.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  target, drafter, tokenizer = evaluation.load_models(config)
  prompts = evaluation.load_prompts(config, tokenizer)
  print(f"{evaluation.describe(target, drafter)}, {len(prompts)} prompts",
        flush=True)
  runs = evaluation.compare(config, target, drafter, tokenizer, prompts)
  print(evaluation.format_table(runs))
  for run in runs:
    for sample in run["samples"][:2]:
      print(f"\n--- T={run['temperature']:g} prompt ---\n{sample['prompt']}"
            f"\n--- SD continuation ---\n"
            f"{tokenizer.decode(sample['sd_tokens'])}")
  path = os.path.join(_WORKDIR.value, "results.json")
  records.write_json(path, {"code_version": records.code_version(),
                            "config": config.to_dict(), "runs": runs})
  print(f"\nwrote {path}")


if __name__ == "__main__":
  app.run(main)
