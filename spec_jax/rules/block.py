"""Block verification: the optimal verifier for one draft chain.

Sun et al., "Block Verification Accelerates Speculative Decoding" (ICLR 2025,
arXiv 2403.10444), Algorithm 2. For drafts d_1..d_G drawn from q_1..q_G and
target laws p_1..p_{G+1}, with q_{G+1} = 0 as in `rules.token`:

  weights    w_0 = 1,  w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i));
  residuals  R_i = max(0, w_i p_{i+1} - q_{i+1}),  m_i = sum_x R_i(x);
  stop probs h_i = m_i / (m_i + 1 - w_i)          (so h_G = w_G);
  draw eta_1..eta_G uniform, keep n = max{i >= 1 : eta_i < h_i} (0 if none),
  and emit a token from norm(R_n) (a correction; the bonus p_{G+1} at n = G).

Unlike the token rule, n is the LAST position that passes, not the first that
fails: an unlikely draft can be kept because later ones make up for it.

Why it is exact: w_i is the chance that the prefix d_1..d_i is still "alive",
and q(d_1..d_i) w_i <= p(d_1..d_i), the target's mass for it. Summing the
next draft out, E[w_{i+1} | d_1..d_i] = w_i - m_i, so h_i is exactly the
chance of stopping at i that keeps P(n >= i | d_1..d_i) = w_i. The mass lost
at the next token, max(0, w_i p_{i+1} - q_{i+1}), is what R_i emits, so the
prefix d_1..d_i followed by any x gets p(d_1..d_i) p_{i+1}(x) in total.
Sun et al. also prove it maximises the expected number of accepted drafts
among verifiers that see only these probabilities, so it never accepts fewer
than the token rule in expectation.

Conventions shared with `rules.resample`: a position whose q_i is all zero
proposes nothing, so w_i = 0 there and after, h_{i-1} = w_{i-1}, and the row
emits from norm(w_{i-1} p_i) = p_i, exactly the token rule's correction for a
shorter chain. Where p == q every w_i = 1 and every draft is kept. At
temperature 0 (one-hot p and q) every w_i is 0 or 1 and the rule reduces to
token-level greedy, which is why `resample_block(..., greedy=True)` runs the
token rule's greedy path.
"""

import jax
import jax.numpy as jnp

from spec_jax import sampling
from spec_jax.rules import token


def weights(draft_tokens: jax.Array, draft_probs: jax.Array,
            target_probs: jax.Array) -> jax.Array:
  """w_0..w_G: [B, G+1] float32, w_0 = 1 and w_i in [0, 1]."""
  gamma = draft_tokens.shape[-1]
  p = sampling.probs_at(target_probs[:, :gamma], draft_tokens)  # [B, G]
  q = sampling.probs_at(draft_probs, draft_tokens)  # [B, G]
  # q = 0 marks a position that proposes nothing: its weight is 0.
  ratio = jnp.where(q > 0, p / jnp.where(q > 0, q, 1.0), 0.0)
  w = [jnp.ones_like(ratio[:, 0])]
  for i in range(gamma):  # gamma is static and small.
    w.append(jnp.minimum(1.0, w[-1] * ratio[:, i]))
  return jnp.stack(w, axis=1)


def _residuals(draft_tokens, draft_probs, target_probs):
  """R_0..R_G [B, G+1, V] and w_0..w_G [B, G+1]."""
  w = weights(draft_tokens, draft_probs, target_probs)
  q = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))  # q_{G+1} = 0.
  return jnp.maximum(w[..., None] * target_probs - q, 0.0), w


def stop_probs(draft_tokens: jax.Array, draft_probs: jax.Array,
               target_probs: jax.Array) -> jax.Array:
  """h_0..h_G: [B, G+1] float32 in [0, 1]; h_0 = 1 (n >= 0 always).

  Where m_i = 0 and w_i = 1 (p_{i+1} == q_{i+1} with the prefix alive for
  sure), stopping at i has probability 0 whatever h_i is; h_i = 1 there, the
  limit of m / m.
  """
  residual, w = _residuals(draft_tokens, draft_probs, target_probs)
  mass = residual.sum(-1)  # [B, G+1]
  denominator = mass + 1.0 - w
  h = jnp.where(denominator > 0, mass / jnp.where(denominator > 0,
                                                    denominator, 1.0), 1.0)
  return h.at[:, 0].set(1.0)


