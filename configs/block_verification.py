"""Block verification (Sun et al. 2024) against the token rule, on the
built-in pair at T=1: tau on the same drafts (exact, paired, with the
significance of the gain) and tau and speedup in the full loop.

  python -m experiments.block_verification --config=configs/block_verification.py --workdir=/tmp/block

`runlocal` is a smoke run: --config=configs/block_verification.py:runlocal
"""

from experiments.harness.config import base_config


def get_config(arg=None):
  config = base_config()
  config.temperatures = (1.0,)
  # Draft lengths compared; each runs both rules.
  config.gammas = (2, 4, 8)
  del config["gamma"]  # set per row from gammas
  # Contexts for the paired comparison: every prefix of each held-out prompt
  # from min_context tokens on, every context_stride tokens; draws draft
  # samples at each.
  config.min_context = 8
  config.context_stride = 4
  config.draws = 8
  if arg == "runlocal":
    config.gammas = (2,)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.draws = 2
  return config
