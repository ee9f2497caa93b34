"""The drafter contract, and autoregressive drafting from a draft model.

The decode loop talks to a drafter through this contract, so a new drafter is
a new class (drafters.py has four) and the loop does not change:

  validate(target, max_len)   raises ValueError, before compiling, if it
                              cannot draft for this target and cache size;
  describe() -> str           one line for logs and results files;
  target_layers               the target blocks whose hidden states it reads
                              from `verify` (() for none);
  cycle_shape(gamma) -> (N, D) the drafts verified per cycle and the most a
                              cycle accepts: (gamma, gamma) for a chain, by
                              which the loop sizes its buffers and statistics;
  proposes_fewer              whether some cycles propose fewer than gamma
                              drafts (prompt lookup, dynamic gamma): only then
                              does the loop compile narrower verify passes;
  prefill(prompts, prompt_lengths, max_len, hidden) -> state
                              hidden: the target's hidden states of
                              `target_layers` over the prompts, each
                              [B, P, D], from the target's own prefill
  propose(state, target_cache, tokens, lengths, key, gamma, sampling,
          max_drafts=None) -> Proposal
                              max_drafts: [] int32, a draft-length policy's
                              limit for this cycle (a chain drafter's only;
                              the loop passes it under a policy alone)
  update(state, cache_lengths, verified) -> state
  catches_up                  optional, False if absent: whether the loop
                              may run plain target steps without the
                              drafter (a draft-length policy's cycles of no
                              drafts), its next `propose` catching up on
                              the tokens they emitted. Its state is a
                              KVCache or None: a row refilled during plain
                              steps gets an emptied cache row (its pointer
                              at 0), not a prefill, and `propose` feeds it
                              the prompt too

Every leaf of a draft state has the batch as its leading axis, so that the
loop can replace one row's state by a one-row prefill's (refill.py).

`tokens` [B, S] is every row's whole sequence so far (prompt and output) and
`lengths` [B] its length, so a drafter may read any of the context (prompt
lookup does). The target's cache passes through `propose` so that a drafter
built from the target's own layers can use it instead of a cache of its own
(layer skip does); the verify pass then rewrites every slot the draft wrote.
A position whose q is all zero proposes nothing (see rules/token.py), which is
how a row drafts fewer than gamma tokens. A drafter is a pytree: parameters
are leaves, settings static metadata, so it passes through `jax.jit`.

A tree drafter (TreeDrafter) proposes a tree, whose Proposal carries
parents, and has one more method:

  compact(state, start, path) -> state
                              moves the accepted path's keys and values next
                              to the context (`KVCache.compact`), before
                              `update` moves the pointer.

One convention for rolling back, the cache's: `cache_lengths` [B] counts the
valid cache slots, which in the decode loops is each row's sequence length
minus one (every token but the last, which the next step feeds).
"""

from typing import Any, Callable, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.kv_cache import KVCache, PendingWrite
from spec_jax.model import Model
from spec_jax.sampling import Sampling

# Whatever pytree a drafter keeps between cycles: its own KVCache, or None.
DraftState = Any


@flax.struct.dataclass
class Proposal:
  """What a drafter proposes in one cycle.

  tokens: [B, N] int32 draft tokens.
  probs: for a chain, [B, N, V] float32, the q each was drawn from; all zero
    where a row proposes nothing. For a tree, [B, N+1, V], q at each context
    node, the layout `rules.resample_tree` reads: index 0 the context's last
    token, j + 1 node j; the children of a context are drawn from its q
    without replacement, and it is 0 where a node has no children.
  state: the drafter's state after drafting.
  target_cache: the target's cache, as the drafter leaves it.
  parents: None for a chain (node i follows node i - 1). For a tree, [B, N]
    int32: node i's parent node, or -1 when it follows the context's last
    token, or rules.UNUSED (-2) when row b has no node i; parents[b, i] < i.
    `verify` scores either in one pass.
  """

  tokens: jax.Array
  probs: jax.Array
  state: DraftState
  target_cache: KVCache
  parents: jax.Array | None = None


@flax.struct.dataclass
class VerifyOutput:
  """What the target computed in one verify pass over [last, d_1..d_N].

  probs: [B, N+1, V] float32 target laws p_1..p_{N+1}.
  cache: the target's cache, written for the N+1 tokens (their
    `PendingWrite` from `verify(..., write=False)`).
  hidden: the inputs of the blocks a drafter asked for (`target_layers`),
    each [B, N+1, D], at the same positions; for a tree, once the loop has
    accepted a path, [B, D+1, D]: the last token's, then the path's nodes'
    (-1 past its end reads the last token's), as a chain's.
  """

  probs: jax.Array
  cache: KVCache | PendingWrite
  hidden: tuple[jax.Array, ...] = ()


