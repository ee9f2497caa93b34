"""Rejection sampling over a draft tree: the output law stays exactly p.

A draft tree hangs from the root (the context's last token). Each context
node c has a draft law q_c and a target law p_c, and its children are distinct
tokens drawn from q_c without replacement, in node order. Recursive rejection
sampling (Chen et al., "Sequoia", and Jeon et al., "Recursive Speculative
Decoding", arXiv 2402.14160) walks down from the root. At context c, starting
from r = p_c and s = q_c, for each child x in node order:

  accept x with probability min(1, r(x) / s(x)) and descend into it;
  else r <- norm(max(0, r - s)) and s <- norm(s with x removed).

If no child is accepted, emit a token from r; if an accepted node is a leaf,
r is its p and the token is the bonus.

Why it is exact: x is drawn from s, so one step emits x with mass min(r, s)
and leaves max(0, r - s) for what follows, the token rule's identity. Given a
rejection, x had r(x) < s(x), so r'(x) = 0 and the next sibling, drawn from s
with x removed, faces the same problem with (r', s'); by induction the token
out of c follows r = p_c, and descending into x continues with p_x.

Conventions. Node i's context is index i+1 of draft_probs and target_probs,
the root's is index 0. A row whose tree is smaller than N nodes marks each
unused node with parent -2 (it is nobody's child, so it is never tried) and
q = 0 at its context. Where r == s the residual is empty, a rejection has
probability 0, and r falls back to itself (no NaN).
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling
from spec_jax.rules import token

UNUSED = -2  # parents[b, i] of a node that row b does not use.


def tree_depth(parents: np.ndarray) -> int:
  """Largest number of nodes on a root-to-leaf path: parents [B, N] -> int.

  Needs concrete parents (nodes in topological order); unused nodes (-2)
  have depth 0.
  """
  parents = np.asarray(parents)
  depth = np.zeros(parents.shape, np.int64)  # [B, N]
  rows = np.arange(parents.shape[0])
  for i in range(parents.shape[1]):
    parent = parents[:, i]
    parent_depth = depth[rows, np.maximum(parent, 0)]
    depth[:, i] = np.where(parent >= 0, parent_depth + 1,
                           (parent == -1).astype(np.int64))
  return int(depth.max(initial=0))


def _without(s: jax.Array, token: jax.Array) -> jax.Array:
  """norm(s with token removed) [V]; zeros once nothing is left."""
  return sampling.normalized(s.at[token].set(0.0), 0.0)


def _residual(r: jax.Array, s: jax.Array) -> jax.Array:
  """norm(max(0, r - s)) [V]; r itself where that is empty (r == s)."""
  return sampling.normalized(jnp.maximum(r - s, 0.0), r)


def _walk_row(uniform, tree_tokens, parents, draft_probs, target_probs, depth,
              greedy, residual, without):
  """One row: uniform, tree_tokens, parents [N]; draft/target_probs [N+1, V].

  Returns num_accepted [], path [D] and r [V], the law emitted from.
  """

  def step(carry, node):
    context, r, s, num_accepted, path = carry
    i, token, parent, u = node
    is_child = parent + 1 == context
    if greedy:  # r stays p_context: at T = 0 nothing is left to correct.
      accepted = is_child & (token == sampling.argmax(r))
      r_rejected, s_rejected = r, s
    else:
      s_token = s[token]
      accept_prob = jnp.where(
          s_token > 0, jnp.minimum(1.0, r[token] / jnp.where(s_token > 0,
                                                             s_token, 1.0)),
          0.0)
      accepted = is_child & (u < accept_prob)
      r_rejected, s_rejected = residual(r, s), without(s, token)
    rejected = is_child & ~accepted
    # Topological order: once i is accepted, its children all come later.
    r = jnp.where(accepted, target_probs[i + 1],
                  jnp.where(rejected, r_rejected, r))
    s = jnp.where(accepted, draft_probs[i + 1],
                  jnp.where(rejected, s_rejected, s))
    path = jnp.where(accepted & (jnp.arange(depth) == num_accepted), i, path)
    num_accepted = num_accepted + accepted
    context = jnp.where(accepted, i + 1, context)
    return (context, r, s, num_accepted, path), None

  init = (jnp.int32(0), target_probs[0], draft_probs[0], jnp.int32(0),
          jnp.full((depth,), -1, jnp.int32))
  nodes = (jnp.arange(tree_tokens.shape[0], dtype=jnp.int32), tree_tokens,
           parents, uniform)
  (_, r, _, num_accepted, path), _ = jax.lax.scan(step, init, nodes)
  # r is the residual at the last context, or p there when it is a leaf.
  return num_accepted, path, r


def outcome(
    uniform: jax.Array,
    tree_tokens: jax.Array,
    parents: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    *,
    greedy: bool = False,
    depth: int | None = None,
    residual: Callable[[jax.Array, jax.Array], jax.Array] = _residual,
    without: Callable[[jax.Array, jax.Array], jax.Array] = _without,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where the walk stops for given acceptance draws, and what it emits there.

  Node i, when tried, is accepted if uniform[:, i] < min(1, r(x) / s(x)).
  `resample_tree` is this function with uniforms drawn from its key,
  followed by one draw from next_probs; the enumeration tests drive it with
  controlled uniforms to compute the rule's exact law.

  Args:
    uniform: [B, N] float32 in [0, 1), one per node (unused at T = 0).
    tree_tokens: [B, N] int32, node i's token; nodes in topological order
      (parents[b, i] < i).
    parents: [B, N] int32, the parent node of i, -1 when i hangs from the
      root, -2 when row b does not use node i.
    draft_probs: [B, N+1, V] float32, q at each context node: index 0 the
      root, index j+1 node j; 0 at unused nodes. The children of a context
      node are distinct tokens drawn from its q without replacement, in node
      order.
    target_probs: [B, N+1, V] float32, p at the same context nodes.
    greedy: temperature 0: follow the child equal to argmax p at each level;
      emit argmax p where there is none.
    depth: D, static, at least the tree's depth. By default it is the depth
      of the deepest row, `tree_depth(parents)`; under jit, where parents is
      traced, it defaults to N, the deepest a tree of N nodes can be.
    residual: (r [V], s [V]) -> r after a rejection, norm(max(0, r - s)).
    without: (s [V], token) -> s after a rejection, s with the token
      removed. Exact only as the defaults; a negative control passes a wrong
      one (e.g. `without=lambda s, token: s` keeps tried siblings in s).

  Returns:
    num_accepted [B] int32 in [0, D], path [B, D] int32 (the accepted
    nodes, -1 after num_accepted) and next_probs [B, V], the law of the
    token emitted after the path (one-hot at T = 0).
  """
  if depth is None:
    if isinstance(parents, jax.core.Tracer):
      depth = tree_tokens.shape[1]
    else:
      depth = tree_depth(parents)
  row = functools.partial(_walk_row, depth=depth, greedy=greedy,
                          residual=residual, without=without)
  return jax.vmap(row)(uniform, tree_tokens.astype(jnp.int32),
                       parents.astype(jnp.int32), draft_probs, target_probs)


