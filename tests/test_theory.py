"""The i.i.d. model of Leviathan et al. (2023), against their Table 1."""

import itertools

import numpy as np
import pytest

from spec_jax import theory


@pytest.mark.parametrize("alpha, gamma, speedup", [
    (0.6, 2, 1.96), (0.8, 5, 3.69), (0.9, 10, 6.86)])
def test_paper_table_1_at_zero_draft_cost(alpha, gamma, speedup):
  assert abs(theory.expected_speedup(alpha, gamma, c=0.0) - speedup) < 0.01


def test_tokens_per_cycle_is_the_geometric_sum():
  for alpha in (0.0, 0.3, 0.99, 1.0):
    for gamma in (1, 4, 9):
      direct = sum(alpha ** i for i in range(gamma + 1))
      assert theory.expected_tokens_per_cycle(alpha, gamma) == pytest.approx(
          direct)


def test_speedup_divides_by_the_cycle_cost():
  # Theorem 3.8 is the verify-cost variant with a verify costing one step.
  alpha, gamma, c = 0.7, 5, 0.05
  tau = theory.expected_tokens_per_cycle(alpha, gamma)
  assert theory.expected_speedup(alpha, gamma, c) == pytest.approx(
      tau / (gamma * c + 1))
  assert theory.expected_speedup_with_verify_cost(
      alpha, gamma, c, 2.0) == pytest.approx(tau / (gamma * c + 2))


def test_optimal_gamma_matches_brute_force():
  for alpha in np.linspace(0.05, 0.95, 19):
    for c in (0.01, 0.05, 0.1, 0.3, 0.6):
      for verify_cost in (1.0, 1.5):
        speedups = {g: sum(alpha ** i for i in range(g + 1))
                       / (g * c + verify_cost) for g in range(1, 21)}
        best = max(speedups, key=lambda g: (speedups[g], -g))
        assert theory.optimal_gamma(alpha, c, 20, verify_cost) == best


def test_optimal_gamma_grows_with_alpha_and_shrinks_with_cost():
  assert theory.optimal_gamma(0.9, 0.05, 30) > theory.optimal_gamma(
      0.6, 0.05, 30)
  assert theory.optimal_gamma(0.8, 0.02, 30) > theory.optimal_gamma(
      0.8, 0.2, 30)
  with pytest.raises(ValueError, match="max_gamma"):
    theory.optimal_gamma(0.8, 0.1, 0)


def test_predicted_speedup_is_the_ratio_of_predicted_times():
  # AR: 100 steps of 10 ms + 2 prefills of 30 ms = 1.06 s. SD: 25 cycles of
  # 15 ms (3 draft steps of 1 ms and a 12 ms verify), + 2 x (30 + 5) ms
  # = 0.445 s.
  assert theory.predicted_speedup(
      15e-3, 10e-3, ar_steps=100, sd_cycles=25, num_prefills=2,
      target_prefill_s=30e-3, draft_prefill_s=5e-3) == pytest.approx(
          1.06 / 0.445)


def test_tokens_per_cycle_from_conditional_acceptance_by_enumeration():
  # Draft k is accepted with r_k once drafts 1..k-1 were; a cycle that
  # accepts exactly k of gamma drafts emits k + 1 tokens.
  conditional, gamma = [0.9, 0.7, 0.5], 5
  rates = conditional + [conditional[-1]] * (gamma - len(conditional))
  expected, reach = 0.0, 1.0
  for k in range(gamma + 1):
    stop = 1 - rates[k] if k < gamma else 1.0
    expected += (k + 1) * reach * stop
    if k < gamma:
      reach *= rates[k]
  assert theory.tokens_per_cycle_from_conditional_acceptance(
      conditional, gamma) == pytest.approx(expected)
  # Fewer positions than rates: the first gamma only.
  assert theory.tokens_per_cycle_from_conditional_acceptance(
      conditional, 2) == pytest.approx(1 + 0.9 + 0.9 * 0.7)
  # The same rate at every position is the i.i.d. model.
  assert theory.tokens_per_cycle_from_conditional_acceptance(
      [0.6], 4) == pytest.approx(theory.expected_tokens_per_cycle(0.6, 4))


