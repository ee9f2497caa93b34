"""Lossless check on real models: N AR and N SD continuations of one prompt,
compared by two-sample chi-square tests, per position and over whole
continuations, beside a negative control the same tests must reject.

  python -m experiments.exactness --config=configs/exactness.py --workdir=/tmp/exactness

It exits nonzero when a test finds SD's law different from AR's, or misses
the control's: --config.candidate=correction_from_p runs the control as the
candidate, which must fail. `runlocal` is a seconds-long smoke run:
--config=configs/exactness.py:runlocal
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
  # Reject at this significance after a Bonferroni correction over the
  # 2 max_new_tokens - 1 tests (each position, each prefix of 2 or more).
  config.significance = 0.001
  # SD's rule: "exact" (the decode's own) or "correction_from_p", the
  # negative control, which the tests must reject.
  config.candidate = "exact"
  # Also run the negative control beside the candidate, as a check of power.
  config.negative_control = True
  config.seed = 0
  if arg == "runlocal":
    config.num_samples = 400
    config.batch_size = 200
    config.max_new_tokens = 3
    # 400 samples cannot tell the control apart on the built-in pair.
    config.negative_control = False
  return config
