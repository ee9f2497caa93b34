"""resample_tree: recursive rejection sampling keeps the output law p.

The enumeration tests draw every tree of a small vocabulary (children taken
from q without replacement at each context node, from tests/test_resample.py's
prefix tables), weigh it by its exact probability, and push it through a
small numpy reference of the rule that returns the exact law of the emitted
tokens. The law of the first one and two tokens (continued with p where the
tree's output is shorter) must equal the target's to 1e-6, and two wrong
rules must fail the same check. A chi-square test then ties the jax
`resample_tree` to the reference.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import rules
from conftest import chi_square_p_value
from test_resample import (PrefixLaws, continue_with_target, max_law_gap,
                           target_law)


def _norm(x):
  mass = x.sum()
  return x / mass if mass > 0 else None


def reference_law(tree_tokens, parents, draft_probs, target_probs,
                  wrong=None):
  """Exact law of the emitted tokens for one tree, by the rule in numpy.

  Args:
    tree_tokens, parents: [N] ints.
    draft_probs, target_probs: [N+1, V] float64.
    wrong: None, or a deliberate mistake: "no_removal" (tried siblings stay
      in s) or "correction_from_p" (emit from p when all children fail).

  Returns:
    {(accepted tokens..., emitted token): probability}.
  """
  law = {}

  def visit(context, prefix, prob):
    r, s = target_probs[context], draft_probs[context]
    for i in np.flatnonzero(parents == context - 1):
      x = tree_tokens[i]
      accept = min(1.0, r[x] / s[x]) if s[x] > 0 else 0.0
      visit(i + 1, prefix + (int(x),), prob * accept)
      prob *= 1 - accept
      r_next = _norm(np.maximum(r - s, 0.0))
      r = r if r_next is None else r_next
      if wrong != "no_removal":
        s = _norm(np.where(np.arange(len(s)) == x, 0.0, s))
        s = np.zeros_like(r) if s is None else s
    if wrong == "correction_from_p":
      r = target_probs[context]
    for y in np.flatnonzero(r):
      key = prefix + (int(y),)
      law[key] = law.get(key, 0.0) + prob * r[y]

  visit(0, (), 1.0)
  return law


def enumerate_trees(laws, branching):
  """Every tree with its probability, as resample_tree's inputs for one row.

  branching[d] children are drawn without replacement from q at each context
  node of depth d (fewer when q runs out of tokens: those slots are unused).
  Nodes are numbered breadth first, so the layout is the same for every tree.

  Yields:
    probability, tree_tokens [N], parents [N], draft_probs [N+1, V],
    target_probs [N+1, V].
  """
  sizes = np.cumprod(branching)
  num_nodes = int(sizes.sum())
  starts = np.concatenate([[0], np.cumsum(sizes)])  # first node of each depth

  def children_draws(q, k):
    """Ordered draws of up to k distinct tokens from q with probabilities."""
    if k == 0 or not q.any():
      yield (), 1.0
      return
    for x in np.flatnonzero(q):
      for rest, prob in children_draws(np.where(np.arange(len(q)) == x, 0.0,
                                                q), k - 1):
        yield (int(x),) + rest, prob * q[x] / q.sum()

  def grow(frontier):
    """Yields (probability, [(node, token, parent)]) for a frontier of
    (node or -1 for the root, prefix) still to give children."""
    if not frontier:
      yield 1.0, []
      return
    (slot, prefix), rest = frontier[0], frontier[1:]
    depth = len(prefix)
    if depth == len(branching):
      yield from grow(rest)
      return
    index = 0 if slot == -1 else slot - starts[depth - 1]  # within its depth
    first = starts[depth] + index * branching[depth]
    for draw, prob in children_draws(laws(prefix)[1], branching[depth]):
      nodes = [(first + j, x, slot) for j, x in enumerate(draw)]
      below = [(node, prefix + (x,)) for node, x, _ in nodes]
      for rest_prob, rest_nodes in grow(rest + below):
        yield prob * rest_prob, nodes + rest_nodes

  vocab_size = laws.vocab_size
  for prob, nodes in grow([(-1, ())]):
    tokens = np.zeros(num_nodes, np.int64)
    parents = np.full(num_nodes, rules.UNUSED, np.int64)
    draft_probs = np.zeros((num_nodes + 1, vocab_size))
    target_probs = np.zeros((num_nodes + 1, vocab_size))
    target_probs[:] = laws(())[0]  # Unused nodes: never read, any law will do.
    prefixes = {-1: ()}
    for node, x, parent in sorted(nodes):
      tokens[node], parents[node] = x, parent
      prefixes[node] = prefixes[parent] + (x,)
    for node, prefix in prefixes.items():
      target_probs[node + 1], draft_probs[node + 1] = laws(prefix)
    yield prob, tokens, parents, draft_probs, target_probs


def tree_output_law(laws, branching, length, wrong=None):
  """Exact law of the first `length` tokens: one tree step, then p."""
  emitted = {}
  total = 0.0
  for prob, *row in enumerate_trees(laws, branching):
    total += prob
    for seq, p_seq in reference_law(*row, wrong=wrong).items():
      emitted[seq] = emitted.get(seq, 0.0) + prob * p_seq
  assert abs(total - 1) < 1e-9  # The enumeration covers every tree.
  heads = {}
  for seq, prob in emitted.items():
    heads[seq[:length]] = heads.get(seq[:length], 0.0) + prob
  return continue_with_target(heads, laws, length)


CASES = [  # (branching, vocab_size, seed, draft)
    ((2,), 6, 0, "random"),
    ((2, 1), 6, 1, "random"),
    ((2, 2), 4, 2, "random"),
    ((2, 2), 6, 5, "random"),
    ((3, 2), 4, 3, "random"),
    ((2, 2), 4, 4, "equal"),
]


@pytest.mark.parametrize("branching,vocab_size,seed,draft", CASES)
def test_tree_law_equals_target_by_enumeration(branching, vocab_size, seed,
                                               draft):
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  for length in (1, 2):
    law = tree_output_law(laws, branching, length)
    assert max_law_gap(law, target_law(laws, length - 1)) < 1e-6
    assert abs(sum(law.values()) - 1) < 1e-6


@pytest.mark.parametrize("wrong", ["no_removal", "correction_from_p"])
@pytest.mark.parametrize("branching", [(2,), (2, 2)])
def test_enumeration_rejects_wrong_tree_rules(wrong, branching):
  """Negative controls: keeping tried siblings in s, or correcting from p."""
  laws = PrefixLaws(4, seed=2)
  law = tree_output_law(laws, branching, 2, wrong=wrong)
  assert max_law_gap(law, target_law(laws, 1)) > 1e-3


def _likely_trees(laws, branching, count):
  trees = sorted(enumerate_trees(laws, branching), key=lambda t: -t[0])
  return [t[1:] for t in trees[:count]]


def stack_trees(rows):
  """Rows of (tree_tokens, parents, draft_probs, target_probs) -> the four
  batched arrays `rules.tree` takes, [B, N] int32 twice and [B, N+1, V]
  float32 twice."""
  return [np.stack(x).astype(dtype) for x, dtype in zip(
      zip(*rows), (np.int32, np.int32, np.float32, np.float32))]


def _check_against_reference(rows, tokens, num_accepted, path):
  """Chi-square per distinct tree of the emitted tokens vs reference_law."""
  tokens, num_accepted, path = map(np.asarray, (tokens, num_accepted, path))
  distinct = {}
  for b, row in enumerate(rows):
    distinct.setdefault(id(row), (row, []))[1].append(b)
  for row, members in distinct.values():
    tree_tokens, parents = row[0], row[1]
    exact = reference_law(*row)
    outcomes = sorted(exact)
    counts = dict.fromkeys(outcomes, 0)
    for b in members:
      n = num_accepted[b]
      # The path is a chain from the root whose tokens were emitted.
      nodes = path[b, :n]
      assert (path[b, n:] == -1).all()
      assert [parents[i] for i in nodes] == ([-1] + list(nodes[:-1]))[:n]
      np.testing.assert_array_equal(tree_tokens[nodes], tokens[b, :n])
      assert (tokens[b, n:] == tokens[b, n]).all()
      counts[tuple(tokens[b, :n + 1].tolist())] += 1
    p_value = chi_square_p_value(
        np.array([counts[o] for o in outcomes], np.float64),
        len(members) * np.array([exact[o] for o in outcomes]))
    assert p_value > 1e-3, p_value


def _sample_likely_trees():
  """4 trees of branching (2, 2) over 4 tokens, 20000 rows each, one batch."""
  laws = PrefixLaws(4, seed=2)
  rows = [t for t in _likely_trees(laws, (2, 2), 4) for _ in range(20_000)]
  outputs = jax.jit(rules.resample_tree, static_argnames="depth")(
      jax.random.key(0), *stack_trees(rows), depth=2)
  return rows, outputs


def test_resample_tree_matches_reference_by_chi_square():
  """The emitted tokens follow the reference's exact law (chi-square at
  1e-3), and the path is a chain of the tree whose tokens were emitted."""
  rows, outputs = _sample_likely_trees()
  _check_against_reference(rows, *outputs)


@pytest.mark.parametrize("wrong", ["no_removal", "correction_from_p"])
def test_chi_square_rejects_wrong_references(wrong, monkeypatch):
  """The same sample fails against either wrong rule's law: the Monte Carlo
  check has the power to tell them apart."""
  rows, outputs = _sample_likely_trees()
  right = reference_law
  monkeypatch.setattr(sys.modules[__name__], "reference_law",
                      lambda *row: right(*row, wrong=wrong))
  with pytest.raises(AssertionError):
    _check_against_reference(rows, *outputs)


def test_unused_nodes_in_a_mixed_batch():
  """A (2, 2) tree next to a (2,) tree padded with unused nodes (parent -2,
  q = 0): D is the batch's depth, 2, the small tree never reaches an unused
  node, and both rows keep the reference law (10000 rows each)."""
  laws = PrefixLaws(4, seed=2)
  full = _likely_trees(laws, (2, 2), 1)[0]
  small_tokens, small_parents, small_q, small_p = _likely_trees(laws, (2,),
                                                                1)[0]
  pad = len(full[0]) - len(small_tokens)
  small = (np.pad(small_tokens, (0, pad)),
           np.pad(small_parents, (0, pad), constant_values=rules.UNUSED),
           np.pad(small_q, ((0, pad), (0, 0))),
           np.pad(small_p, ((0, pad), (0, 0)), constant_values=0.25))
  rows = [full, small] * 10_000
  tokens, num_accepted, path = rules.resample_tree(jax.random.key(1),
                                                   *stack_trees(rows))
  assert tokens.shape == (len(rows), 3) and path.shape == (len(rows), 2)
  assert int(num_accepted[1::2].max()) == 1
  _check_against_reference(rows, tokens, num_accepted, path)


def test_greedy_follows_argmax():
  vocab = 5
  # Root's children 1, 3; node 0 (token 1) has children 2, 4.
  tree_tokens = jnp.array([[1, 3, 2, 4]], jnp.int32)
  parents = jnp.array([[-1, -1, 0, 0]], jnp.int32)
  argmax = jnp.array([[1, 4, 0, 0, 0]])  # p's argmax at each context node
  target_probs = jax.nn.one_hot(argmax, vocab) * 0.6 + 0.08
  draft_probs = jnp.full((1, 5, vocab), 1 / vocab)
  tokens, num_accepted, path = rules.resample_tree(
      jax.random.key(0), tree_tokens, parents, draft_probs, target_probs,
      greedy=True)
  np.testing.assert_array_equal(tokens[0], [1, 4, 0])  # bonus: argmax at 4
  np.testing.assert_array_equal(path[0], [0, 3])
  assert int(num_accepted[0]) == 2
  # Root's argmax 2 is not a child: emit it, accept nothing.
  tokens, num_accepted, path = rules.resample_tree(
      jax.random.key(0), tree_tokens, parents, draft_probs,
      jax.nn.one_hot(jnp.array([[2, 4, 0, 0, 0]]), vocab), greedy=True)
  np.testing.assert_array_equal(tokens[0], [2, 2, 2])
  np.testing.assert_array_equal(path[0], [-1, -1])


def test_zeros_and_equal_laws_give_no_nan():
  """p == q with zeros: every child is accepted with probability 1 or 0 and
  the residual is never needed; nothing is NaN, and jit without a depth
  gives D = N."""
  p = jnp.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.2, 0.0, 0.8]]])
  tree_tokens = jnp.array([[0, 1]], jnp.int32)
  parents = jnp.array([[-1, -1]], jnp.int32)
  tokens, num_accepted, path = jax.jit(rules.resample_tree)(
      jax.random.key(3), tree_tokens, parents, p, p)
  assert tokens.shape == (1, 3) and int(num_accepted[0]) == 1
  assert int(tokens[0, 0]) == 0 and int(tokens[0, 1]) == 2
  assert rules.tree_depth(np.asarray(parents)) == 1
