"""Loop efficiency: the fused while_loop against the sum of its parts.

  python -m experiments.bench_loop --config=configs/bench_loop.py --workdir=/tmp/bench_loop

A CPU smoke run in seconds: --config=configs/bench_loop.py:runlocal
Models are randomly initialised: only times matter here, not acceptance.
"""

import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  # Target and draft sizes (spec_jax.TransformerConfig fields).
  config.target = dict(vocab_size=256, d_model=512, num_layers=8, num_heads=8,
                       d_ff=2048, max_len=512)
  config.draft = dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4,
                      d_ff=512, max_len=512)
  # Draft lengths and batch sizes to measure.
  config.gammas = (2, 4, 8)
  config.batch_sizes = (1, 8)
  # Prompt tokens per row and tokens to generate per row.
  config.prompt_len = 32
  config.max_new_tokens = 128
  # 0 is greedy.
  config.temperature = 0.0
  # Timed repeats of each measurement (the median is reported).
  config.repeats = 3
  config.seed = 0
  if arg == "runlocal":
    config.target = dict(vocab_size=64, d_model=64, num_layers=2, num_heads=4,
                         d_ff=128, max_len=128)
    config.draft = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2,
                        d_ff=64, max_len=128)
    config.gammas = (2,)
    config.batch_sizes = (1,)
    config.max_new_tokens = 16
    config.repeats = 1
  return config
