"""spec_jax against HF transformers (plain and assisted generation).

  python -m experiments.compare_hf --config=configs/compare_hf.py --workdir=/tmp/compare_hf

Needs torch and transformers: pip install torch==2.13.0, then
pip install -e '.[hf]'. A seconds-long smoke run:
--config=configs/compare_hf.py:runlocal
"""

from experiments.harness.config import base_config


def get_config(arg=None):
  # The main job's fields; target and draft are "hf:DIR" Hugging Face
  # folders, or spec_jax model directories, which are exported to WORKDIR/hf/
  # first ("pretrained/NAME" is the built-in pair).
  config = base_config()
  # Drafts per cycle, for spec_jax and HF assisted generation alike.
  config.gamma = 8
  # Temperatures; 0 is greedy. No top-k or top-p.
  config.temperatures = (0.0, 1.0)
  # Rows per call; HF assisted generation only supports 1.
  config.batch_sizes = (1, 8)
  # max_new_tokens tokens per row, with no EOS stop, so every row makes as
  # many; prompts as in the main job, cut to the shortest one's tokens.
  # torch intra-op threads (JAX keeps its default). On the shared 2-core
  # development machine, 1 thread made HF generate 5x faster than 2.
  config.threads = 1
  # Each decoder's time is the median of this many runs over all prompts.
  config.timing_repeats = 3
  if arg == "runlocal":
    config.temperatures = (0.0,)
    config.batch_sizes = (1, 2)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.gamma = 2
  return config
