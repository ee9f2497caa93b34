"""The main job: AR and SD side by side on the built-in pair.

  python -m experiments.run --config=configs/quickstart.py --workdir=/tmp/quickstart

Any field of experiments/harness/config.py can be overridden, e.g.
--config.gamma=6 --config.temperatures=0.7, or another drafter:
--config.drafter=ngram, --config.drafter=layer_skip
--config.layer_skip.num_layers=3, --config.confidence_threshold=0.4.
`runlocal` is a seconds-long smoke run: --config=configs/quickstart.py:runlocal
"""

from experiments.harness.config import base_config


def get_config(arg=None):
  config = base_config()
  if arg == "runlocal":
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.gamma = 2
  return config
