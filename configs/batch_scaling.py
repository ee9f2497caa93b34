"""Batch scaling on the built-in pair: SD/AR speedup, tau, verify / step and
the theory's prediction at each batch size, at T=0 and T=1.

  python -m experiments.batch_scaling --config=configs/batch_scaling.py --workdir=/tmp/batch_scaling

Writes batch_scaling.json and batch_scaling.png into the workdir. Overrides
read naturally, e.g. --config.batch_sizes=1,8,32 --config.temperatures=0
--config.gamma=4. `runlocal` is a smoke run:
--config=configs/batch_scaling.py:runlocal
"""

from configs import quickstart


def get_config(arg=None):
  # The main job's settings (models, drafter, gamma 8, sampling), so the
  # ablation measures what `experiments.run` measures, at every batch size.
  config = quickstart.get_config()
  # Rows decoded together, one row each (and per temperature).
  config.batch_sizes = (1, 2, 4, 8, 16, 32)
  # Enough prompts to fill the largest batch: a padding row costs time but
  # emits no counted token.
  config.num_prompts = 32
  # At least this many timing rounds per row: a large batch runs few batches,
  # and a round is timed after each.
  config.rounds = 5
  del config["batch_size"]  # set per row from batch_sizes
  if arg == "runlocal":
    config.batch_sizes = (1, 2)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.gamma = 2
    config.rounds = 2
  return config
