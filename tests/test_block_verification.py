"""Block verification keeps the target law and accepts at least as much.

The enumeration tests reuse tests/test_resample.py's tables: every draft
sequence of a small vocabulary is weighed by its exact probability, and the
law of the first gamma+1 tokens is compared with the target's to 1e-6. A
verifier is given to the enumeration as its exact per-draft law: P(n accepted)
and the law of the token emitted after n, so a wrong rule cannot hide in
sampling noise. Monte Carlo tests then tie `resample_block` itself
to those exact laws.
"""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import rules
from conftest import chi_square_p_value
from test_resample import (PrefixLaws, continue_with_target, enumerate_drafts,
                           max_law_gap, spec_block_law, target_law)


def token_accepted_law(draft_tokens, draft_probs, target_probs):
  """P(n accepted) under the token rule: [B, G+1]."""
  accept = np.asarray(sj.acceptance_probs(draft_tokens, draft_probs,
                                          target_probs), np.float64)
  alive = np.cumprod(np.pad(accept, ((0, 0), (1, 0)), constant_values=1.0),
                     axis=1)  # alive[:, n] = prod_{i < n} a_i
  return alive * np.pad(1.0 - accept, ((0, 0), (0, 1)), constant_values=1.0)


def token_emission_law(draft_tokens, draft_probs, target_probs):
  return sj.correction_probs(draft_probs, target_probs)


def wrong_stop_is_weight(draft_tokens, draft_probs, target_probs):
  """A wrong block rule: h_i = w_i, dropping the residual-mass term."""
  w = np.asarray(rules.block.weights(draft_tokens, draft_probs,
                                     target_probs), np.float64)
  h = w.copy()
  h[:, 0] = 1.0
  later_kept = np.cumprod((1 - h)[:, :0:-1], axis=1)[:, ::-1]
  return h * np.pad(later_kept, ((0, 0), (0, 1)), constant_values=1.0)


TOKEN = (token_accepted_law, token_emission_law)
# The library's sampler of each rule.
RULES = {"token": sj.resample, "block": sj.resample_block}
BLOCK = (rules.block.num_accepted_law,
         rules.block.emission_probs)
WRONG_RULES = {
    # The token rule's residual max(0, p - q), without the weight w_n.
    "unweighted_residual": (rules.block.num_accepted_law,
                            token_emission_law),
    "correction_from_p": (rules.block.num_accepted_law,
                          lambda d, q, p: p),
    "stop_is_weight": (wrong_stop_is_weight,
                       rules.block.emission_probs),
}


def chain_law(laws, gamma, rule):
  """Exact law of the first gamma+1 tokens: one verified block, then p.

  Args:
    laws: PrefixLaws.
    gamma: draft length.
    rule: (accepted_law_fn, emission_law_fn), each called with
      (draft_tokens, draft_probs, target_probs) and returning P(n accepted)
      [B, G+1] and the law of the emitted token after n [B, G+1, V].

  Returns:
    {sequence of gamma+1 tokens: probability}.
  """
  drafts, path, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  accepted_law = np.asarray(rule[0](draft_tokens, draft_probs, target_probs),
                            np.float64)
  emitted_law = np.asarray(rule[1](draft_tokens, draft_probs, target_probs),
                           np.float64)
  vocab = range(laws.vocab_size)
  block_law = {}  # emitted block (variable length) -> probability
  for b, d in enumerate(drafts):
    if path[b] == 0:
      continue
    for n in range(gamma + 1):
      for x in vocab:
        block = tuple(d[:n]) + (x,)
        block_law[block] = (block_law.get(block, 0.0) + path[b]
                            * accepted_law[b, n] * emitted_law[b, n, x])
  return continue_with_target(block_law, laws, gamma + 1)


def expected_accepted(laws, gamma, accepted_law_fn):
  """E[num_accepted], exact: sum over drafts of P(d) sum_n n P(n | d)."""
  _, path, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  accepted_law = np.asarray(accepted_law_fn(draft_tokens, draft_probs,
                                            target_probs), np.float64)
  return float(path @ accepted_law @ np.arange(gamma + 1))


def test_chain_law_reproduces_token_enumeration():
  """The per-draft enumeration agrees with test_resample's for the token rule,
  so the block tests below run through a checked harness."""
  laws = PrefixLaws(5, seed=7, draft="stopping")
  assert max_law_gap(chain_law(laws, 2, TOKEN),
                     spec_block_law(laws, 2, sj.correction_probs)) < 1e-9


@pytest.mark.parametrize("vocab_size,gamma,seed", [
    (8, 1, 0), (6, 2, 1), (4, 3, 2), (3, 3, 3),
])
def test_block_law_equals_target_by_enumeration(vocab_size, gamma, seed):
  laws = PrefixLaws(vocab_size, seed)
  law = chain_law(laws, gamma, BLOCK)
  assert max_law_gap(law, target_law(laws, gamma)) < 1e-6
  assert abs(sum(law.values()) - 1) < 1e-6


