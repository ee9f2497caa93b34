"""Rejection sampling that makes speculative output follow the target law.

For drafts d_1..d_G drawn from q_1..q_G and target laws p_1..p_{G+1}:

  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), left to right;
  at the first rejection i, emit a correction from norm(max(0, p_i - q_i));
  if all G are accepted, emit a bonus token from p_{G+1}.

Accepting keeps exactly min(p, q) of each token's mass, the correction adds
max(0, p - q), and the two sum to p. Writing q_{G+1} = 0 makes the bonus the
same formula as the correction, which is how `correction_probs` treats it.

The same convention lets a row propose fewer than G drafts: a position whose
q_i is all zero proposes nothing, is always rejected, and its correction is
norm(max(0, p_i - 0)) = p_i, so the row emits a token of p_i there, exactly as
a cycle with fewer drafts would. Dynamic gamma and prompt lookup without a
match use this. A one-hot q_i (a deterministic draft d) needs nothing special:
d is accepted with probability p_i(d), and the correction is p_i with d
removed and renormalised.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from spec_jax import sampling


def draft_token_probs(draft_tokens: jax.Array,
                      draft_probs: jax.Array) -> jax.Array:
  """q_i(d_i): [B, G]; 0 where a row proposed nothing."""
  return sampling.probs_at(draft_probs, draft_tokens)


def acceptance_probs(
    draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> jax.Array:
  """min(1, p_i(d_i) / q_i(d_i)) for each draft: [B, G] float32."""
  gamma = draft_tokens.shape[-1]
  p = sampling.probs_at(target_probs[:, :gamma], draft_tokens)
  q = draft_token_probs(draft_tokens, draft_probs)
  # q > 0 for any token drawn from q; q = 0 marks a position that proposes
  # nothing, which is rejected.
  return jnp.where(q > 0, jnp.minimum(1.0, p / jnp.where(q > 0, q, 1.0)), 0.0)


def correction_probs(
    draft_probs: jax.Array, target_probs: jax.Array
) -> jax.Array:
  """Law of the emitted token after i accepted drafts: [B, G+1, V].

  Row i < G is norm(max(0, p_{i+1} - q_{i+1})); row G is p_{G+1} (the bonus).
  Where p == q the residual is empty, a rejection there has probability 0, and
  the row falls back to p so that it is still a valid law (no NaN).
  """
  q = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))  # q_{G+1} = 0.
  return sampling.normalized(jnp.maximum(target_probs - q, 0.0), target_probs)


def _prefix_length(accepted: jax.Array) -> jax.Array:
  """[B] int32: how many of accepted [B, G] hold before the first False."""
  return jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1, dtype=jnp.int32)


def outcome(
    uniform: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    *,
    correction: Callable[[jax.Array, jax.Array], jax.Array] = correction_probs,
) -> tuple[jax.Array, jax.Array]:
  """Where the rule stops for given acceptance draws, and what it emits there.

  Draft i is accepted when uniform[:, i] < min(1, p_i(d_i) / q_i(d_i)).
  `resample` is this function with uniforms drawn from its key, followed by
  one draw from next_probs; the enumeration tests drive it with controlled
  uniforms to compute the rule's exact law.

  Args:
    uniform: [B, G] float32 in [0, 1), one per draft.
    draft_tokens, draft_probs, target_probs, correction: as `resample`.

  Returns:
    num_accepted [B] int32 in [0, G], the length of the accepted prefix, and
    next_probs [B, V], the law of the token emitted after it.
  """
  accepted = uniform < acceptance_probs(draft_tokens, draft_probs,
                                        target_probs)
  num_accepted = _prefix_length(accepted)
  next_probs = jnp.take_along_axis(
      correction(draft_probs, target_probs),
      num_accepted[:, None, None], axis=1)[:, 0]
  return num_accepted, next_probs


def emitted_tokens(draft_tokens: jax.Array, num_accepted: jax.Array,
                   next_token: jax.Array) -> jax.Array:
  """[B, G+1] int32: draft_tokens[b, :n], then next_token[b] repeated."""
  drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
  position = jnp.arange(drafts.shape[1])
  return jnp.where(position < num_accepted[:, None], drafts,
                   next_token[:, None]).astype(jnp.int32)


def resample(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    *,
    greedy: bool = False,
    correction: Callable[[jax.Array, jax.Array], jax.Array] = correction_probs,
) -> tuple[jax.Array, jax.Array]:
  """Accepts a prefix of the drafts and appends one correction or bonus token.

  Args:
    key: PRNG key.
    draft_tokens: [B, G] int32, d_1..d_G.
    draft_probs: [B, G, V] float32, q_1..q_G, the laws the drafts came from;
      all zero where a row proposes nothing.
    target_probs: [B, G+1, V] float32, p_1..p_{G+1}.
    greedy: temperature 0: accept while d_i == argmax p_i, then emit argmax.
    correction: the token rule's (draft_probs, target_probs) -> [B, G+1, V],
      the law of the emitted token after i accepted drafts. Exact only as
      `correction_probs`; a negative control passes a wrong one.

  Returns:
    tokens [B, G+1] int32 and num_accepted [B] int32 in [0, G]. With
    n = num_accepted[b], tokens[b, :n] == draft_tokens[b, :n] and tokens[b, n]
    is the correction (n < G) or the bonus (n == G). Entries after n repeat
    tokens[b, n].
  """
  if greedy:
    gamma = draft_tokens.shape[-1]
    target_argmax = sampling.argmax(target_probs)  # [B, G+1]
    proposed = draft_token_probs(draft_tokens, draft_probs) > 0
    accepted = (draft_tokens == target_argmax[:, :gamma]) & proposed
    num_accepted = _prefix_length(accepted)
    next_token = jnp.take_along_axis(target_argmax, num_accepted[:, None],
                                     1)[:, 0]
  else:
    accept_key, key = jax.random.split(key)
    uniform = jax.random.uniform(accept_key, draft_tokens.shape)  # [0, 1)
    num_accepted, next_probs = outcome(uniform, draft_tokens, draft_probs,
                                       target_probs, correction=correction)
    next_token = sampling.categorical(key, next_probs)
  return emitted_tokens(draft_tokens, num_accepted, next_token), num_accepted


def overlap(draft_probs: jax.Array, target_probs: jax.Array) -> jax.Array:
  """sum_x min(p_i(x), q_i(x)) per draft position: [B, G].

  This is the acceptance probability at position i averaged over q_i, the
  alpha of Leviathan et al. (2023).
  """
  gamma = draft_probs.shape[1]
  return jnp.minimum(draft_probs, target_probs[:, :gamma]).sum(-1)


def point_mass_acceptance(draft_probs: jax.Array,
                          target_probs: jax.Array) -> jax.Array:
  """sum_x q_i(x) p_i(x) per draft position: [B, G].

  The acceptance probability at position i, averaged over q_i, of a verifier
  that treats the draft x as a point mass (q one-hot at x): it accepts with
  min(1, p(x) / 1) = p(x). That rule is exact too (rejection sampling from
  any proposal law is), but accepts no more than min(1, p(x) / q(x)) at
  every x, hence `overlap` >= this.
  """
  gamma = draft_probs.shape[1]
  return (draft_probs * target_probs[:, :gamma]).sum(-1)
