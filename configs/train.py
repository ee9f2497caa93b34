"""Training the built-in pair on the Python standard library's source.

The target, then a draft that learns from the data, or from the target:

  python -m experiments.train --config=configs/train.py:target --workdir=/tmp/train/target
  python -m experiments.train --config=configs/train.py:draft --workdir=/tmp/train/draft \
      --config.tokenizer=/tmp/train/target/model
  python -m experiments.train --config=configs/train.py:draft_distill \
      --workdir=/tmp/train/draft_tvd --config.teacher=/tmp/train/target/model \
      --config.tokenizer=/tmp/train/target/model \
      --config.init_from=/tmp/train/draft/model

`runlocal` is a seconds-long smoke run: --config=configs/train.py:runlocal
"""

import ml_collections

TARGET = dict(d_model=384, num_layers=6, num_heads=6, d_ff=1536, max_len=512)
DRAFT = dict(d_model=128, num_layers=2, num_heads=4, d_ff=512, max_len=512)


def get_config(arg="target"):
  config = ml_collections.ConfigDict()
  # Text source: "" is the Python standard library; else a file or folder.
  config.corpus = ""
  # Percent of files held out for evaluation and prompts (by name hash).
  config.heldout_percent = 5
  # A model directory whose tokenizer to reuse; "" trains a new one.
  config.tokenizer = ""
  # Size of a newly trained byte-level BPE vocabulary.
  config.vocab_size = 512
  # TransformerConfig fields other than vocab_size.
  config.model = TARGET
  # Learn from a teacher's laws instead of the data: "", "kl" or "tvd".
  config.distill = ""
  # The teacher's model directory when distilling.
  config.teacher = ""
  # A model directory to start from instead of a random initialisation.
  config.init_from = ""
  # Optimisation.
  config.batch_size = 16
  config.seq_len = 128
  config.num_steps = 700
  config.learning_rate = 2e-3
  config.warmup_steps = 50
  config.weight_decay = 0.01
  config.grad_clip = 1.0
  # Logging, evaluation (held-out batches of batch_size) and checkpoints.
  config.log_every = 50
  config.eval_every = 100
  config.eval_batches = 8
  config.checkpoint_every = 100
  # dtype of the exported parameters ("" keeps the model's).
  config.storage_dtype = ""
  config.seed = 0
  if arg == "target":
    config.storage_dtype = "bfloat16"  # Halves the committed files.
  elif arg == "draft":
    config.model = DRAFT
    config.num_steps = 1500
  elif arg == "draft_distill":
    # Fine-tunes the data-trained draft (init_from) toward the target's laws.
    config.model = DRAFT
    config.distill = "tvd"
    config.num_steps = 300
    config.warmup_steps = 20
    config.learning_rate = 5e-4
  elif arg == "runlocal":
    config.model = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64,
                        max_len=128)
    config.vocab_size = 300
    config.batch_size = 4
    config.seq_len = 32
    config.num_steps = 20
    config.warmup_steps = 2
    config.log_every = 5
    config.eval_every = 10
    config.eval_batches = 2
    config.checkpoint_every = 10
  else:
    raise ValueError(f"unknown variant {arg!r}: target, draft, draft_distill "
                     "or runlocal.")
  return config