def resample_tree(
    key: jax.Array,
    tree_tokens: jax.Array,
    parents: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    *,
    greedy: bool = False,
    **options,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Accepts a root-to-node path of the tree and appends one token.

  Args:
    key: PRNG key.
    tree_tokens, parents, draft_probs, target_probs, greedy: as `outcome`.
    **options: `outcome`'s depth, residual and without.

  Returns:
    tokens [B, D+1] int32: the accepted path's tokens, then the correction
    or bonus; entries after it repeat it.
    num_accepted [B] int32 in [0, D].
    path [B, D] int32: the accepted path's node indices, -1 after
    num_accepted.
  """
  num_rows, num_nodes = tree_tokens.shape
  # One key per row, split into the row's acceptance and emission keys.
  keys = jax.vmap(jax.random.split)(jax.random.split(key, num_rows))  # [B, 2]
  uniform = jax.vmap(lambda k: jax.random.uniform(k, (num_nodes,)))(
      keys[:, 0])  # [B, N]
  num_accepted, path, next_probs = outcome(
      uniform, tree_tokens, parents, draft_probs, target_probs, greedy=greedy,
      **options)
  if greedy:
    next_token = sampling.argmax(next_probs)
  else:
    next_token = jax.vmap(sampling.categorical)(keys[:, 1], next_probs)
  path_tokens = jnp.take_along_axis(tree_tokens.astype(jnp.int32),
                                    jnp.maximum(path, 0), axis=1)  # [B, D]
  return (token.emitted_tokens(path_tokens, num_accepted, next_token),
          num_accepted, path)
