"""Draft trees against chains on the built-in pair, at a similar verify budget.

  python -m experiments.tree_ablation --config=configs/tree_ablation.py --workdir=/tmp/tree_ablation

Writes trees.json, trees.csv and trees.png into the workdir. Overrides read
naturally, e.g. --config.chains=4,8 --config.trees="(2,1,1,1),(4,1)"
--config.temperatures=0. `eagle3` drafts every shape with the built-in
target's EAGLE-3 head instead of the draft model:
--config=configs/tree_ablation.py:eagle3. `runlocal` is a smoke run:
--config=configs/tree_ablation.py:runlocal
"""

from configs import quickstart


def get_config(arg=None):
  # The main job's settings (models, prompts, sampling, batch size), so the
  # ablation measures what `experiments.run` measures, for every shape.
  config = quickstart.get_config()
  # Chains of gamma drafts, one row each (and per temperature).
  config.chains = (8,)
  # Tree templates, branching per depth (spec_jax.TreeTemplate), with N
  # nodes verified per cycle: 8 for the first two, as the chain's 8; 10; 21.
  config.trees = ((2, 1, 1, 1), (4, 1), (2, 2, 1), (3, 2, 1, 1))
  # Fewer prompts than the main job's 8, so that 10 rows take about 10
  # minutes on 2 cores.
  config.num_prompts = 4
  config.timing_repeats = 1
  del config["gamma"]  # set per row from chains; a tree's template fixes it
  if arg == "eagle3":
    # The head's chain at gamma 6 (as on the drafter comparison) and two
    # trees of depth 4, verifying 8 and 21 nodes, on the main job's 8
    # prompts (the drafter comparison's).
    config.drafter = "eagle3"
    config.chains = (6,)
    config.trees = ((2, 1, 1, 1), (3, 2, 1, 1))
    config.num_prompts = 8
  elif arg == "runlocal":
    config.chains = (2,)
    config.trees = ((2, 1),)
    config.num_prompts = 2
    config.max_new_tokens = 8
  return config
