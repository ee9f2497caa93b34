"""Lossless check on real models: N AR and N SD continuations of one prompt,
compared position by position with two-sample chi-square tests.

  python -m experiments.exactness --config=configs/exactness.py --workdir=/tmp/exactness

`runlocal` is a seconds-long smoke run: --config=configs/exactness.py:runlocal
"""

from experiments.harness.config import base_config


def get_config(arg=None):
  # The models and drafter fields of the main job (--config.drafter=ngram or
  # layer_skip checks the other drafters); the sampling settings are below.
  config = base_config()
  config.gamma = 4
  # Continuations drawn by each of AR and SD.
  config.num_samples = 20000
  # Rows decoded together.
  config.batch_size = 2000
  config.max_new_tokens = 6
  # The prompt text.
  config.prompt = "def "
  # Sampling settings, (temperature, top_p) pairs.
  config.settings = ((1.0, 1.0), (1.0, 0.9))
  # Reject at this significance after a Bonferroni correction over positions.
  config.significance = 0.001
  config.seed = 0
  if arg == "runlocal":
    config.num_samples = 400
    config.batch_size = 200
    config.max_new_tokens = 3
  return config