def num_accepted_law(draft_tokens: jax.Array, draft_probs: jax.Array,
                     target_probs: jax.Array) -> jax.Array:
  """P(num_accepted = n | drafts) = h_n prod_{j > n} (1 - h_j): [B, G+1]."""
  h = stop_probs(draft_tokens, draft_probs, target_probs)
  # later_kept[:, n] = prod_{j > n} (1 - h_j).
  later_kept = jnp.cumprod((1.0 - h)[:, :0:-1], axis=1)[:, ::-1]
  later_kept = jnp.pad(later_kept, ((0, 0), (0, 1)), constant_values=1.0)
  return h * later_kept


def emission_probs(draft_tokens: jax.Array, draft_probs: jax.Array,
                   target_probs: jax.Array) -> jax.Array:
  """Law of the emitted token after n accepted drafts: [B, G+1, V].

  Row n is norm(R_n); row G is p_{G+1} (the bonus). An empty residual means
  stopping there has probability 0; the row falls back to p (no NaN).
  """
  residual, _ = _residuals(draft_tokens, draft_probs, target_probs)
  return sampling.normalized(residual, target_probs)


def outcome(uniform: jax.Array, draft_tokens: jax.Array,
            draft_probs: jax.Array, target_probs: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """Where the rule stops for given draws eta, and what it emits there.

  `resample_block` is this function with eta drawn from its key, followed by
  one draw from next_probs; the enumeration tests drive it with controlled
  uniforms to compute the rule's exact law.

  Args:
    uniform: [B, G] float32 in [0, 1), eta_1..eta_G.
    draft_tokens, draft_probs, target_probs: as `resample_block`.

  Returns:
    num_accepted [B] int32 in [0, G], n = max{i : eta_i < h_i} (0 if none),
    and next_probs [B, V], norm(R_n).
  """
  gamma = draft_tokens.shape[-1]
  h = stop_probs(draft_tokens, draft_probs, target_probs)  # [B, G+1]
  position = jnp.arange(1, gamma + 1)
  num_accepted = jnp.max(jnp.where(uniform < h[:, 1:], position, 0), axis=-1)
  num_accepted = num_accepted.astype(jnp.int32)  # [B]
  next_probs = jnp.take_along_axis(
      emission_probs(draft_tokens, draft_probs, target_probs),
      num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  return num_accepted, next_probs


def resample_block(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    *,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Block verification with the contract of `rules.resample`.

  Args:
    key: PRNG key.
    draft_tokens: [B, G] int32, d_1..d_G.
    draft_probs: [B, G, V] float32, q_1..q_G; all zero where a row proposes
      nothing.
    target_probs: [B, G+1, V] float32, p_1..p_{G+1}.
    greedy: temperature 0, where the rule reduces to the token rule's greedy
      one: accept while d_i == argmax p_i, then emit argmax.

  Returns:
    tokens [B, G+1] int32 and num_accepted [B] int32 in [0, G]:
    tokens[b, :n] == draft_tokens[b, :n], tokens[b, n] is the correction
    (n < G) or the bonus (n == G), and entries after n repeat tokens[b, n].
  """
  if greedy:
    return token.resample(key, draft_tokens, draft_probs, target_probs,
                          greedy=True)
  stop_key, key = jax.random.split(key)
  uniform = jax.random.uniform(stop_key, draft_tokens.shape)  # [B, G]
  num_accepted, next_probs = outcome(uniform, draft_tokens, draft_probs,
                                     target_probs)
  next_token = sampling.categorical(key, next_probs)  # [B]
  return (token.emitted_tokens(draft_tokens, num_accepted, next_token),
          num_accepted)
