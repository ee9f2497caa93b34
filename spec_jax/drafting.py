"""Drafters: where the gamma proposals and their laws q come from.

The decode loop talks to a drafter through three methods, so a new drafter is a
new class and the loop does not change:

  prefill(prompts, prompt_lengths, max_len) -> state
  propose(state, target_cache, tokens, lengths, key, gamma, sampling)
      -> draft_tokens [B, G], draft_probs [B, G, V], state, target_cache
  rollback(state, lengths) -> state

`tokens` [B, S] is every row's whole sequence so far (prompt and output) and
`lengths` [B] its length, so a drafter may read any of the context (prompt
lookup does). The target's cache passes through `propose` so that a drafter
built from the target's own layers can use it instead of a cache of its own
(layer skip does); the verify pass then rewrites every slot the draft wrote.
A position whose q is all zero proposes nothing (see rejection.py), which is
how a row drafts fewer than gamma tokens. A drafter is a pytree: parameters
are leaves, settings static metadata, so it passes through `jax.jit`.

Three drafters:
  ModelDrafter      a small model with its own KV cache;
  LayerSkipDrafter  the target's first k layers, sharing the target's cache;
  NgramDrafter      prompt lookup: copies what followed the last n tokens
                    earlier in the row's own context; no model, q one-hot.
The model-based two take `confidence_threshold` for dynamic gamma.
"""

from typing import Callable, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.model import KVCache, Model
from spec_jax.sampling import Sampling


class Drafter(Protocol):
  """What the decode loop needs from a source of draft tokens."""

  @property
  def vocab_size(self) -> int: ...

  def prefill(self, prompts, prompt_lengths, max_len): ...

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling): ...

  def rollback(self, state, lengths): ...


# (tokens [B, T], cache, positions [B, T] | None) -> (logits [B, T, V], cache)
DraftFn = Callable[..., tuple[jax.Array, KVCache]]