def test_speedup_from_depth_acceptance_is_tau_over_the_cycle_cost():
  depth_acceptance = [0.8, 0.5]
  tau = theory.tokens_per_cycle_from_depth_acceptance(depth_acceptance)
  assert tau == pytest.approx(2.3)
  assert theory.speedup_from_depth_acceptance(
      depth_acceptance, 0.2, 1.5) == pytest.approx(2.3 / 1.7)


def test_expected_emitted_tokens_matches_a_direct_sum():
  r = np.array([[0.9, 0.5, 0.2], [1.0, 0.0, 1.0]])
  np.testing.assert_allclose(
      theory.expected_emitted_tokens(r),
      [[1, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.09], [1, 2, 2, 2]])
  # The last entry is tau of a full cycle.
  np.testing.assert_allclose(
      theory.expected_emitted_tokens(r)[:, -1],
      theory.tokens_per_cycle_from_conditional_acceptance(r, 3))


def _brute_force_goodput(conditional, active, cycle_cost):
  """Best batch goodput over every per-row choice of k_b in 0..G, with a
  cycle costing by its longest proposal."""
  num_rows, gamma = conditional.shape
  per_row = np.asarray(theory.expected_emitted_tokens(conditional))
  best = 0.0
  for lengths in itertools.product(range(gamma + 1), repeat=num_rows):
    longest = max((k for k, a in zip(lengths, active) if a), default=0)
    tokens = sum(per_row[b, k] for b, k in enumerate(lengths) if active[b])
    best = max(best, tokens / cycle_cost[longest])
  return best


def _random_batch(seed):
  rng = np.random.default_rng(seed)
  num_rows, gamma = rng.integers(1, 4), rng.integers(1, 5)
  conditional = rng.uniform(0, 1, (num_rows, gamma)) ** rng.uniform(0.2, 3)
  active = rng.uniform(size=num_rows) < 0.8
  # max(k, 1) draft passes and a verify of k drafts, which costs at least a
  # step and grows with k.
  draft_cost = rng.uniform(0, 0.5)
  verify_cost = np.concatenate([[1.0],
                                1 + np.cumsum(rng.uniform(0, 0.6, gamma))])
  cycle_cost = np.maximum(np.arange(gamma + 1), 1) * draft_cost + verify_cost
  return conditional, active, cycle_cost


def _goodput(k, conditional, active, cycle_cost):
  per_row = np.asarray(theory.expected_emitted_tokens(conditional))
  return per_row[active, k].sum() / cycle_cost[k]


@pytest.mark.parametrize("seed", range(20))
def test_goodput_optimal_draft_length_is_the_brute_force_optimum(seed):
  batch = _random_batch(seed)
  k = int(theory.goodput_optimal_draft_length(*batch))
  assert 0 <= k <= batch[0].shape[1]
  np.testing.assert_allclose(_goodput(k, *batch),
                             _brute_force_goodput(*batch), rtol=1e-12)


def test_brute_force_check_rejects_always_drafting_gamma():
  """Negative control: the same check fails a policy that always drafts
  gamma, on some of the same batches."""
  misses = 0
  for seed in range(20):
    batch = _random_batch(seed)
    gamma = batch[0].shape[1]
    misses += _goodput(gamma, *batch) < _brute_force_goodput(*batch) - 1e-9
  assert misses > 0


def test_goodput_optimal_draft_length_stops_drafting_when_nothing_is_accepted():
  cycle_cost = np.array([1.05, 1.85, 2.1])
  never = np.zeros((4, 2))
  assert theory.goodput_optimal_draft_length(never, np.ones(4, bool),
                                             cycle_cost) == 0
  always = np.ones((4, 2))
  assert theory.goodput_optimal_draft_length(always, np.ones(4, bool),
                                             cycle_cost) == 2


def test_conditional_acceptance_estimate_moves_from_the_prior_to_the_counts():
  estimate = theory.conditional_acceptance_estimate(
      accepted=[[0, 0], [90, 9]], tried=[[0, 0], [100, 90]],
      prior_rate=0.5, prior_weight=10)
  np.testing.assert_allclose(estimate, [[0.5, 0.5], [95 / 110, 14 / 100]])
