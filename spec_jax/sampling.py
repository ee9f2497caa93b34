"""Sampling transforms shared by autoregressive and speculative decoding.

The same `Sampling` turns target logits into p and draft logits into q, so the
law speculative decoding preserves is exactly the law plain sampling draws
from. Order, as in HF transformers: temperature, then top-k, then top-p.
Temperature 0 means greedy: the distribution is one-hot at the argmax.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How logits become a next-token distribution.

  temperature: 0 for greedy, else logits are divided by it.
  top_k: keep the k most likely tokens; 0 keeps all.
  top_p: keep the smallest set of most likely tokens whose mass reaches top_p;
    1 keeps all.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(
          f"temperature={self.temperature} is negative; use 0 for greedy "
          "decoding or a positive value to sample."
      )
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} is negative; use 0 to keep all.")
    if not 0 < self.top_p <= 1:
      raise ValueError(
          f"top_p={self.top_p} is outside (0, 1]; use 1 to keep all tokens."
      )

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def probs(self, logits: jax.Array) -> jax.Array:
    """float32 distribution [..., V] from logits [..., V] of any dtype."""
    logits = logits.astype(jnp.float32)
    if self.greedy:
      return jax.nn.one_hot(argmax(logits), logits.shape[-1])
    logits = logits / self.temperature
    if self.top_k:
      kth_largest = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
      logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if self.top_p < 1:
      sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
      sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
      # Keep a token if the mass strictly before it is below top_p; the most
      # likely token is always kept.
      mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
      kept = mass_before < self.top_p
      smallest_kept = jnp.min(
          jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True
      )
      logits = jnp.where(logits < smallest_kept, -jnp.inf, logits)
    return jax.nn.softmax(logits, axis=-1)

  def sample(self, key: jax.Array, probs: jax.Array) -> jax.Array:
    """int32 tokens [...] drawn from probs [..., V] (argmax when greedy)."""
    if self.greedy:
      return argmax(probs)
    return categorical(key, probs)


def argmax(x: jax.Array) -> jax.Array:
  """int32 index [...] of the first maximum of x [..., V], as jnp.argmax
  (a NaN counts as the maximum).

  Written as plain reductions (the max, then the smallest index that
  attains it), which XLA:CPU vectorises, where jnp.argmax's (value, index)
  pair reduction does not: over [7, 49152] on CPU, 0.36 ms against 0.9, paid
  once per target step or verify.
  """
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  is_nan = jnp.isnan(x)
  is_max = jnp.where(is_nan.any(-1, keepdims=True), is_nan,
                     x == jnp.max(x, -1, keepdims=True))
  return jnp.min(jnp.where(is_max, index, x.shape[-1]), -1)


def categorical(key: jax.Array, probs: jax.Array) -> jax.Array:
  """int32 draws [...] from (possibly unnormalised) probs [..., V] >= 0."""
  return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def normalized(probs: jax.Array, fallback: jax.Array) -> jax.Array:
  """probs [..., V] >= 0 scaled to sum to 1, or `fallback` where their mass
  is 0 (an empty residual: the event it is the law of has probability 0)."""
  mass = probs.sum(-1, keepdims=True)
  return jnp.where(mass > 0, probs / jnp.where(mass > 0, mass, 1.0), fallback)


def probs_at(probs: jax.Array, tokens: jax.Array) -> jax.Array:
  """probs [..., V] at tokens [...] -> [...]: each token's probability."""
  return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
