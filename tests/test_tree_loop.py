"""Trees in the fused loop: the law is the target's, greedy equals the
target's greedy, compaction leaves the caches a prefill of what was accepted,
and one program serves every prompt of a padded shape.

The Monte Carlo tests are those of tests/test_law_monte_carlo.py (the joint
law of the first 6 tokens, two cycles of a depth-2 tree, 100,000 samples,
chi-square at 1e-3), run through `generate` with a `TreeDrafter`; the
negative controls inject a wrong `resample_tree` through `DecodeConfig` and
must be rejected.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import decoding, rules
# eos_id and pair8 are fixtures, used by name.
from conftest import chi_square_p_value, loop_cycles
from test_decoding import MAX_NEW, PROMPTS, eos_id  # pylint: disable=unused-import
from test_law_monte_carlo import (  # pylint: disable=unused-import
    NUM_NEW, follows_law, law_check, pair8)


def tree_decode(target, draft, branching, sampling, **config):
  config = sj.DecodeConfig(max_new_tokens=NUM_NEW, sampling=sampling,
                           **config)
  drafter = sj.TreeDrafter(draft, branching)
  return lambda key, prompts, lengths: sj.generate(
      key, target, drafter, prompts, lengths, config)


@functools.partial(jax.jit, static_argnames=("sampling", "max_len"))
def propose(drafter, prompts, lengths, key, sampling, max_len):
  """A tree drafter's first proposal after prefilling the prompts."""
  return drafter.propose(drafter.prefill(prompts, lengths, max_len), None,
                         prompts, lengths, key, 0, sampling)


def test_template_numbers_nodes_breadth_first():
  template = sj.TreeTemplate((3, 2, 1, 1))
  assert (template.num_nodes, template.depth) == (21, 4)
  assert template.level_starts == (0, 3, 9, 15, 21)
  np.testing.assert_array_equal(template.parents[:9],
                                [-1, -1, -1, 0, 0, 1, 1, 2, 2])
  np.testing.assert_array_equal(template.parents[15:], np.arange(9, 15))
  assert rules.tree_depth(template.parents[None]) == 4
  with pytest.raises(ValueError, match="branching"):
    sj.TreeTemplate((2, 0))


def test_children_are_distinct_and_never_drawn_where_q_is_zero(pair):
  """With top-k 2, q has two tokens: a third child is unused (parent -2, q 0
  at its context), and so is every node below it."""
  target, draft = pair
  proposal = propose(sj.TreeDrafter(draft, (3, 2)), *sj.pad_prompts(PROMPTS),
                     jax.random.key(0), sj.Sampling(temperature=1.0, top_k=2),
                     64)
  parents, q = np.asarray(proposal.parents), np.asarray(proposal.probs)
  tokens = np.asarray(proposal.tokens)
  np.testing.assert_array_equal(parents[:, :3], [[-1, -1, rules.UNUSED]] * 4)
  np.testing.assert_array_equal(parents[:, 7:], rules.UNUSED)  # below node 2
  assert (tokens[:, 0] != tokens[:, 1]).all()
  used = parents != rules.UNUSED
  context = np.where(used, parents + 1, 0)
  drawn_from = q[np.arange(len(q))[:, None], context]  # [B, N, V] parent's q
  assert (np.take_along_axis(drawn_from, tokens[..., None], -1)[..., 0][used]
          > 0).all()
  assert (q[:, 3] == 0).all() and (q[:, 4:].sum(-1) == 0).all()  # 2, leaves


