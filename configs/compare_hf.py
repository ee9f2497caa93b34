"""spec_jax against HF transformers (plain and assisted generation).

  python -m experiments.compare_hf --config=configs/compare_hf.py --workdir=/tmp/compare_hf

Needs torch and transformers: pip install torch==2.13.0, then
pip install -e '.[hf]'. A seconds-long smoke run:
--config=configs/compare_hf.py:runlocal
"""

import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  # "hf:DIR" Hugging Face folders, or spec_jax model directories, which are
  # exported to WORKDIR/hf/ first ("pretrained/NAME" is the built-in pair).
  config.target = "pretrained/target"
  config.draft = "pretrained/draft"
  # Drafts per cycle, for spec_jax and HF assisted generation alike.
  config.gamma = 8
  # Comma-separated temperatures; 0 is greedy. No top-k or top-p.
  config.temperature = "0,1"
  # Rows per call; HF assisted generation only supports 1.
  config.batch_sizes = (1, 8)
  # Tokens generated per row; no EOS stop, so every row makes this many.
  config.max_new_tokens = 96
  # Prompts, as in configs/quickstart.py; cut to the shortest one's tokens.
  config.prompts_file = ""
  config.num_prompts = 8
  config.prompt_tokens = 64
  config.corpus = ""
  config.heldout_percent = 5
  config.seed = 0
  # torch intra-op threads (JAX keeps its default). On the shared 2-core
  # development machine, 1 thread made HF generate 5x faster than 2.
  config.threads = 1
  if arg == "runlocal":
    config.temperature = "0"
    config.batch_sizes = (1, 2)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.gamma = 2
  return config
