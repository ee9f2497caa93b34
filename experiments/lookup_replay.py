"""Prompt lookup settings replayed on the target's greedy output: a table of
tau (or the predicted speedup) per setting and category, lookup_replay.json.

  python -m experiments.lookup_replay --config=configs/lookup_replay.py --workdir=DIR
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import loading, lookup_replay, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Replay config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  records.check_writable(_WORKDIR.value)
  verify_cost_ratio = None
  if config.bench_step:
    with open(config.bench_step) as f:
      verify_cost_ratio = json.load(f)["models"][config.bench_model][
          "verify_cost_ratio"]
  loaded, prompts = loading.load_experiment(config)
  rows = lookup_replay.greedy_rows(config, loaded, prompts)
  print(f"{sum(len(r[2]) for r in rows)} greedy tokens of {len(rows)} prompts",
        flush=True)
  results = lookup_replay.replay(rows, config.settings, verify_cost_ratio)
  print(lookup_replay.format_table(results))
  path = os.path.join(_WORKDIR.value, "lookup_replay.json")
  records.write_results(path, config, {"verify_cost_ratio": verify_cost_ratio,
                                       "settings": results})
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
