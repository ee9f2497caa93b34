"""What training an EAGLE-3 head optimises: training-time test.

In the decode loop the head drafts its first token from the target's features
and every later one from its own outputs. Training-time test trains it that
way. Head position t holds the pair (f_t, x_{t+1}) and predicts x_{t+2}
(eagle.py). Step 0 runs the head over a batch with the target's features;
step k feeds each position the head's own output of step k - 1 at the
position before, with the true tokens. A query of step k at position t
stands for the (k+1)-th draft of a cycle whose last target feature was at
t - k, so it attends to what that draft would see in the loop's cache: the
step-0 keys of positions <= t - k and the keys of steps 1..k at
t - k + 1 .. t (one each). Step k's loss has weight 0.8^k.

The loss is the soft cross-entropy from the target's law, truncated to its
top logits (stored with the features, see experiments/harness/eagle_data.py).
With a reduced vocabulary it is renormalised over the reduced tokens, and
positions whose target argmax is not one of them are masked: the head cannot
draft that token, and only their share of p counts against it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spec_jax.eagle import EagleConfig, EagleHead
from spec_jax.kv_cache import init_cache
from spec_jax.model import Model

STEP_WEIGHT = 0.8


def ttt_mask(length: int, num_steps: int, step: int) -> np.ndarray:
  """[T, num_steps * T] bool: the slots a query of `step` at position t sees
  among num_steps blocks of T slots (block j holds step j's keys)."""
  t = np.arange(length)[:, None]
  s = np.arange(length)[None, :]
  blocks = [s <= t - step]
  for j in range(1, num_steps):
    blocks.append((s == t - step + j) & (j <= step))
  return np.concatenate(blocks, axis=1)


def reduced_index(vocab_ids: jax.Array | None, vocab_size: int) -> jax.Array:
  """[V] int32: each token's index in the reduced vocabulary, -1 outside.
  Without a reduced vocabulary, each token's own id."""
  if vocab_ids is None:
    return jnp.arange(vocab_size, dtype=jnp.int32)
  return jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids].set(
      jnp.arange(vocab_ids.shape[0], dtype=jnp.int32))


def _targets(batch: dict, index: jax.Array):
  """(p [B, T, K] over the top ids that the head can draft, renormalised;
  those ids' indices in the head's output [B, T, K]; [B, T] bool whether
  the target's argmax is draftable)."""
  ids = index[batch["top_ids"]]  # -1: outside the reduced vocabulary
  inside = ids >= 0
  logits = jnp.where(inside, batch["top_logits"].astype(jnp.float32),
                     -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.where(inside, p, 0.0), jnp.maximum(ids, 0), inside[..., 0]


def ttt_loss(params: dict, config: EagleConfig, target: Model, batch: dict,
             vocab_ids: jax.Array | None, num_steps: int):
  """(weighted loss, {"loss": [steps], "top1": [steps]}) on a batch.

  batch: tokens [B, T] int32, lengths and loss_from [B], hidden
    [B, T, F, D], top_ids and top_logits [B, T, K] (a FeatureCache batch):
    position t's target law is that of token t + 1.
  top1[k]: how often step k's argmax is the target's argmax, the greedy
    acceptance of draft k + 1 given the drafts before it were accepted.
  """
  head = EagleHead(config)
  apply = lambda method, *args: head.apply({"params": params}, *args,
                                           method=method)
  tokens = batch["tokens"]
  batch_size, length = tokens.shape
  hidden = apply(EagleHead.fuse, tuple(
      batch["hidden"][:, :, i] for i in range(batch["hidden"].shape[2])))
  # Pair t is (f_t, x_{t+1}), predicting x_{t+2}: the target's law at t + 1.
  shift = lambda x: jnp.concatenate([x[:, 1:], x[:, -1:]], 1)
  embedded = apply(EagleHead.embed, shift(tokens),
                   target.params["embed"]["embedding"])
  cache = init_cache(config.attention, batch_size, num_steps * length)
  keys, values = cache.keys[0], cache.values[0]
  positions = jnp.broadcast_to(jnp.arange(length), (batch_size, length))
  p, ids, draftable = _targets(
      {name: shift(batch[name]) for name in ("top_ids", "top_logits")},
      reduced_index(vocab_ids, config.vocab_size))
  # Only predictions of a reply's tokens are trained (from loss_from on),
  # and only where the token after the pair exists.
  predicted = positions + 1
  valid = ((predicted < batch["lengths"][:, None])
           & (predicted >= batch["loss_from"][:, None]))
  losses, top1 = [], []
  for step in range(num_steps):
    visible = jnp.broadcast_to(ttt_mask(length, num_steps, step),
                               (batch_size, length, num_steps * length))
    a, normed, keys, values = apply(
        EagleHead.__call__, embedded, hidden, positions,
        positions + step * length, visible, keys, values)
    logits = apply(EagleHead.draft_logits, normed)
    log_q = jax.nn.log_softmax(logits)
    cross_entropy = -(p * jnp.take_along_axis(log_q, ids, -1)).sum(-1)
    mask = valid & draftable & (positions >= step)
    count = jnp.maximum(mask.sum(), 1)
    losses.append((cross_entropy * mask).sum() / count)
    top1.append(((jnp.argmax(logits, -1) == ids[..., 0]) & mask).sum()
                / count)
    # Step k + 1 at position t reads step k's output at t - 1.
    hidden = jnp.pad(a, ((0, 0), (1, 0), (0, 0)))[:, :length]
  weights = STEP_WEIGHT ** np.arange(num_steps)
  loss = jnp.dot(jnp.stack(losses), weights / weights.sum())
  return loss, {"loss": jnp.stack(losses), "top1": jnp.stack(top1)}


@functools.partial(jax.jit, static_argnames=("config", "optimizer",
                                             "num_steps"))
def train_step(params, opt_state, config: EagleConfig, target: Model,
               batch: dict, vocab_ids, optimizer, num_steps: int):
  """One optimizer update; returns params, optimizer state and the metrics
  before the update."""
  (_, metrics), grads = jax.value_and_grad(ttt_loss, has_aux=True)(
      params, config, target, batch, vocab_ids, num_steps)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, metrics


evaluate = jax.jit(ttt_loss, static_argnames=("config", "num_steps"))
