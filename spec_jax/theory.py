"""What the i.i.d. model of Leviathan et al. (2023) predicts.

If each draft is accepted independently with probability alpha, a cycle of
gamma drafts yields

  tau = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha)

tokens (Eq. 1), and costs gamma draft steps plus one verify. With the draft
step costing c target steps and the verify costing v target steps (v = 1 in
the paper), the walltime improvement over autoregressive decoding is

  speedup = tau / (gamma * c + v)          (Theorem 3.8 when v = 1).

Every function takes scalars or numpy arrays, which broadcast (the three of
the adaptive draft length, at the end, return jax arrays).
"""

import jax.numpy as jnp
import numpy as np


def expected_tokens_per_cycle(alpha, gamma):
  """tau: expected tokens per cycle, (1 - alpha^(gamma+1)) / (1 - alpha)."""
  alpha = np.asarray(alpha, np.float64)
  gamma = np.asarray(gamma)
  # At alpha = 1 the sum is gamma + 1; np.where evaluates both branches, so
  # the denominator is kept away from 0.
  ratio = (1 - alpha ** (gamma + 1)) / np.where(alpha == 1, 1.0, 1 - alpha)
  return np.where(alpha == 1, gamma + 1.0, ratio)


def expected_speedup_with_verify_cost(alpha, gamma, c, verify_cost):
  """tau / (gamma * c + verify_cost).

  verify_cost is T_verify(gamma + 1 tokens) / T_target(1 token), which the
  paper takes as 1; on real hardware it grows with gamma.
  """
  return expected_tokens_per_cycle(alpha, gamma) / (
      np.asarray(gamma) * c + verify_cost)


def expected_speedup(alpha, gamma, c):
  """Theorem 3.8: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma * c + 1))."""
  return expected_speedup_with_verify_cost(alpha, gamma, c, 1.0)


def optimal_gamma(alpha: float, c: float, max_gamma: int,
                  verify_cost: float = 1.0) -> int:
  """The integer gamma in [1, max_gamma] with the largest expected speedup.

  Ties go to the smaller gamma (less wasted draft work for the same speed).
  """
  if max_gamma < 1:
    raise ValueError(f"max_gamma={max_gamma} must be >= 1.")
  gammas = np.arange(1, max_gamma + 1)
  speedups = expected_speedup_with_verify_cost(alpha, gammas, c, verify_cost)
  return int(gammas[np.argmax(speedups)])


def predicted_speedup(cycle_s, target_step_s, *, ar_steps, sd_cycles,
                      num_prefills=0, target_prefill_s=0.0,
                      draft_prefill_s=0.0):
  """Speedup predicted from measured component times and work counts.

  AR runs ar_steps target steps of target_step_s; SD runs sd_cycles cycles of
  cycle_s each (gamma draft steps, one verify and its rejection step: timed
  whole, or gamma * draft_step_s + verify_s). Both prefill their prompts
  num_prefills times, SD with the draft too. Comparing this with the measured
  speedup shows what the loops cost beyond their parts.
  """
  ar_s = ar_steps * target_step_s + num_prefills * target_prefill_s
  sd_s = (sd_cycles * np.asarray(cycle_s)
          + num_prefills * (target_prefill_s + draft_prefill_s))
  return ar_s / sd_s


def tokens_per_cycle_from_depth_acceptance(depth_acceptance):
  """tau = 1 + sum_d a_d, for a chain or a tree.

  a_d = P(a cycle accepts d drafts or more), by depth d = 1..D (a chain's
  acceptance by position, `DecodeStats.position_acceptance`): a cycle emits
  one token for every accepted depth and one more from the target.
  """
  return 1 + np.sum(np.asarray(depth_acceptance, np.float64), axis=-1)


def tokens_per_cycle_from_conditional_acceptance(conditional, gamma: int):
  """tau = 1 + r_1 + r_1 r_2 + ... + r_1 r_2 ... r_gamma.

  r_k = P(draft k is accepted | drafts 1..k-1 were), by position k (a
  chain's `DecodeStats.conditional_position_acceptance`, or an EAGLE head's
  held-out greedy acceptance by draft), so a_d = r_1 ... r_d is the depth
  acceptance of `tokens_per_cycle_from_depth_acceptance`. Positions past the
  last rate given are accepted at the last rate. With r_k = alpha for every
  k this is the i.i.d. model's `expected_tokens_per_cycle`.
  """
  rates = np.asarray(conditional, np.float64)
  beyond = np.repeat(rates[..., -1:], max(0, gamma - rates.shape[-1]), -1)
  rates = np.concatenate([rates, beyond], -1)[..., :gamma]
  return tokens_per_cycle_from_depth_acceptance(np.cumprod(rates, -1))


