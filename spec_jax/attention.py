"""Attention of a pass's tokens over the KV cache and their own keys: XLA's
formula, and the CPU kernel's (cpu_matmul.cc), which computes each token's
output the same way whatever else the pass holds.

A pass of T tokens per row sits at cache slots [B, T], consecutive from each
row's pointer. Either it wrote its keys and values there first (a step, a
prefill, a verify outside the loop's width switch), or it left them unwritten
and attends to them directly (kv_cache.PendingWrite says why). Where the
small-row kernel serves the pass, both read the same numbers in the same
order, so a verify's logits equal the steps' bit for bit, with its keys
written or not, and a tree node's equal those of the chain through it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import cpu_matmul

# Masked attention scores. Finite rather than -inf so that a query that sees no
# key at all (never used, but possible in padding rows) gives no NaN; its
# output is zero, as the kernel's.
MASKED = -1e30


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap): bounds x smoothly to (-cap, cap) (Gemma 2); None
  or 0 leaves x as it is."""
  return cap * jnp.tanh(x / cap) if cap else x


def split_new(visible: jax.Array, slots: jax.Array):
  """visible [B, T, S] (the slots T new tokens at slots [B, T] see once they
  are written) as (the cached slots seen [B, T, S], the new tokens seen
  [B, T, T]), for a call that attends to its own keys unwritten. Every slot a
  token sees at or past the first new one holds a new token."""
  num_slots = visible.shape[-1]
  cached = visible & (jnp.arange(num_slots) < slots[:, :1, None])
  index = jnp.broadcast_to(slots[:, None, :],
                           visible.shape[:2] + slots.shape[1:])
  # A token past the cache's end is seen by none, as when it is written
  # (and dropped).
  new = jnp.take_along_axis(visible, index, axis=2, mode="fill",
                            fill_value=False)
  return cached, new


def attend_by_xla(q, keys, values, visible, scale: float, cap: float | None,
                  own=None) -> jax.Array:
  """[B, T, K, G, Dh]: q [B, T, K, G, Dh] attending to the visible [B, T, S]
  slots of keys, values [B, K, S, Dh] and, when own = (keys [B, K, T, Dh],
  values, visible [B, T, T]) is given, to the visible ones of those too, in
  one softmax."""
  scores = jnp.einsum("btkgd,bksd->bkgts", q, keys) / scale
  if own is not None:
    own_keys, own_values, own_visible = own
    scores = jnp.concatenate(
        [scores, jnp.einsum("btkgd,bksd->bkgts", q, own_keys) / scale], -1)
    visible = jnp.concatenate([visible, own_visible], -1)
  scores = softcap(scores.astype(jnp.float32), cap)
  scores = jnp.where(visible[:, None, None], scores, MASKED)
  weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  if own is None:
    attended = jnp.einsum("bkgts,bksd->btkgd", weights, values)
  else:
    cached, new = jnp.split(weights, [keys.shape[2]], axis=-1)
    attended = (jnp.einsum("bkgts,bksd->btkgd", cached, values)
                + jnp.einsum("bkgts,bksd->btkgd", new, own_values))
  sees_any = visible.any(-1)[:, :, None, None, None]  # [B, T, 1, 1, 1]
  return jnp.where(sees_any, attended, 0)


def attend(q, keys, values, own_keys, own_values, slots, visible, *,
           written: bool, scale: float, cap: float | None) -> jax.Array:
  """[B, T, K, G, Dh]: the T tokens' queries q [B, T, K, G, Dh] attending to
  the slots [B, T, S] they see (`visible`: as if their own keys were
  written) of the cache keys, values [B, K, S, Dh] and of their own keys and
  values [B, K, T, Dh] at slots [B, T], consecutive from each row's first
  (the kernel reads token j's keys from the own ones at slot slots[b, 0] + j,
  written or not). A token that sees no slot gets zeros.

  written: whether keys and values already hold the own ones at their slots
    (if not, the own slots hold what an earlier call left there).
  scale: the scores are q . k / scale; cap: their soft cap, or None.

  Query heads k * G .. k * G + G - 1 read key/value head k. The CPU kernel
  runs where the small-row kernel serves the pass (`cpu_matmul.serves`),
  XLA's formula elsewhere.
  """
  batch, length = q.shape[:2]
  if (all(x.dtype == jnp.float32
          for x in (q, keys, values, own_keys, own_values))
      and cpu_matmul.serves(batch * length)):
    return _attend_by_kernel(q, keys, values, own_keys, own_values,
                             slots.astype(jnp.int32), visible, scale, cap)
  if written:
    return attend_by_xla(q, keys, values, visible, scale, cap)
  return _unwritten_by_xla(q, keys, values, own_keys, own_values, slots,
                           visible, scale, cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attend_by_kernel(q, keys, values, own_keys, own_values, slots, visible,
                      scale, cap):
  return cpu_matmul.attend(q, keys, values, own_keys, own_values, slots,
                           visible, np.float32(scale),
                           np.float32(0 if cap is None else cap))


# XLA's formula over the own keys as given, unwritten: the XLA path of a pass
# that left them unwritten, and the kernel's derivative (it has none of its
# own; gradients of passes so small are rare), the own keys read from
# own_keys as the kernel reads them.
def _unwritten_by_xla(q, keys, values, own_keys, own_values, slots, visible,
                      scale, cap):
  cached, new = split_new(visible, slots)
  return attend_by_xla(q, keys, values, cached, scale, cap,
                       (own_keys, own_values, new))


def _kernel_forward(q, keys, values, own_keys, own_values, slots, visible,
                    scale, cap):
  out = _attend_by_kernel(q, keys, values, own_keys, own_values, slots,
                          visible, scale, cap)
  return out, (q, keys, values, own_keys, own_values, slots, visible)


def _kernel_backward(scale, cap, residuals, grad):
  *operands, slots, visible = residuals
  _, pullback = jax.vjp(
      lambda *x: _unwritten_by_xla(*x, slots, visible, scale, cap), *operands)
  return (*pullback(grad), None, None)


_attend_by_kernel.defvjp(_kernel_forward, _kernel_backward)
