"""Training an EAGLE head (spec_jax/eagle.py) for a target.

The built-in target, on the corpus (a few minutes on 2 CPU cores):

  python -m experiments.train_eagle --config=configs/train_eagle.py --workdir=/tmp/eagle/builtin

SmolLM2-135M-Instruct, on its own greedy replies to instructions made from
the corpus (self-distillation; hours on 2 CPU cores):

  python -m experiments.train_eagle --config=configs/train_eagle.py:smollm2 --workdir=/tmp/eagle/smollm2

Interrupt either and run the same command again: it resumes. Use the head
with `--config.drafter=eagle --config.eagle=WORKDIR/head`.
`runlocal` is a seconds-long smoke run on the built-in target.
"""

import ml_collections


def get_config(arg="builtin"):
  config = ml_collections.ConfigDict()
  config.target = "pretrained/target"
  # "corpus": windows of the corpus; "self_distill": the target's replies to
  # instructions made from the corpus's functions and modules.
  config.data = "corpus"
  config.corpus = ""  # "" is the Python standard library
  config.num_sequences = 2048  # windows, or instructions to reply to
  config.seq_len = 256  # tokens per sequence (prompt and reply, truncated)
  # Self-distillation only.
  config.max_new_tokens = 160
  config.generate_batch_size = 32
  config.generate_temperature = 0.0
  # The head: the inputs of these target blocks, fused (index L is the last
  # block's output); () is EAGLE-3's (2, L // 2, L - 3). reduced_vocab K > 0 predicts over the K tokens most
  # often the target's argmax; 0 uses the target's output layer.
  config.feature_layers = (2, 4, 6)  # low, middle, last of the 6 blocks
  config.reduced_vocab = 0
  # The target's law is stored truncated to its top_k logits.
  config.top_k = 32
  config.feature_batch_size = 16
  # Training-time test: unrolled steps, weighted 0.8^k.
  config.ttt_steps = 3
  config.batch_size = 16
  config.num_steps = 1500
  config.learning_rate = 3e-3
  config.warmup_steps = 100
  config.weight_decay = 0.0
  config.grad_clip = 0.5
  config.log_every = 50
  config.eval_every = 250
  config.eval_sequences = 64  # held out (the last ones)
  config.checkpoint_every = 100
  # dtype of the exported head ("" keeps float32); bfloat16 halves the files.
  config.storage_dtype = "bfloat16"
  config.seed = 0
  if arg == "smollm2":
    config.target = "gguf:smollm2-135m-instruct"
    config.data = "self_distill"
    config.feature_layers = ()  # (2, 15, 27) of 30 blocks
    config.num_sequences = 640
    config.reduced_vocab = 8192
    config.batch_size = 8
    config.feature_batch_size = 8
    config.num_steps = 3000
    config.learning_rate = 1e-3
    config.eval_every = 500
    config.eval_sequences = 32
  elif arg == "runlocal":
    config.num_sequences = 24
    config.seq_len = 32
    config.batch_size = 4
    config.num_steps = 6
    config.warmup_steps = 1
    config.log_every = 2
    config.eval_every = 3
    config.eval_sequences = 4
    config.checkpoint_every = 3
    config.reduced_vocab = 64
  elif arg != "builtin":
    raise ValueError(f"unknown variant {arg!r}: builtin, smollm2 or runlocal.")
  return config
