"""The prompt lookup replay (experiments/harness/lookup_replay.py) reproduces
the decode loop's cycles exactly, and its costs and bounds add up."""

import jax
import numpy as np
import pytest

import spec_jax as sj
from conftest import tiny_pair
from experiments.harness import lookup_replay

# Rows that repeat themselves, so prompt lookup finds matches of every length.
PROMPTS = [[3, 9, 4, 7, 3, 9, 4, 7, 3, 9], [5, 6, 5, 6, 7, 5, 6], [13, 2]]


def test_replay_by_hand():
  prompt, output = [1, 2, 3, 4, 1, 2], [3, 4, 9, 5, 9, 5, 8]
  # "1 2" matched at 0 proposes 3 4 1 2; the target emits 3 4 9: two
  # accepted, then the correction. "4 9", "9 5" and their last tokens have
  # no earlier copy: plain steps. Then "9" recurs and proposes what followed
  # it, 5 9; the target emits 5 8: one accepted.
  assert lookup_replay.replay_row(prompt, output, gamma=4, max_n=2,
                                  min_n=1) == [(2, 4, 2, 3), (0, 0, 0, 1),
                                               (0, 0, 0, 1), (1, 2, 1, 2)]
  # With min_n = 2 the one-token match proposes nothing; later "9 5"
  # recurs, proposes 9 5 (all that is known after it), and the 8 rejects it.
  assert lookup_replay.replay_row(prompt, output, gamma=4, max_n=2,
                                  min_n=2) == [(2, 4, 2, 3), (0, 0, 0, 1),
                                               (0, 0, 0, 1), (0, 0, 0, 1),
                                               (2, 2, 0, 1)]


@pytest.mark.parametrize("gamma,max_n,min_n", [(4, 3, 1), (3, 2, 2)])
def test_replay_reproduces_the_decode_loop(gamma, max_n, min_n):
  """Greedy SD output equals AR output, so replaying prompt lookup on the AR
  tokens gives the loop's own cycle count, drafts, accepted drafts and
  plain-step cycles, row by row."""
  target, _ = tiny_pair(seed=3, num_layers=2)
  drafter = sj.NgramDrafter(target.vocab_size, max_n=max_n, min_n=min_n)
  config = sj.DecodeConfig(gamma=gamma, max_new_tokens=24,
                           sampling=sj.Sampling(temperature=0.0))
  for prompt in PROMPTS:
    prompts, lengths = sj.pad_prompts([prompt])
    ar = sj.generate_autoregressive(jax.random.key(0), target, prompts,
                                    lengths, config)
    sd = sj.generate(jax.random.key(0), target, drafter, prompts, lengths,
                     config)
    output = np.asarray(ar.tokens[0, :ar.num_tokens[0]]).tolist()
    cycles = np.array(lookup_replay.replay_row(prompt, output, gamma, max_n,
                                               min_n))
    stats = sd.stats.summary()
    assert len(cycles) == stats["row_cycles"]
    assert cycles[:, 3].sum() == len(output)
    assert cycles[:, 1].sum() == stats["drafted"]
    assert cycles[:, 2].sum() == stats["accepted"]
    assert (cycles[:, 1] == 0).sum() == stats["width_cycles"][0]


def test_costs_prediction_and_bound():
  cost = lookup_replay.cycle_costs({"1": 1.5, "2": 1.75, "4": 2.0, "8": 3.0})
  assert [cost(k) for k in (0, 1, 3, 4, 6)] == [1.0, 1.5, 1.875, 2.0, 2.5]
  # Two gamma-4 cycles: one accepts 2 drafts (3 tokens), one is a plain
  # step (1 token). Predicted: 4 tokens for 2.0 + 1.0 steps; the bound
  # verifies only the 2 accepted drafts: 1.75 + 1.0.
  summary = lookup_replay.summarize([(2, 4, 2, 3), (0, 0, 0, 1)], 4,
                                    {"1": 1.5, "2": 1.75, "4": 2.0, "8": 3.0})
  assert summary["tokens"] == 4 and summary["plain_step_share"] == 0.5
  assert summary["predicted_speedup"] == pytest.approx(4 / 3.0)
  assert summary["copy_bound_speedup"] == pytest.approx(4 / 2.75)
  assert summary["accepted_by_match_length"] == {
      "2": {"cycles": 1, "mean_accepted": 2.0, "some_accepted": 1.0}}


def test_bound_takes_a_wider_pass_where_it_was_measured_cheaper():
  """Measured costs can dip with the width (here 2 drafts cost less than 1):
  the bound prices a 1-draft cycle at the 2-draft pass and a plain cycle at
  a step, so it never falls below the setting's own prediction."""
  costs = {"1": 1.2, "2": 1.1, "4": 1.3, "8": 1.5}
  cycles = [(1, 4, 1, 2), (1, 4, 0, 1), (0, 0, 0, 1), (3, 4, 4, 5)]
  summary = lookup_replay.summarize(cycles, 4, costs)
  assert summary["copy_bound_speedup"] == pytest.approx(
      9 / (1.1 + 1.0 + 1.0 + 1.3))
  assert summary["predicted_speedup"] <= summary["copy_bound_speedup"]