def propose(
    draft: DraftFn,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    gamma: int,
    sampling: Sampling,
    confidence_threshold: float = 0.0,
    feed_previous: bool = True,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Draws up to gamma tokens autoregressively from a draft model.

  Args:
    draft: the draft model, or any function called like one.
    cache: its cache, valid for at least the first `lengths - 2` positions
      (`lengths - 1` when feed_previous is False).
    tokens: [B, S] int32 sequences; the last one, tokens[b, lengths[b]-1], is
      the context the first draft follows.
    lengths: [B] int32 sequence lengths.
    key: PRNG key.
    gamma: the most drafts per row.
    sampling: the transform that turns draft logits into q.
    confidence_threshold: dynamic gamma. A row stops drafting once the draft's
      confidence in its next token (the max of its temperature-1 softmax, so
      that greedy drafting has a confidence too) falls below this; it always
      drafts at least one token. When every row has stopped, the loop exits
      and the remaining draft steps are not run. 0 drafts gamma tokens.
    feed_previous: feed the second-to-last token too; see below.

  Returns:
    draft_tokens [B, G] int32, draft_probs [B, G, V] float32 (the q each draft
    was drawn from; all zero after a row stopped), and the cache.

  With feed_previous, the first step feeds the last *two* tokens. When every
  draft of the previous cycle was accepted, the second-to-last token is that
  cycle's last draft, which the draft model never saw; otherwise it is already
  cached and is rewritten with the same values. This keeps a draft's own cache
  consistent at the cost of one extra token in one step, not one extra step.
  A draft that shares the target's cache, which verify keeps complete, feeds
  the last token only.
  """
  context = 2 if feed_previous else 1
  # [B, context] positions of the last tokens. With a one-token sequence
  # both are position 0: the same token written twice to the same slot.
  positions = jnp.maximum(lengths[:, None] + jnp.arange(-context, 0), 0)
  logits, cache = draft(jnp.take_along_axis(tokens, positions, 1), cache,
                        positions)
  logits = logits[:, -1]  # [B, V]
  batch_size, vocab_size = logits.shape
  keys = jax.random.split(key, gamma)

  def draw(step, logits, draft_tokens, draft_probs, drafting):
    """Samples draft `step`; rows no longer drafting get q = 0 there."""
    probs = sampling.probs(logits)
    token = sampling.sample(keys[step], probs)
    probs = jnp.where(drafting[:, None], probs, 0.0)
    return (draft_tokens.at[:, step].set(token),
            draft_probs.at[:, step].set(probs))

  def keep_drafting(carry):
    step, _, _, _, _, drafting = carry
    return (step < gamma - 1) & jnp.any(drafting)

  def draft_step(carry):
    step, logits, cache, draft_tokens, draft_probs, drafting = carry
    draft_tokens, draft_probs = draw(step, logits, draft_tokens, draft_probs,
                                     drafting)
    logits, cache = draft(draft_tokens[:, step, None], cache)
    logits = logits[:, 0]
    confidence = jax.nn.softmax(logits).max(-1)
    drafting = drafting & (confidence >= confidence_threshold)
    return step + 1, logits, cache, draft_tokens, draft_probs, drafting

  # gamma - 1 steps feed a draft back; the last draft is sampled only.
  carry = (jnp.zeros((), jnp.int32), logits, cache,
           jnp.zeros((batch_size, gamma), jnp.int32),
           jnp.zeros((batch_size, gamma, vocab_size), jnp.float32),
           jnp.ones((batch_size,), bool))
  step, logits, cache, draft_tokens, draft_probs, drafting = (
      jax.lax.while_loop(keep_drafting, draft_step, carry))
  draft_tokens, draft_probs = draw(step, logits, draft_tokens, draft_probs,
                                   drafting)
  return draft_tokens, draft_probs, cache


@flax.struct.dataclass
class ModelDrafter:
  """A small autoregressive draft model with its own KV cache."""

  model: Model
  confidence_threshold: float = flax.struct.field(pytree_node=False,
                                                  default=0.0)

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def prefill(self, prompts, prompt_lengths, max_len) -> KVCache:
    return self.model.prefill(prompts, prompt_lengths, max_len)

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling):
    draft_tokens, draft_probs, state = propose(
        self.model, state, tokens, lengths, key, gamma, sampling,
        self.confidence_threshold)
    return draft_tokens, draft_probs, state, target_cache

  def rollback(self, state: KVCache, lengths) -> KVCache:
    return state.rollback(lengths - 1)


@flax.struct.dataclass
class LayerSkipDrafter:
  """Self-speculation: the target's first num_layers layers, then its final
  norm and head (Draft & Verify, Zhang et al. 2023; LayerSkip, Elhoushi et al.
  2024). It shares the target's weights and its cache: the draft's keys and
  values in those layers are the target's own, so no second cache is kept.
  """

  target: Model
  num_layers: int = flax.struct.field(pytree_node=False)
  confidence_threshold: float = flax.struct.field(pytree_node=False,
                                                  default=0.0)

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  def prefill(self, prompts, prompt_lengths, max_len) -> None:
    return None  # the target's prefill already filled the shared layers

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling):
    draft = lambda tokens, cache, positions=None: self.target(
        tokens, cache, positions, num_layers=self.num_layers)
    draft_tokens, draft_probs, target_cache = propose(
        draft, target_cache, tokens, lengths, key, gamma, sampling,
        self.confidence_threshold, feed_previous=False)
    return draft_tokens, draft_probs, state, target_cache

  def rollback(self, state, lengths) -> None:
    return state


def prompt_lookup(tokens: jax.Array, lengths: jax.Array, gamma: int,
                  max_n: int, min_n: int) -> tuple[jax.Array, jax.Array]:
  """The gamma tokens that followed the latest earlier copy of the last n.

  Tries n = max_n down to min_n and keeps the longest n that matches. An
  earlier copy must end before the last token, so at least one token of what
  followed it is known. For tokens "a b c x a b" and n = 2, the copy of "a b"
  at 0..1 was followed by "c x a b", so gamma = 3 proposes "c x a".

  Args:
    tokens: [B, S] int32 sequences.
    lengths: [B] int32 sequence lengths.

  Returns:
    draft_tokens [B, G] int32 and proposed [B, G] bool, False where a row has
    no match or the continuation runs past the row's end.
  """
  batch_size, width = tokens.shape
  starts = jnp.arange(width)
  continuation = jnp.full((batch_size,), -1, jnp.int32)  # -1: no match yet
  for n in range(max_n, min_n - 1, -1):
    suffix = jnp.take_along_axis(
        tokens, jnp.maximum(lengths[:, None] - n + jnp.arange(n), 0), 1)
    # match[b, j]: tokens[b, j:j+n] == suffix[b], with j + n < lengths[b].
    match = (starts + n < lengths[:, None]) & (lengths[:, None] > n)
    for i in range(n):
      shifted = jnp.pad(tokens[:, i:], ((0, 0), (0, i)))  # [b, j] = t[j + i]
      match &= shifted == suffix[:, i:i + 1]
    latest = jnp.max(jnp.where(match, starts, -1), axis=-1)
    continuation = jnp.where((continuation < 0) & (latest >= 0), latest + n,
                             continuation)
  index = continuation[:, None] + jnp.arange(gamma)  # [B, G]
  proposed = (continuation[:, None] >= 0) & (index < lengths[:, None])
  draft_tokens = jnp.take_along_axis(tokens, jnp.clip(index, 0, width - 1), 1)
  return jnp.where(proposed, draft_tokens, 0), proposed


@flax.struct.dataclass
class NgramDrafter:
  """Prompt lookup decoding (Saxena 2023): no draft model and no cache.

  The proposal is deterministic, so q is one-hot at each proposed token and
  all zero where nothing is proposed; `resample` stays exact with it.
  """

  vocab_size: int = flax.struct.field(pytree_node=False)
  max_n: int = flax.struct.field(pytree_node=False, default=3)
  min_n: int = flax.struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    if not 1 <= self.min_n <= self.max_n:
      raise ValueError(f"n-gram sizes min_n={self.min_n}, max_n={self.max_n}:"
                       " need 1 <= min_n <= max_n.")

  def prefill(self, prompts, prompt_lengths, max_len) -> None:
    return None

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling):
    del key, sampling  # q is one-hot whatever the sampling
    draft_tokens, proposed = prompt_lookup(tokens, lengths, gamma, self.max_n,
                                           self.min_n)
    draft_probs = jax.nn.one_hot(draft_tokens, self.vocab_size) * proposed[
        ..., None]
    return draft_tokens, draft_probs, state, target_cache

  def rollback(self, state, lengths) -> None:
    return state