@pytest.mark.parametrize("draft", ["equal", "one_hot", "stopping"])
@pytest.mark.parametrize("vocab_size,gamma,seed", [(6, 2, 5), (4, 3, 6)])
def test_block_law_exact_for_equal_one_hot_and_stopping_drafts(
    draft, vocab_size, gamma, seed):
  """q == p, deterministic drafts (prompt lookup) and rows that propose fewer
  than gamma tokens (dynamic gamma) keep the law exact."""
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  law = chain_law(laws, gamma, BLOCK)
  assert max_law_gap(law, target_law(laws, gamma)) < 1e-6
  assert abs(sum(law.values()) - 1) < 1e-6


@pytest.mark.parametrize("wrong", sorted(WRONG_RULES))
def test_enumeration_rejects_wrong_block_rules(wrong):
  """Negative controls: each plausible mistake biases the law visibly.

  These tables (seed 5) have drafts kept with w_n < 1 before a positive
  residual, where the mistakes show; with one-hot drafts block verification
  coincides with the token rule and only correction_from_p differs.
  """
  laws = PrefixLaws(4, seed=5)
  law = chain_law(laws, 3, WRONG_RULES[wrong])
  assert max_law_gap(law, target_law(laws, 3)) > 1e-3


@pytest.mark.parametrize("draft", ["one_hot", "stopping"])
def test_enumeration_rejects_correction_from_p(draft):
  laws = PrefixLaws(4, seed=5, draft=draft)
  law = chain_law(laws, 3, WRONG_RULES["correction_from_p"])
  assert max_law_gap(law, target_law(laws, 3)) > 1e-3


def test_paper_example_accepts_eleven_ninths():
  """Sun et al.'s example: p = (1/3, 2/3), q = (2/3, 1/3) at every prefix,
  gamma = 2. The token rule accepts 10/9 drafts on average, block 11/9."""
  laws = PrefixLaws(2, seed=0)
  laws.tables = {prefix: (np.array([1 / 3, 2 / 3]), np.array([2 / 3, 1 / 3]))
                 for n in range(3)
                 for prefix in itertools.product(range(2), repeat=n)}
  assert abs(expected_accepted(laws, 2, TOKEN[0]) - 10 / 9) < 1e-6
  assert abs(expected_accepted(laws, 2, BLOCK[0]) - 11 / 9) < 1e-6
  assert max_law_gap(chain_law(laws, 2, BLOCK), target_law(laws, 2)) < 1e-6


# (draft, vocab_size, gamma, seed) -> exact E[num_accepted], token and block.
EXPECTED_ACCEPTED = {
    ("random", 4, 3, 5): (0.46180, 0.49855),
    ("random", 6, 2, 0): (0.41494, 0.42245),
    ("random", 3, 3, 3): (0.04145, 0.04618),
    ("random", 4, 3, 2): (0.40743, 0.40816),
    ("stopping", 6, 2, 5): (0.19588, 0.20016),
    ("one_hot", 4, 3, 5): (1.01810, 1.01810),
    ("equal", 4, 3, 6): (3.0, 3.0),
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ACCEPTED))
def test_block_accepts_at_least_as_many_as_token_exactly(case):
  """Measured gains, exact by enumeration. With one-hot drafts (prompt
  lookup) and q == p there is nothing to gain and the two coincide."""
  draft, vocab_size, gamma, seed = case
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  token = expected_accepted(laws, gamma, TOKEN[0])
  block = expected_accepted(laws, gamma, BLOCK[0])
  assert block >= token - 1e-6
  np.testing.assert_allclose((token, block), EXPECTED_ACCEPTED[case],
                             atol=1e-5)


def test_block_sampler_matches_its_exact_law():
  """resample_block draws (n, emitted token) with the law the
  enumeration uses: chi-square, 3 drafts x 20000 rows each, at 1e-3."""
  laws = PrefixLaws(4, seed=5)
  gamma, rows = 3, 20_000
  drafts, path, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  chosen = np.argsort(-path)[:3]  # Three likely drafts.
  exact = (np.asarray(BLOCK[0](draft_tokens, draft_probs, target_probs))[
      ..., None] * np.asarray(BLOCK[1](draft_tokens, draft_probs,
                                       target_probs)))  # [D, G+1, V]
  index = np.repeat(chosen, rows)
  tokens, num_accepted = jax.jit(sj.resample_block)(
      jax.random.key(0), draft_tokens[index], draft_probs[index],
      target_probs[index])
  tokens, num_accepted = np.asarray(tokens), np.asarray(num_accepted)
  emitted = tokens[np.arange(len(index)), num_accepted]
  for b in chosen:
    rows_b = index == b
    np.testing.assert_array_equal(
        tokens[rows_b] * (np.arange(gamma + 1) < num_accepted[rows_b, None]),
        (np.array(drafts[b] + (0,)) * (np.arange(gamma + 1)
                                       < num_accepted[rows_b, None])))
    counts = np.zeros_like(exact[b])
    np.add.at(counts, (num_accepted[rows_b], emitted[rows_b]), 1)
    p_value = chi_square_p_value(counts.ravel(), rows * exact[b].ravel())
    assert p_value > 1e-3, (b, p_value)