def speedup_from_depth_acceptance(depth_acceptance, draft_cost, verify_cost):
  """(1 + sum_d a_d) / (draft_cost + verify_cost), for a chain or a tree.

  The numerator is tau (`tokens_per_cycle_from_depth_acceptance`);
  draft_cost and verify_cost are the cycle's draft passes and its verify of
  all N drafts, in target steps. A verify that costs one step whatever N (an
  accelerator with room to spare) is verify_cost = 1.
  """
  return tokens_per_cycle_from_depth_acceptance(depth_acceptance) / (
      np.asarray(draft_cost) + np.asarray(verify_cost))


# The adaptive draft length (draft_length.py) runs these three in the decode
# loop: they take numpy or jax arrays and return jax arrays.


def conditional_acceptance_estimate(accepted, tried, prior_rate,
                                    prior_weight: float):
  """Each row's r_i as a posterior mean: [..., G].

    r_i = (accepted_i + w r0) / (tried_i + w),

  with accepted_i and tried_i a row's counts of cycles in which draft i was
  accepted and in which it was tried (proposed with drafts 1..i-1
  accepted), r0 = prior_rate and w = prior_weight pseudo-trials (a Beta
  prior), so that a row with no history drafts by the prior and a row's own
  counts take over as they grow. prior_rate: a scalar, or one per position
  [G] (a pooled rate, draft_length.py).
  """
  accepted = jnp.asarray(accepted, jnp.float32)
  tried = jnp.asarray(tried, jnp.float32)
  return (accepted + prior_weight * prior_rate) / (tried + prior_weight)


def expected_emitted_tokens(conditional):
  """E_b(k) = 1 + r_1 + r_1 r_2 + ... + r_1 ... r_k, for k = 0..G: [..., G+1].

  conditional: [..., G] r_i = P(draft i accepted | drafts 1..i-1 were), a
  row's estimate by position. A cycle of k drafts emits one token per
  accepted draft and one more from the target, so E_b(0) = 1 is a plain
  target step.
  """
  depth = jnp.cumprod(jnp.asarray(conditional, jnp.float32), axis=-1)
  return 1 + jnp.cumsum(jnp.pad(depth, [(0, 0)] * (depth.ndim - 1) + [(1, 0)]),
                        axis=-1)


def expected_goodput(conditional, active, cycle_cost):
  """sum_b active_b E_b(K) / C(K) for K = 0..G: [G+1], the batch's expected
  tokens per unit cost of a cycle of K drafts (`goodput_optimal_draft_length`
  says what the arguments are)."""
  per_row = expected_emitted_tokens(conditional)  # [B, G+1]
  tokens = jnp.where(jnp.asarray(active)[:, None], per_row, 0.0).sum(0)
  return tokens / jnp.asarray(cycle_cost, jnp.float32)


def goodput_optimal_draft_length(conditional, active, cycle_cost):
  """The K in 0..G that maximises the batch's expected tokens per unit cost,

    K* = argmax_K  sum_b active_b E_b(K) / C(K),

  with C(K) = cycle_cost[K] the cost of a cycle whose longest proposal is K
  drafts, in target steps at this batch size. Why one K for every row: a
  cycle's passes have fixed shapes, so its cost depends only on the longest
  proposal, while each E_b grows with k; so once the longest is K, every
  other row proposing K too costs nothing and emits more in expectation.
  The best per-row choice k_b is therefore k_b = K* for all rows (the test
  checks this against a search over every per-row choice).

  conditional: [B, G] each row's r_i; active: [B] bool; cycle_cost: [G+1].
  Returns an int32 scalar; ties go to the smaller K.
  """
  return jnp.argmax(expected_goodput(conditional, active,
                                    cycle_cost)).astype(jnp.int32)
