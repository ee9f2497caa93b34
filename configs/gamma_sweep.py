"""The gamma ablation on the built-in pair: speedup and tau against theory.

  python -m experiments.gamma_sweep --config=configs/gamma_sweep.py --workdir=/tmp/gamma_sweep

Writes sweep.json, sweep.csv and three PNG plots into the workdir. Overrides
read naturally, e.g. --config.gammas=2,4,8 --config.temperatures=0.
`runlocal` is a smoke run: --config=configs/gamma_sweep.py:runlocal
"""

from configs import quickstart


def get_config(arg=None):
  # The main job's settings (models, prompts, sampling, batch size), so a
  # sweep measures what `experiments.run` measures, at every gamma.
  config = quickstart.get_config()
  # Draft lengths, one row each (and per temperature).
  config.gammas = tuple(range(1, 11))
  # Runs of AR and SD over all the prompts, taking turns; the median counts.
  # Timed once, a row's SD/AR varied by 10-20% between runs on a 2-core
  # machine, more than neighbouring gammas differ; three turns cost about
  # 15 s more per row (16 minutes for the sweep against 11).
  config.timing_repeats = 3
  # One more run per temperature: the adaptive draft length, drafting up to
  # max(gammas), beside the gammas in the same run.
  config.adaptive_row = True
  # Every verify width, as the gamma rows have: the policy drafts the
  # length whose verify pays, and a width the buckets skipped would price
  # its length at the next wider verify (a few seconds more to compile and
  # calibrate).
  config.adaptive_verify_buckets = max(config.gammas) + 1
  # With adaptive_row: every gamma's SD decode and the policy's, each running
  # every prompt through batch_size refilled rows, and nothing else, take
  # turns in this many turns, each with its own key, after the rows (3-4
  # minutes per temperature). The rows are timed minutes apart, each
  # beside its own AR runs and timers, and between two runs a row moved more
  # than neighbouring gammas differ; at T=1 each turn samples other tokens,
  # and 10 turns keep that noise to a few percent.
  config.head_to_head_turns = 10
  del config["gamma"]  # set per row from gammas
  if arg == "runlocal":
    config.gammas = (1, 2)
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.adaptive_row = False  # its calibration and loop compile too
    config.timing_repeats = 1
    config.head_to_head_turns = 1
  return config