CASES = [  # All slow: about a minute each (100,000 samples of 6 tokens).
    pytest.param((2,), sj.Sampling(temperature=1.0), marks=pytest.mark.slow),
    pytest.param((2, 2), sj.Sampling(temperature=1.0),
                 marks=pytest.mark.slow),
    # q has 3 tokens for 4 children: the fourth is unused.
    pytest.param((4, 1), sj.Sampling(temperature=1.0, top_k=3),
                 marks=pytest.mark.slow),
    pytest.param((2, 2), sj.Sampling(temperature=0.8, top_p=0.8),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("branching,sampling", CASES)
def test_tree_samples_follow_target_law(pair8, branching, sampling):
  target, draft = pair8
  decode = tree_decode(target, draft, branching, sampling)
  p_values, _ = law_check(decode, target, sampling, seed=5)
  assert follows_law(p_values), p_values


WRONG_RULES = {
    # Tried siblings stay in s: the next sibling's acceptance is too high.
    "no_removal": functools.partial(rules.resample_tree,
                                    without=lambda s, token: s),
    # r never moves to the residual: siblings and the correction use p.
    "correction_from_p": functools.partial(rules.resample_tree,
                                           residual=lambda r, s: r),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", sorted(WRONG_RULES))
def test_negative_control_wrong_tree_rule_is_rejected(pair8, wrong):
  """The same test, with (2,) trees, rejects either wrong rule (p < 1e-3;
  measured 4e-19 and 0 here, and 3e-8 and 0 with (2, 2) trees)."""
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  decode = tree_decode(target, draft, (2,), sampling,
                       resample_tree=WRONG_RULES[wrong])
  p_values, _ = law_check(decode, target, sampling, seed=5)
  assert not follows_law(p_values), p_values


def greedy_config(eos_id):
  return sj.DecodeConfig(max_new_tokens=MAX_NEW, eos_id=eos_id,
                         sampling=sj.Sampling(temperature=0))


@pytest.mark.parametrize("branching", [
    (2,), pytest.param((2, 1), marks=pytest.mark.slow), (3, 2, 1, 1)])
def test_greedy_tree_equals_greedy_target(pair, eos_id, branching):
  target, draft = pair
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = greedy_config(eos_id)
  key = jax.random.key(0)
  spec = sj.generate(key, target, sj.TreeDrafter(draft, branching), padded,
                     lengths, config)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.num_tokens, plain.num_tokens)
  assert spec.num_tokens[0] < MAX_NEW  # row 0 stopped at EOS mid-way...
  assert len(set(np.asarray(spec.num_tokens).tolist())) > 1  # ...others later.
  stats = spec.stats.summary()
  assert stats["nodes_per_cycle"] == sj.TreeTemplate(branching).num_nodes
  assert len(stats["position_acceptance"]) == len(branching)
  assert 1 < stats["tokens_per_cycle"] <= len(branching) + 1


def assert_prefix_equal(cache, fresh, counts):
  """Every layer's keys and values agree at slots < counts[b] of row b."""
  slot = np.arange(cache.keys[0].shape[2])
  valid = (slot < np.asarray(counts)[:, None])[:, None, :, None]
  for got, want in zip(cache.keys + cache.values, fresh.keys + fresh.values):
    np.testing.assert_allclose(np.where(valid, got, 0),
                               np.where(valid, want, 0), atol=2e-5)


def test_compact_moves_any_accepted_path_onto_a_prefill(pair):
  """Rows accept different paths of one (2, 2, 1) tree: none, the root's
  second child, node 0 then its second child, and a whole path to a leaf.
  After `compact`, each row's caches equal a prefill of its context plus
  its path (the draft's up to the leaf, which it never fed)."""
  target, draft = pair
  padded, lengths = map(jnp.asarray, sj.pad_prompts(PROMPTS))
  drafter = sj.TreeDrafter(draft, (2, 2, 1))
  max_len = 40
  proposal = propose(drafter, padded, lengths, jax.random.key(1),
                     sj.Sampling(temperature=1.0), max_len)
  verified = jax.jit(sj.verify, static_argnames="sampling")(
      target, target.prefill(padded, lengths, max_len), padded, lengths,
      proposal.tokens, sampling=sj.Sampling(), parents=proposal.parents)
  # Nodes: 0 1 | 2 3 (of 0) 4 5 (of 1) | 6 7 8 9 (one child each).
  path = jnp.array([[-1, -1, -1], [1, -1, -1], [0, 3, -1], [1, 5, 9]])
  num_accepted = (path >= 0).sum(-1)
  sequences = np.zeros((4, max_len), np.int32)
  for b, (length, nodes) in enumerate(zip(lengths, np.asarray(path))):
    nodes = nodes[nodes >= 0]
    sequences[b, :length] = padded[b, :length]
    sequences[b, length:length + len(nodes)] = proposal.tokens[b, nodes]
  counts = lengths + num_accepted
  compacted = verified.cache.compact(lengths, path)
  assert_prefix_equal(compacted, target.prefill(sequences, counts, max_len),
                      counts)
  draft_counts = counts - (num_accepted == 3)  # the leaf was never fed
  assert_prefix_equal(drafter.compact(proposal.state, lengths, path),
                      draft.prefill(sequences, counts, max_len), draft_counts)


def test_loop_caches_equal_a_prefill_after_every_cycle(pair):
  """Through the loop's own step, at T = 1: the target's cache equals a
  prefill of each row's sequence at every slot but the last token's, the
  draft's at every slot but the last two (as a chain draft's), while rows
  accept paths of different lengths."""
  target, draft = pair
  drafter = sj.TreeDrafter(draft, (3, 2, 1, 1))
  config = sj.DecodeConfig(max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=1.0))
  advances = set()
  for state, advance in loop_cycles(target, drafter, PROMPTS, config):
    advances |= set(advance.tolist())
    width = state.tokens.shape[1]
    assert_prefix_equal(state.target_cache,
                        target.prefill(state.tokens, state.lengths, width),
                        state.lengths - 1)
    assert_prefix_equal(state.draft_state,
                        draft.prefill(state.tokens, state.lengths, width),
                        state.lengths - 2)
    np.testing.assert_array_equal(state.target_cache.lengths,
                                  state.lengths - 1)
  assert len(advances) > 2, advances


def test_same_key_same_tokens_and_one_compilation(pair, eos_id):
  target, draft = pair
  config = greedy_config(eos_id)  # the greedy test's program, if it ran
  drafter = sj.TreeDrafter(draft, (2,))
  key = jax.random.key(7)
  first = sj.generate(key, target, drafter, *sj.pad_prompts(PROMPTS), config)
  compiled = decoding.generate_jit._cache_size()
  again = sj.generate(key, target, drafter, *sj.pad_prompts(PROMPTS), config)
  np.testing.assert_array_equal(first.tokens, again.tokens)
  other = sj.generate(key, target, drafter,
                      *sj.pad_prompts([[3, 3], [1], [4, 4, 4], [2] * 10]),
                      config)
  assert decoding.generate_jit._cache_size() == compiled
  assert not np.array_equal(other.tokens, first.tokens)