def test_block_accepts_more_by_monte_carlo():
  """Both methods on the same 100000 drafts drawn from q (vocab 4, gamma 3):
  each mean is within 5 standard errors (about 0.011) of its exact value,
  0.4618 (token) and 0.4985 (block), and block's is the larger."""
  laws = PrefixLaws(4, seed=5)
  gamma, rows = 3, 100_000
  _, path, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  index = np.random.default_rng(0).choice(len(path), rows, p=path / path.sum())
  args = (draft_tokens[index], draft_probs[index], target_probs[index])
  means = {}
  for method, rule in (("token", TOKEN), ("block", BLOCK)):
    _, num_accepted = jax.jit(RULES[method])(jax.random.key(1), *args)
    num_accepted = np.asarray(num_accepted, np.float64)
    exact = expected_accepted(laws, gamma, rule[0])
    assert abs(num_accepted.mean() - exact) < 5 * num_accepted.std() / np.sqrt(
        rows), (method, num_accepted.mean(), exact)
    means[method] = num_accepted.mean()
  assert means["block"] > means["token"]


def test_block_under_jit_and_vmap():
  batch, gamma, vocab = 5, 3, 6
  keys = jax.random.split(jax.random.key(0), 4)
  draft_probs = jax.nn.softmax(
      jax.random.normal(keys[0], (batch, 2, gamma, vocab)))
  target_probs = jax.nn.softmax(
      jax.random.normal(keys[1], (batch, 2, gamma + 1, vocab)))
  draft_tokens = jax.random.categorical(keys[2], jnp.log(draft_probs)).astype(
      jnp.int32)
  block = jax.jit(jax.vmap(sj.resample_block))
  tokens, num_accepted = block(jax.random.split(keys[3], batch), draft_tokens,
                               draft_probs, target_probs)
  assert tokens.shape == (batch, 2, gamma + 1) and tokens.dtype == jnp.int32
  assert num_accepted.shape == (batch, 2) and num_accepted.dtype == jnp.int32
  for b, r in itertools.product(range(batch), range(2)):
    n = int(num_accepted[b, r])
    np.testing.assert_array_equal(tokens[b, r, :n], draft_tokens[b, r, :n])
    assert (tokens[b, r, n:] == tokens[b, r, n]).all()


def test_block_zeros_and_equal_laws_give_no_nan():
  p = jnp.array([[[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.5, 0.0]]])
  q = p[:, :1]  # p == q: every w_i = 1 and the residual is empty.
  draft_tokens = jnp.array([[1]], jnp.int32)
  for fn in (rules.block.stop_probs, rules.block.emission_probs):
    assert not jnp.isnan(fn(draft_tokens, q, p)).any()
  tokens, num_accepted = sj.resample_block(jax.random.key(1), draft_tokens,
                                           q, p)
  assert int(num_accepted[0]) == 1 and int(tokens[0, 1]) in (0, 1, 2)
  nothing = jnp.zeros_like(q)  # Proposes nothing: emit from p_1.
  tokens, num_accepted = sj.resample_block(jax.random.key(1), draft_tokens,
                                           nothing, p)
  assert int(num_accepted[0]) == 0 and int(tokens[0, 0]) == 1


def test_block_greedy_is_token_greedy():
  target_probs = jax.nn.one_hot(jnp.array([[3, 1, 4, 1]]), 6) * 0.5 + 0.1 / 6
  draft_tokens = jnp.array([[3, 1, 5]], jnp.int32)
  draft_probs = jax.nn.one_hot(draft_tokens, 6)
  results = [RULES[method](jax.random.key(0), draft_tokens, draft_probs,
                           target_probs, greedy=True)
             for method in ("token", "block")]
  for token_result, block_result in zip(*results):
    np.testing.assert_array_equal(token_result, block_result)
  assert int(results[1][1][0]) == 2


def test_one_function_per_rule():
  """A rule is chosen by passing its function; neither takes a method."""
  for rule in (sj.resample, sj.resample_block):
    parameters = inspect.signature(rule).parameters
    assert "method" not in parameters
    assert parameters["greedy"].kind is inspect.Parameter.KEYWORD_ONLY
