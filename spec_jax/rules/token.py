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
  gamma = draft_tokens.shape[-1]
  target_argmax = sampling.argmax(target_probs)  # [B, G+1]
  if greedy:
    proposed = draft_token_probs(draft_tokens, draft_probs) > 0
    accepted = (draft_tokens == target_argmax[:, :gamma]) & proposed
  else:
    accept_key, key = jax.random.split(key)
    uniform = jax.random.uniform(accept_key, draft_tokens.shape)  # [0, 1)
    accepted = uniform < acceptance_probs(draft_tokens, draft_probs,
                                          target_probs)
  num_accepted = jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1,
                         dtype=jnp.int32)

  if greedy:
    next_token = jnp.take_along_axis(target_argmax, num_accepted[:, None], 1)
  else:
    next_probs = jnp.take_along_axis(
        correction(draft_probs, target_probs),
        num_accepted[:, None, None], axis=1)  # [B, 1, V]
    next_token = sampling.categorical(key, next_probs)
  position = jnp.arange(gamma + 1)
  drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
  tokens = jnp.where(position < num_accepted[:, None], drafts, next_token)
  return tokens.astype(jnp.int32), num_accepted


def overlap(draft_probs: jax.Array, target_probs: jax.Array) -> jax.Array:
  """sum_x min(p_i(x), q_i(x)) per draft position: [B, G].

  This is the acceptance probability at position i averaged over q_i, the
  alpha of Leviathan et al. (2023).
  """
  gamma = draft_probs.shape[1]
  return jnp.minimum(draft_probs, target_probs[:, :gamma]).sum(-1)
