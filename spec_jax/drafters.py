"""Four drafters, each a pytree that meets the contract of drafting.py.

  ModelDrafter      a small model with its own KV cache;
  TreeDrafter       the same, proposing a tree of drafts from a template;
  LayerSkipDrafter  the target's first k layers, sharing the target's cache;
  NgramDrafter      prompt lookup: copies what followed the last n tokens
                    earlier in the row's own context; no model, q one-hot.
ModelDrafter and LayerSkipDrafter take `confidence_threshold` for dynamic
gamma.
"""

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.draft_tree import TreeTemplate, propose_tree
from spec_jax.drafting import Proposal, check_vocabulary, propose
from spec_jax.kv_cache import KVCache
from spec_jax.model import Model

# Tokens per pass when a draft model's cache catches up on plain target
# steps (`drafting.propose`).
CATCH_UP_WIDTH = 8


@flax.struct.dataclass
class ModelDrafter:
  """A small autoregressive draft model with its own KV cache."""

  model: Model
  confidence_threshold: float = flax.struct.field(pytree_node=False,
                                                  default=0.0)

  target_layers = ()
  catches_up = True  # propose feeds what plain target steps emitted

  @property
  def proposes_fewer(self) -> bool:
    return self.confidence_threshold > 0  # dynamic gamma

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def validate(self, target: Model, max_len: int) -> None:
    check_vocabulary(self.vocab_size, target)
    if max_len > self.model.config.max_len:
      raise ValueError(
          f"the decode needs {max_len} positions, but the draft model has "
          f"max_len={self.model.config.max_len}; shorten the prompt or lower "
          "max_new_tokens.")

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    return gamma, gamma  # a chain

  def describe(self) -> str:
    return f"draft model, {self.model.num_params:,} params"

  def prefill(self, prompts, prompt_lengths, max_len, hidden=()) -> KVCache:
    del hidden  # reads nothing of the target's
    return self.model.prefill(prompts, prompt_lengths, max_len)

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling, max_drafts=None) -> Proposal:
    draft_tokens, draft_probs, state = propose(
        self.model, state, tokens, lengths, key, gamma, sampling,
        self.confidence_threshold, catch_up=CATCH_UP_WIDTH,
        max_drafts=max_drafts)
    return Proposal(draft_tokens, draft_probs, state, target_cache)

  def update(self, state: KVCache, cache_lengths, verified) -> KVCache:
    del verified  # a token-level draft reads nothing of the target's
    return state.rollback(cache_lengths)


@flax.struct.dataclass
class TreeDrafter:
  """A small draft model proposing a tree of drafts (SpecInfer, Miao et al.
  2024; Sequoia, Chen et al. 2024) with its own KV cache.

  `TreeDrafter(draft, (3, 2, 1, 1))`: every cycle the draft proposes a tree
  of that template's shape (21 nodes, depth 4; see draft_tree.py), children
  drawn from q without replacement, and the target verifies all of its nodes
  in one pass. The loop's gamma plays no part: the template fixes the tree.
  """

  model: Model
  template: TreeTemplate = flax.struct.field(pytree_node=False)

  def __post_init__(self):
    if not isinstance(self.template, TreeTemplate):
      object.__setattr__(self, "template", TreeTemplate(self.template))

  target_layers = ()
  proposes_fewer = False  # the template fixes the tree

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  def validate(self, target: Model, max_len: int) -> None:
    ModelDrafter(self.model).validate(target, max_len)
    if max(self.template.branching) > self.vocab_size:
      raise ValueError(
          f"branching={self.template.branching}: a node cannot have more "
          f"distinct children than the {self.vocab_size} tokens.")

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    del gamma  # the template fixes the tree
    return self.template.num_nodes, self.template.depth

  def describe(self) -> str:
    return (f"draft model tree {self.template.branching} "
            f"({self.template.num_nodes} nodes), "
            f"{self.model.num_params:,} params")

  def prefill(self, prompts, prompt_lengths, max_len, hidden=()) -> KVCache:
    del hidden  # reads nothing of the target's
    return self.model.prefill(prompts, prompt_lengths, max_len)

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling) -> Proposal:
    del gamma  # the template fixes the tree
    tree_tokens, draft_probs, parents, state = propose_tree(
        self.model, state, tokens, lengths, key, self.template, sampling)
    return Proposal(tree_tokens, draft_probs, state, target_cache, parents)

  def compact(self, state: KVCache, start, path) -> KVCache:
    """The accepted path moved next to the context (`KVCache.compact`)."""
    return state.compact(start, path)

  def update(self, state: KVCache, cache_lengths, verified) -> KVCache:
    del verified
    return state.rollback(cache_lengths)


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

  target_layers = ()
  catches_up = True  # a plain target step writes the shared cache

  @property
  def proposes_fewer(self) -> bool:
    return self.confidence_threshold > 0  # dynamic gamma

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  def validate(self, target: Model, max_len: int) -> None:
    del max_len  # the target's own cache, which the loop checks
    check_vocabulary(self.vocab_size, target)
    if not 1 <= self.num_layers < target.config.num_layers:
      raise ValueError(
          f"layer skip with num_layers={self.num_layers}: the draft must use "
          f"between 1 and {target.config.num_layers - 1} of the target's "
          f"{target.config.num_layers} layers.")

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    return gamma, gamma  # a chain

  def describe(self) -> str:
    return f"layer skip, {self.num_layers} layers"

  def prefill(self, prompts, prompt_lengths, max_len, hidden=()) -> None:
    return None  # the target's prefill already filled the shared layers

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling, max_drafts=None) -> Proposal:
    draft = lambda tokens, cache, positions=None: self.target(
        tokens, cache, positions, num_layers=self.num_layers)
    draft_tokens, draft_probs, target_cache = propose(
        draft, target_cache, tokens, lengths, key, gamma, sampling,
        self.confidence_threshold, feed_previous=False,
        max_drafts=max_drafts)
    return Proposal(draft_tokens, draft_probs, state, target_cache)

  def update(self, state, cache_lengths, verified) -> None:
    return state  # no state: the loop rolls back the shared target cache


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

  target_layers = ()
  proposes_fewer = True  # rows without a match propose nothing
  catches_up = True  # no state: it reads the tokens as they are

  def validate(self, target: Model, max_len: int) -> None:
    del max_len  # no cache of its own
    check_vocabulary(self.vocab_size, target)

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    return gamma, gamma  # a chain

  def describe(self) -> str:
    return f"prompt lookup, n = {self.max_n}..{self.min_n}"

  def prefill(self, prompts, prompt_lengths, max_len, hidden=()) -> None:
    return None

  def propose(self, state, target_cache, tokens, lengths, key, gamma,
              sampling, max_drafts=None) -> Proposal:
    del key, sampling  # q is one-hot whatever the sampling
    draft_tokens, proposed = prompt_lookup(tokens, lengths, gamma, self.max_n,
                                           self.min_n)
    if max_drafts is not None:
      proposed &= jnp.arange(gamma) < max_drafts
    draft_probs = jax.nn.one_hot(draft_tokens, self.vocab_size) * proposed[
        ..., None]
    return Proposal(draft_tokens, draft_probs, state, target_cache)

  def update(self, state, cache_lengths, verified) -> None:
    return state
