"""Draft trees: a static template, and drawing a tree from a draft model.

`TreeTemplate(branching=(3, 2, 1, 1))` hangs 3 children from the root (the
context's last token), 2 from each of those, then 1 from each node below: a
tree of 3 + 6 + 6 + 6 = 21 nodes and depth 4. In general N is the sum over
depths d of branching[0] * ... * branching[d]. Nodes are numbered breadth
first, so each depth is one contiguous run and a node's children are
consecutive, in the order they were drawn:

  depth 1   0 1 2                  children of the root
  depth 2   3 4 | 5 6 | 7 8        children of nodes 0, 1, 2
  depth 3   9 | 10 | 11 | ... 14   one child of each node of depth 2
  depth 4   15 | 16 | ... 20       one child of each node of depth 3

`propose_tree` draws such a tree depth by depth, and lays it out as
`rules.resample_tree` and `verify(..., parents=)` read it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.kv_cache import KVCache
from spec_jax.rules.tree import UNUSED
from spec_jax.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class TreeTemplate:
  """The shape of every tree a tree drafter proposes.

  branching: children of each node at depth 0 (the root), 1, ..., D - 1; a
    chain of gamma drafts is (1,) * gamma.
  """

  branching: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "branching", tuple(int(k) for k in
                                                self.branching))
    if not self.branching or min(self.branching) < 1:
      raise ValueError(f"branching={self.branching}: give at least one depth, "
                       "each with at least one child, e.g. (3, 2, 1, 1).")

  @property
  def depth(self) -> int:
    """D: the most drafts one cycle can accept."""
    return len(self.branching)

  @property
  def level_sizes(self) -> tuple[int, ...]:
    """Nodes at depths 1..D."""
    return tuple(int(n) for n in np.cumprod(self.branching))

  @property
  def num_nodes(self) -> int:
    """N: nodes the target verifies per cycle."""
    return sum(self.level_sizes)

  @property
  def level_starts(self) -> tuple[int, ...]:
    """[D + 1]: the first node of depths 1..D, then N."""
    return (0,) + tuple(int(n) for n in np.cumsum(self.level_sizes))

  @property
  def parents(self) -> np.ndarray:
    """[N] int32: each node's parent node, -1 for the root's children."""
    starts = self.level_starts
    parents = [-1] * self.level_sizes[0]
    for d in range(1, self.depth):
      parents += [starts[d - 1] + i // self.branching[d]
                  for i in range(self.level_sizes[d])]
    return np.array(parents, np.int32)

  @property
  def depths(self) -> np.ndarray:
    """[N] int32: each node's depth, 1 for the root's children."""
    return np.repeat(np.arange(1, self.depth + 1), self.level_sizes).astype(
        np.int32)


def draw_children(key, logits, probs, num_children: int, greedy: bool):
  """num_children distinct tokens per context node, in the order drawn.

  Args:
    key: PRNG key.
    logits: [B, C, V] the draft's logits at C context nodes.
    probs: [B, C, V] q at them, 0 at a context that proposes nothing.
    num_children: k.
    greedy: temperature 0: the draft's k most likely tokens, best first.

  Returns:
    tokens [B, C, k] int32 and used [B, C, k] bool. Sampling, the Gumbel
    top-k of log q is exactly k sequential draws from q without replacement;
    a token with q = 0 scores -inf, so it is never drawn: where q has fewer
    than k nonzero tokens the extra children are not used.
  """
  if greedy:
    scores = jnp.where(probs.sum(-1, keepdims=True) > 0, logits, -jnp.inf)
  else:
    scores = jnp.log(probs) + jax.random.gumbel(key, probs.shape)
  top, tokens = jax.lax.top_k(scores, num_children)
  return tokens.astype(jnp.int32), top > -jnp.inf


def draw_tree(root_logits, expand, carry, key, template: TreeTemplate,
              sampling: Sampling):
  """Draws a tree of template.num_nodes drafts depth by depth, from the
  root's logits and one `expand` per depth above the leaves.

  Args:
    root_logits: [B, V] the draft's logits at the root.
    expand: (carry, tokens [B, n], parents [B, n]) -> (logits [B, n, V],
      carry): the draft run over the first n nodes (every node of depths
      1..d), each under the tree mask; its logits at the depth-d nodes give
      their children's q.
    carry: what expand threads through (the draft's cache).
    key: PRNG key.
    template: the tree's shape.
    sampling: the transform that turns draft logits into q.

  Returns:
    tree_tokens [B, N] int32; draft_probs [B, N+1, V] float32, q at each
    context node (index 0 the root, j + 1 node j), 0 at the leaves and at
    unused nodes; parents [B, N] int32 (`template.parents`, UNUSED where a
    row has no such node); and the carry.
  """
  batch_size, vocab_size = root_logits.shape
  num_nodes, starts = template.num_nodes, template.level_starts
  tree_tokens = jnp.zeros((batch_size, num_nodes), jnp.int32)
  parents = jnp.broadcast_to(template.parents, (batch_size, num_nodes))
  draft_probs = jnp.zeros((batch_size, num_nodes + 1, vocab_size))
  context_logits = root_logits[:, None]  # [B, 1, V] at the root
  context_used = jnp.ones((batch_size, 1), bool)
  keys = jax.random.split(key, template.depth)
  for d, num_children in enumerate(template.branching):
    # The contexts of depth d: the root, then the nodes of depth d.
    first = 0 if d == 0 else starts[d - 1] + 1
    q = jnp.where(context_used[..., None], sampling.probs(context_logits), 0.0)
    draft_probs = draft_probs.at[:, first:first + q.shape[1]].set(q)
    children, used = draw_children(keys[d], context_logits, q, num_children,
                                   sampling.greedy)
    level = slice(starts[d], starts[d + 1])
    tree_tokens = tree_tokens.at[:, level].set(
        children.reshape(batch_size, -1))
    used = (used & context_used[..., None]).reshape(batch_size, -1)
    parents = parents.at[:, level].set(jnp.where(used, parents[:, level],
                                                 UNUSED))
    if d + 1 < template.depth:  # the leaves need no q
      shallow = slice(0, starts[d + 1])
      logits, carry = expand(carry, tree_tokens[:, shallow],
                             parents[:, shallow])
      context_logits, context_used = logits[:, level], used
  return tree_tokens, draft_probs, parents, carry


def propose_tree(draft, cache: KVCache, tokens, lengths, key,
                 template: TreeTemplate, sampling: Sampling):
  """Draws a tree of template.num_nodes drafts from a draft model: one
  draft pass per depth (`draw_tree`).

  Args:
    draft: the draft model (called as `Model.__call__`, with `parents=`).
    cache: its cache, valid for at least the first `lengths - 2` positions.
    tokens: [B, S] int32 sequences; tokens[b, lengths[b] - 1] is the root.
    lengths: [B] int32 sequence lengths.
    key: PRNG key.
    template: the tree's shape.
    sampling: the transform that turns draft logits into q.

  Returns:
    `draw_tree`'s, the carry being the cache, node j written at slot
    lengths + j for the nodes above depth D.

  The root pass feeds the last two tokens, as `drafting.propose` does, which
  rewrites a leaf the previous cycle accepted. The pass at depth d feeds every
  node of depths 1..d, written at their slots under the tree mask (each sees
  the context and its own ancestors): re-running the shallower nodes lets one
  call's ancestor mask cover every ancestor, and costs little next to the
  target's verify. Its logits at the depth-d nodes give their q.
  """
  positions = jnp.maximum(lengths[:, None] + jnp.arange(-2, 0), 0)
  logits, cache = draft(jnp.take_along_axis(tokens, positions, 1), cache,
                        positions)

  def expand(cache, nodes, parents):
    depths = template.depths[:nodes.shape[1]]
    return draft(nodes, cache, lengths[:, None] - 1 + depths, parents=parents)

  return draw_tree(logits[:, -1], expand, cache, key, template, sampling)
