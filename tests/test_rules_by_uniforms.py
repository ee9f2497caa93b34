"""The library's rules, enumerated: exact laws of `spec_jax.rules` code.

Every input of a small vocabulary is enumerated with its probability (draft
chains from tests/test_resample.py's prefix tables, trees from
tests/test_tree_resample.py's), and each rule's `outcome` is run on every
cell of its uniform draws (tests/uniform_enumeration.py). The law of the
emitted tokens, continued with p to a common length, must equal the
target's to 1e-6 for chains of gamma 1-3 and trees (2,), (2, 1), (2, 2) and
(3, 2), with zeros in p and q and with p == q; deliberately wrong rules run
through the same enumeration must be off by more than 1e-3. The numpy
references in those two files are second witnesses of the same laws.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import rules
from test_resample import (PrefixLaws, continue_with_target, enumerate_drafts,
                           max_law_gap, target_law)
from test_tree_resample import enumerate_trees, stack_trees
from uniform_enumeration import emitted_law, law_over_uniforms


def chain_law(laws, gamma, outcome):
  """Exact law of the first gamma+1 tokens: one chain cycle of `outcome`
  (token or block rule), then the target."""
  drafts, path, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  drawn = path > 0
  inputs = (np.asarray(draft_tokens)[drawn],
            draft_probs[drawn].astype(np.float32),
            target_probs[drawn].astype(np.float32))
  index, weight, (num_accepted, next_probs) = law_over_uniforms(
      outcome, inputs, gamma)
  drafts = [d for d, kept in zip(drafts, drawn) if kept]
  prefixes = [tuple(drafts[i][:n]) for i, n in zip(index, num_accepted)]
  law = emitted_law(path[drawn], index, weight, prefixes, next_probs)
  return continue_with_target(law, laws, gamma + 1)


def tree_law(laws, branching, **rule_options):
  """Exact law of the first depth+1 tokens: one `rules.tree.outcome`
  cycle over every tree, then the target."""
  trees = list(enumerate_trees(laws, branching))
  probs = np.array([t[0] for t in trees])
  inputs = stack_trees([t[1:] for t in trees])
  tree_tokens = inputs[0]
  outcome = functools.partial(rules.tree.outcome, depth=len(branching),
                              **rule_options)
  index, weight, (num_accepted, path, next_probs) = law_over_uniforms(
      outcome, inputs, tree_tokens.shape[1])
  prefixes = [tuple(int(x) for x in tree_tokens[i][path[h, :n]])
              for h, (i, n) in enumerate(zip(index, num_accepted))]
  law = emitted_law(probs, index, weight, prefixes, next_probs)
  return continue_with_target(law, laws, len(branching) + 1)


def block_emitting_p(uniform, draft_tokens, draft_probs, target_probs):
  """A wrong block rule: the block rule's n, then p_{n+1} for norm(R_n)."""
  num_accepted, _ = rules.block.outcome(uniform, draft_tokens, draft_probs,
                                        target_probs)
  return num_accepted, jnp.take_along_axis(
      target_probs, num_accepted[:, None, None], axis=1)[:, 0]


CHAIN_RULES = {
    "token": rules.token.outcome,
    "block": rules.block.outcome,
}
CHAIN_CONTROLS = {
    "token correcting from p": functools.partial(
        rules.token.outcome, correction=lambda q, p: p),
    "block emitting p": block_emitting_p,
}
CHAIN_CASES = [  # (vocab_size, gamma, seed, draft)
    (8, 1, 0, "random"), (6, 2, 1, "random"), (4, 3, 2, "random"),
    (3, 3, 3, "random"), (5, 2, 4, "equal"), (4, 3, 6, "one_hot"),
    (4, 3, 6, "stopping"),
]


@pytest.mark.parametrize("rule", CHAIN_RULES)
@pytest.mark.parametrize("vocab_size,gamma,seed,draft", CHAIN_CASES)
def test_chain_rule_law_equals_target(rule, vocab_size, gamma, seed, draft):
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  law = chain_law(laws, gamma, CHAIN_RULES[rule])
  assert abs(sum(law.values()) - 1) < 1e-6
  assert max_law_gap(law, target_law(laws, gamma)) < 1e-6


@pytest.mark.parametrize("control", CHAIN_CONTROLS)
@pytest.mark.parametrize("draft", ["random", "one_hot"])
def test_chain_enumeration_rejects_wrong_rules(control, draft):
  laws = PrefixLaws(6, seed=1, draft=draft)
  law = chain_law(laws, 2, CHAIN_CONTROLS[control])
  assert max_law_gap(law, target_law(laws, 2)) > 1e-3


TREE_CASES = [  # (branching, vocab_size, seed, draft)
    ((2,), 6, 0, "random"),
    ((2, 1), 6, 1, "random"),
    ((2, 2), 4, 2, "random"),
    ((3, 2), 4, 3, "random"),
    ((2, 2), 4, 4, "equal"),
]


@pytest.mark.parametrize("branching,vocab_size,seed,draft", TREE_CASES)
def test_tree_rule_law_equals_target(branching, vocab_size, seed, draft):
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  law = tree_law(laws, branching)
  assert abs(sum(law.values()) - 1) < 1e-6
  assert max_law_gap(law, target_law(laws, len(branching))) < 1e-6


TREE_CONTROLS = {
    "tried siblings kept in s": {"without": lambda s, token: s},
    "correction from p": {"residual": lambda r, s: r},
}


@pytest.mark.parametrize("control", TREE_CONTROLS)
@pytest.mark.parametrize("branching", [(2,), (2, 1), (2, 2), (3, 2)])
def test_tree_enumeration_rejects_wrong_rules(control, branching):
  laws = PrefixLaws(4, seed=2)
  law = tree_law(laws, branching, **TREE_CONTROLS[control])
  assert max_law_gap(law, target_law(laws, len(branching))) > 1e-3
