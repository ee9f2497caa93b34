"""Drafters: where the gamma proposals and their laws q come from.

The decode loop talks to a drafter through three methods, so a new drafter is a
new class and the loop does not change:

  prefill(prompts, prompt_lengths, max_len) -> state
  propose(state, tokens, lengths, key, gamma, sampling)
      -> draft_tokens [B, G], draft_probs [B, G, V], state
  rollback(state, lengths) -> state

`tokens` [B, S] is every row's whole sequence so far (prompt and output) and
`lengths` [B] its length, so a drafter may read any of the context (prompt
lookup does). A drafter is a pytree: its parameters are leaves and its static
settings are metadata, so it passes through `jax.jit` like an array.
"""

from typing import Protocol

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

  def propose(self, state, tokens, lengths, key, gamma, sampling): ...

  def rollback(self, state, lengths): ...


def propose(
    draft: Model,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    gamma: int,
    sampling: Sampling,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Draws gamma tokens autoregressively from a draft model.

  Args:
    draft: the draft model.
    cache: its cache, valid for at least the first `lengths - 2` positions.
    tokens: [B, S] int32 sequences; the last one, tokens[b, lengths[b]-1], is
      the context the first draft follows.
    lengths: [B] int32 sequence lengths.
    key: PRNG key.
    gamma: number of drafts.
    sampling: the transform that turns draft logits into q.

  Returns:
    draft_tokens [B, G] int32, draft_probs [B, G, V] float32 (the q each draft
    was drawn from), and the cache.

  The first step feeds the last *two* tokens. When every draft of the previous
  cycle was accepted, the second-to-last token is that cycle's last draft,
  which the draft model never saw; otherwise it is already cached and is
  rewritten with the same values. This keeps the cache consistent in all cases
  at the cost of one extra token in one step, not one extra step.
  """
  # [B, 2]: positions of the last two tokens. With a one-token sequence both
  # are position 0: the same token written twice to the same slot.
  positions = jnp.maximum(lengths[:, None] + jnp.array([-2, -1]), 0)
  logits, cache = draft(jnp.take_along_axis(tokens, positions, 1), cache,
                        positions)
  keys = jax.random.split(key, gamma)

  def draft_step(carry, step_key):
    logits, cache = carry  # [B, V]
    probs = sampling.probs(logits)
    token = sampling.sample(step_key, probs)
    logits, cache = draft(token[:, None], cache)
    return (logits[:, 0], cache), (token, probs)

  # gamma - 1 steps feed a draft back; the last draft is sampled only.
  (logits, cache), (draft_tokens, draft_probs) = jax.lax.scan(
      draft_step, (logits[:, -1], cache), keys[:-1])
  last_probs = sampling.probs(logits)
  last_token = sampling.sample(keys[-1], last_probs)
  draft_tokens = jnp.concatenate(
      [draft_tokens.T, last_token[:, None]], axis=1)  # [B, G]
  draft_probs = jnp.concatenate(
      [jnp.swapaxes(draft_probs, 0, 1), last_probs[:, None]], axis=1)
  return draft_tokens, draft_probs, cache


@flax.struct.dataclass
class ModelDrafter:
  """A small autoregressive draft model with its own KV cache."""

  model: Model

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def prefill(self, prompts, prompt_lengths, max_len) -> KVCache:
    return self.model.prefill(prompts, prompt_lengths, max_len)

  def propose(self, state, tokens, lengths, key, gamma, sampling):
    return propose(self.model, state, tokens, lengths, key, gamma, sampling)

  def rollback(self, state: KVCache, lengths) -> KVCache:
    return state.rollback(lengths - 1)
