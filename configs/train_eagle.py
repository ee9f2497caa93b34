"""Training an EAGLE-3 head (spec_jax/eagle.py) for a target.

The built-in target, on its own greedy continuations of the corpus (about
an hour on 2 CPU cores):

  python -m experiments.train_eagle --config=configs/train_eagle.py --workdir=/tmp/eagle/builtin

SmolLM2-135M-Instruct, on its own greedy replies to requests it writes
itself and to code requests made from the corpus (self-distillation; about
2.4 hours on 2 CPU cores, estimated: 7 training-time steps took twice
as long as 3 on the built-in head):

  python -m experiments.train_eagle --config=configs/train_eagle.py:smollm2 --workdir=/tmp/eagle/smollm2

Interrupt either and run the same command again: it resumes. Use the head
with `--config.drafter=eagle3 --config.eagle=WORKDIR/head`; WORKDIR/head
is in SpecForge's layout, which vLLM, SGLang and SpecForge load too.
`runlocal` is a seconds-long smoke run on the built-in target.
"""

import ml_collections


def get_config(arg="builtin"):
  config = ml_collections.ConfigDict()
  config.target = "pretrained/target"
  # "corpus": windows of the corpus; "self_distill": the target's replies to
  # instructions (a chat model) or continuations of corpus windows (a base
  # model), with the loss on what it wrote.
  config.data = "self_distill"
  config.corpus = ""  # "" is the Python standard library
  # Corpus windows, or prompts for the target to continue or reply to.
  config.num_sequences = 2048
  # Tokens per sequence: a corpus window, or a prompt and its reply
  # (prompts longer than seq_len - max_new_tokens are dropped).
  config.seq_len = 256
  # Self-distillation only: a base model's prompts are prompt_tokens of the
  # corpus.
  config.prompt_tokens = 64
  config.max_new_tokens = 192
  config.generate_batch_size = 64
  config.generate_temperature = 0.0
  # Chat models only: this fraction of the instructions are requests the
  # target writes itself (Magpie), up to request_tokens long; the rest are
  # made from the corpus (code to write, explain or summarise).
  config.user_request_fraction = 0.0
  config.request_tokens = 64
  # The head: the inputs of these target blocks, fused (index L is the last
  # block's output); () is EAGLE-3's (2, L // 2, L - 3). reduced_vocab K > 0
  # drafts over the K tokens most often the target's argmax (the published
  # draft_vocab_size, d2t and t2d); 0 over the whole vocabulary. Either way
  # the head's lm_head starts as the target's output rows.
  # Low, middle, last of the 6 blocks (the shipped head's). The serving
  # engines capture block inputs only, not the last block's output (6), so
  # a head meant for them reads e.g. (2, 3, 5); save_eagle3 warns.
  config.feature_layers = (2, 4, 6)
  config.reduced_vocab = 0
  # RMS-norm each feature layer before fc (SpecForge's fc_norm), for targets
  # whose layers' features differ in scale.
  config.fc_norm = False
  # The target's law is stored truncated to its top_k logits.
  config.top_k = 32
  config.feature_batch_size = 16  # data=corpus: sequences per target pass
  # Training-time test: unrolled steps, weighted 0.8^k. 7, SpecForge's
  # default: with 3 the built-in head's drafts 4-6 were accepted 0.70, 0.74
  # and 0.35 of the time given the ones before (docs/eagle.md).
  config.ttt_steps = 7
  config.batch_size = 8
  config.num_steps = 900
  config.learning_rate = 2e-3
  config.warmup_steps = 50
  config.weight_decay = 0.0
  config.grad_clip = 0.5
  config.log_every = 25
  config.eval_every = 100
  config.eval_sequences = 64  # held out, drawn at random
  config.checkpoint_every = 100
  # dtype of the exported head ("" keeps float32); bfloat16 halves the files.
  config.storage_dtype = "bfloat16"
  config.seed = 0
  if arg == "smollm2":
    config.target = "gguf:smollm2-135m-instruct"
    config.feature_layers = ()  # (2, 15, 27) of 30 blocks
    # 8,000 replies of up to 96 tokens (the main job's are 64): about 40
    # minutes of generation on 2 CPU cores, features recorded on the way.
    config.num_sequences = 8000
    config.user_request_fraction = 0.6  # the rest: code from the corpus
    config.request_tokens = 48
    config.max_new_tokens = 96
    config.seq_len = 256  # prompts of up to 160 tokens
    # A sixth of the 49,152 tokens: the output layer then costs about the
    # head's block, in training and in every draft step, and covers most of
    # the target's replies.
    config.reduced_vocab = 8192
    config.batch_size = 16
    config.num_steps = 800  # 3.3M token positions
    config.eval_every = 50
    config.eval_sequences = 64
  elif arg == "runlocal":
    config.num_sequences = 24
    config.seq_len = 32
    config.prompt_tokens = 8
    config.max_new_tokens = 24
    config.generate_batch_size = 8
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