class Drafter(Protocol):
  """What the decode loop needs from a source of draft tokens."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def target_layers(self) -> tuple[int, ...]: ...

  def cycle_shape(self, gamma: int) -> tuple[int, int]: ...

  @property
  def proposes_fewer(self) -> bool: ...

  def validate(self, target: Model, max_len: int) -> None: ...

  def describe(self) -> str: ...

  def prefill(self, prompts, prompt_lengths, max_len,
              hidden=()) -> DraftState: ...

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling, max_drafts=None) -> Proposal: ...

  def update(self, state, cache_lengths,
             verified: VerifyOutput) -> DraftState: ...


def check_vocabulary(vocab_size: int, target: Model) -> None:
  if vocab_size != target.vocab_size:
    raise ValueError(
        f"draft vocabulary ({vocab_size}) differs from the target's "
        f"({target.vocab_size}); the draft and target must share a tokenizer.")


# (tokens [B, T], cache, positions [B, T] | None) -> (logits [B, T, V], cache)
DraftFn = Callable[..., tuple[jax.Array, KVCache]]


@flax.struct.dataclass
class DraftLoop:
  """The carry of a draft loop that draws one token per step: `propose`'s,
  and the EAGLE head's (eagle.py), whose cache is its own."""

  step: jax.Array  # [] the draft being drawn.
  logits: jax.Array  # [B, V] the draft's logits for it.
  cache: KVCache
  tokens: jax.Array  # [B, G] int32 drafts so far.
  probs: jax.Array  # [B, G, V] float32 their q.
  drafting: jax.Array  # [B] bool, the row has not stopped (dynamic gamma).

  @classmethod
  def start(cls, logits, cache, gamma: int) -> "DraftLoop":
    batch_size, vocab_size = logits.shape
    return cls(step=jnp.zeros((), jnp.int32), logits=logits, cache=cache,
               tokens=jnp.zeros((batch_size, gamma), jnp.int32),
               probs=jnp.zeros((batch_size, gamma, vocab_size), jnp.float32),
               drafting=jnp.ones((batch_size,), bool))

  def draw(self, keys, sampling: Sampling) -> "DraftLoop":
    """Samples draft `step`; rows no longer drafting get q = 0 there."""
    probs = sampling.probs(self.logits)
    token = sampling.sample(keys[self.step], probs)
    probs = jnp.where(self.drafting[:, None], probs, 0.0)
    return self.replace(tokens=self.tokens.at[:, self.step].set(token),
                        probs=self.probs.at[:, self.step].set(probs))


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
    catch_up: int = 0,
    max_drafts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Draws up to gamma tokens autoregressively from a draft model.

  Args:
    draft: the draft model, or any function called like one.
    cache: its cache, valid for at least the first `lengths - 2` positions
      (`lengths - 1` when feed_previous is False), or, with catch_up, for
      the first `cache.lengths - 1` (`cache.lengths`) of them.
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
    catch_up: the width of the passes that feed what the cache missed
      while the loop ran plain target steps without the draft (each left it
      one more token behind lengths - 1); 0 when it never misses any.
    max_drafts: [] int32 in 0..gamma, traced: this cycle's draft limit (a
      draft-length policy's choice). The draft steps past it are not run and
      its positions propose nothing; 0 proposes nothing at all. None is
      gamma.

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
  if 0 < catch_up < context:
    raise ValueError(f"catch_up={catch_up}: a catch-up pass rewrites the "
                     f"last {context - 1} slot(s) fed, so it needs at least "
                     f"{context} tokens to advance.")

  def feed(cache: KVCache, first: jax.Array,
           width: int) -> tuple[jax.Array, KVCache]:
    """Tokens at positions first [B] .. first + width - 1 fed, clipped to
    the sequence (a position clipped twice writes the same token to the
    same slot again)."""
    positions = jnp.clip(first[:, None] + jnp.arange(width), 0,
                         lengths[:, None] - 1)
    return draft(jnp.take_along_axis(tokens, positions, 1), cache, positions)

  if catch_up:
    # A cycle the loop ran as a plain target step left the cache one token
    # further behind lengths - 1, where a drafting cycle leaves it. Passes
    # of catch_up tokens from the first slot the last feed would rewrite;
    # none in a cycle that follows a drafting one.
    behind = lambda cache: jnp.any(cache.lengths < lengths - 1)
    cache = jax.lax.while_loop(
        behind,
        lambda cache: feed(cache, cache.lengths - context + 1, catch_up)[1],
        cache)
  logits, cache = feed(cache, lengths - context, context)
  keys = jax.random.split(key, gamma)

  def draft_step(state: DraftLoop) -> DraftLoop:
    state = state.draw(keys, sampling)
    logits, cache = draft(state.tokens[:, state.step, None], state.cache)
    confidence = jax.nn.softmax(logits[:, 0]).max(-1)
    return state.replace(
        step=state.step + 1, logits=logits[:, 0], cache=cache,
        drafting=state.drafting & (confidence >= confidence_threshold))

  limit = gamma if max_drafts is None else jnp.minimum(gamma, max_drafts)
  start = DraftLoop.start(logits[:, -1], cache, gamma)
  start = start.replace(drafting=start.drafting & (limit > 0))
  # limit - 1 steps feed a draft back; the last draft is sampled only.
  state = jax.lax.while_loop(
      lambda state: (state.step < limit - 1) & jnp.any(state.drafting),
      draft_step, start)
  state = state.draw(keys, sampling)
  return state.tokens, state.probs, state.cache
