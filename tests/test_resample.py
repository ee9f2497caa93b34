"""resample: the rejection rule keeps the law of the emitted block exactly p.

The enumeration tests walk every draft sequence of a small vocabulary, weigh
each with its exact probability, and compare the law of the first gamma+1
tokens with the target's to 1e-6. Context-dependent p and q are random tables
indexed by the prefix, with zeros in both.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import rules


def random_law(rng, vocab_size, zero_fraction):
  logits = rng.normal(size=vocab_size) * 2
  zeros = rng.random(vocab_size) < zero_fraction
  zeros[rng.integers(vocab_size)] = False  # Keep at least one token.
  probs = np.where(zeros, 0.0, np.exp(logits))
  return probs / probs.sum()


class PrefixLaws:
  """p(. | prefix) and q(. | prefix) for every prefix, drawn lazily.

  draft: "random" (a random q), "equal" (q = p), "one_hot" (a deterministic
  draft token, as prompt lookup proposes) or "stopping" (a random q that, at
  some prefixes, proposes nothing: q = 0, as dynamic gamma does once the
  draft is unsure).
  """

  def __init__(self, vocab_size, seed, draft="random"):
    self.rng = np.random.default_rng(seed)
    self.vocab_size = vocab_size
    self.draft = draft
    self.tables = {}

  def __call__(self, prefix):
    if prefix not in self.tables:
      p = random_law(self.rng, self.vocab_size, 0.3)
      q = random_law(self.rng, self.vocab_size, 0.3)
      if self.draft == "equal":
        q = p
      elif self.draft == "one_hot":
        q = np.eye(self.vocab_size)[self.rng.integers(self.vocab_size)]
      elif self.draft == "stopping" and self.rng.random() < 0.4:
        q = np.zeros(self.vocab_size)
      self.tables[prefix] = (p, q)
    return self.tables[prefix]


def enumerate_drafts(laws, gamma):
  """Every draft sequence with its probability, as resample's inputs."""
  vocab = range(laws.vocab_size)
  drafts = list(itertools.product(vocab, repeat=gamma))
  draft_probs = np.array([[laws(d[:i])[1] for i in range(gamma)]
                          for d in drafts])
  # Once a row proposes nothing it stops: later positions propose nothing.
  stopped = np.cumsum(draft_probs.sum(-1) == 0, axis=1) > 0
  draft_probs[stopped] = 0.0
  target_probs = np.array([[laws(d[:i])[0] for i in range(gamma + 1)]
                           for d in drafts])
  # Where nothing is proposed, the (unused) draft token is 0 for certain.
  path = np.array([np.prod([draft_probs[b, i, d[i]] if not stopped[b, i]
                            else float(d[i] == 0) for i in range(gamma)])
                   for b, d in enumerate(drafts)])
  draft_tokens = jnp.array(drafts, jnp.int32).reshape(len(drafts), gamma)
  return drafts, path, draft_tokens, draft_probs, target_probs


def spec_block_law(laws, gamma, correction_probs_fn):
  """Exact law of the first gamma+1 tokens: one SD block, then the target.

  Args:
    laws: PrefixLaws.
    gamma: draft length.
    correction_probs_fn: the correction rule under test.

  Returns:
    {sequence of gamma+1 tokens: probability}.
  """
  vocab = range(laws.vocab_size)
  drafts, paths, draft_tokens, draft_probs, target_probs = enumerate_drafts(
      laws, gamma)
  accept = np.asarray(sj.acceptance_probs(draft_tokens, draft_probs,
                                          target_probs), np.float64)
  emitted_law = np.asarray(correction_probs_fn(draft_probs, target_probs),
                           np.float64)

  block_law = {}  # emitted block (variable length) -> probability
  for b, d in enumerate(drafts):
    path = paths[b]
    if path == 0:
      continue
    for n in range(gamma + 1):  # n drafts accepted, then one emitted token.
      stop = np.prod(accept[b, :n]) * (1 - accept[b, n] if n < gamma else 1)
      for x in vocab:
        block = tuple(d[:n]) + (x,)
        block_law[block] = (block_law.get(block, 0.0)
                            + path * stop * emitted_law[b, n, x])

  return continue_with_target(block_law, laws, gamma + 1)


def continue_with_target(block_law, laws, length):
  """{sequence of `length` tokens: probability}: every block of block_law
  ({tokens: probability}) continued by the target itself."""
  law = {}
  for block, prob in block_law.items():
    for rest in itertools.product(range(laws.vocab_size),
                                  repeat=length - len(block)):
      seq = block + rest
      cont = np.prod([laws(seq[:i])[0][seq[i]]
                      for i in range(len(block), length)])
      law[seq] = law.get(seq, 0.0) + prob * cont
  return law


def target_law(laws, gamma):
  return {
      seq: np.prod([laws(seq[:i])[0][seq[i]] for i in range(gamma + 1)])
      for seq in itertools.product(range(laws.vocab_size), repeat=gamma + 1)
  }


def max_law_gap(law_a, law_b):
  keys = set(law_a) | set(law_b)
  return max(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize("vocab_size,gamma,seed", [
    (8, 1, 0), (6, 2, 1), (4, 3, 2), (3, 3, 3),
])
def test_block_law_equals_target_by_enumeration(vocab_size, gamma, seed):
  laws = PrefixLaws(vocab_size, seed)
  spec = spec_block_law(laws, gamma, sj.correction_probs)
  assert max_law_gap(spec, target_law(laws, gamma)) < 1e-6
  assert abs(sum(spec.values()) - 1) < 1e-6


def test_block_law_exact_when_draft_equals_target():
  laws = PrefixLaws(5, seed=4, draft="equal")
  spec = spec_block_law(laws, 2, sj.correction_probs)
  assert max_law_gap(spec, target_law(laws, 2)) < 1e-6


@pytest.mark.parametrize("draft", ["one_hot", "stopping"])
@pytest.mark.parametrize("vocab_size,gamma,seed", [(6, 2, 5), (4, 3, 6)])
def test_block_law_exact_for_one_hot_and_stopping_drafts(draft, vocab_size,
                                                         gamma, seed):
  """Deterministic drafts (prompt lookup) and rows that propose fewer than
  gamma tokens (dynamic gamma, no n-gram match) keep the law exact."""
  laws = PrefixLaws(vocab_size, seed, draft=draft)
  spec = spec_block_law(laws, gamma, sj.correction_probs)
  assert max_law_gap(spec, target_law(laws, gamma)) < 1e-6
  assert abs(sum(spec.values()) - 1) < 1e-6


@pytest.mark.parametrize("draft", ["random", "one_hot", "stopping"])
def test_enumeration_rejects_correction_from_p(draft):
  """Negative control: correcting from p instead of the residual is biased,
  for one-hot drafts (which it would draw again) and stopping ones too."""
  laws = PrefixLaws(6, seed=1, draft=draft)
  wrong = spec_block_law(laws, 2, lambda q, p: p)
  assert max_law_gap(wrong, target_law(laws, 2)) > 1e-3


def test_contract_shapes_and_prefix():
  batch, gamma, vocab = 64, 4, 10
  key_q, key_p, key_d, key = jax.random.split(jax.random.key(0), 4)
  draft_probs = jax.nn.softmax(jax.random.normal(key_q, (batch, gamma, vocab)))
  target_probs = jax.nn.softmax(
      jax.random.normal(key_p, (batch, gamma + 1, vocab)))
  draft_tokens = jax.random.categorical(key_d, jnp.log(draft_probs)).astype(
      jnp.int32)
  tokens, num_accepted = jax.jit(sj.resample)(key, draft_tokens, draft_probs,
                                               target_probs)
  assert tokens.shape == (batch, gamma + 1) and tokens.dtype == jnp.int32
  assert num_accepted.shape == (batch,) and num_accepted.dtype == jnp.int32
  assert 0 <= num_accepted.min() and num_accepted.max() <= gamma
  for b in range(batch):
    n = int(num_accepted[b])
    np.testing.assert_array_equal(tokens[b, :n], draft_tokens[b, :n])
  assert len(set(np.asarray(num_accepted).tolist())) > 1


def test_correction_never_draws_an_over_proposed_token():
  """After a rejection at i, tokens with p_i <= q_i have zero residual."""
  vocab = 5
  p = jnp.array([0.5, 0.5, 0.0, 0.0, 0.0])
  q = jnp.array([0.0, 0.1, 0.9, 0.0, 0.0])
  batch = 4096
  draft_probs = jnp.broadcast_to(q, (batch, 1, vocab))
  target_probs = jnp.broadcast_to(p, (batch, 2, vocab))
  draft_tokens = jnp.full((batch, 1), 2, jnp.int32)  # p(2) = 0: always reject
  tokens, num_accepted = sj.resample(jax.random.key(0), draft_tokens,
                                     draft_probs, target_probs)
  assert (num_accepted == 0).all()
  # Residual max(0, p - q) = [0.5, 0.4, 0, 0, 0] -> [5/9, 4/9].
  assert set(np.asarray(tokens[:, 0]).tolist()) <= {0, 1}
  assert abs(float((tokens[:, 0] == 0).mean()) - 5 / 9) < 0.03


def test_zeros_and_equal_laws_give_no_nan():
  vocab = 4
  p = jnp.array([[[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.5, 0.0]]])
  q = p[:, :1]  # p == q: zero residual at position 1.
  assert not jnp.isnan(sj.correction_probs(q, p)).any()
  tokens, num_accepted = sj.resample(jax.random.key(1),
                                     jnp.array([[1]], jnp.int32), q, p)
  assert int(num_accepted[0]) == 1 and int(tokens[0, 0]) == 1
  assert int(tokens[0, 1]) in (0, 1, 2)
  one_hot = jax.nn.one_hot(jnp.array([[3, 3]]), vocab)
  accept = sj.acceptance_probs(jnp.array([[0]], jnp.int32), one_hot[:, :1],
                               one_hot)
  assert not jnp.isnan(accept).any()


def test_works_under_vmap():
  gamma, vocab = 2, 6
  keys = jax.random.split(jax.random.key(0), 3)
  draft_probs = jax.nn.softmax(jax.random.normal(keys[0], (5, 1, gamma, vocab)))
  target_probs = jax.nn.softmax(
      jax.random.normal(keys[1], (5, 1, gamma + 1, vocab)))
  draft_tokens = jnp.zeros((5, 1, gamma), jnp.int32)
  tokens, num_accepted = jax.vmap(sj.resample)(
      jax.random.split(keys[2], 5), draft_tokens, draft_probs, target_probs)
  assert tokens.shape == (5, 1, gamma + 1) and num_accepted.shape == (5, 1)


def test_greedy_accepts_while_draft_is_argmax():
  target_probs = jax.nn.one_hot(jnp.array([[3, 1, 4, 1]]), 6) * 0.5 + 0.1 / 6
  draft_tokens = jnp.array([[3, 1, 5]], jnp.int32)
  draft_probs = jax.nn.one_hot(draft_tokens, 6)
  tokens, num_accepted = sj.resample(jax.random.key(0), draft_tokens,
                                     draft_probs, target_probs, greedy=True)
  assert int(num_accepted[0]) == 2
  np.testing.assert_array_equal(tokens[0, :3], [3, 1, 4])
  draft_tokens = jnp.array([[3, 1, 4]], jnp.int32)
  tokens, num_accepted = sj.resample(jax.random.key(0), draft_tokens,
                                     jax.nn.one_hot(draft_tokens, 6),
                                     target_probs, greedy=True)
  assert int(num_accepted[0]) == 3 and int(tokens[0, 3]) == 1
  # A position with q = 0 proposes nothing and is rejected, even at T = 0.
  draft_probs = jax.nn.one_hot(draft_tokens, 6).at[0, 1].set(0.0)
  tokens, num_accepted = sj.resample(jax.random.key(0), draft_tokens,
                                     draft_probs, target_probs, greedy=True)
  assert int(num_accepted[0]) == 1 and int(tokens[0, 1]) == 1


def test_overlap_is_sum_of_min():
  q = jnp.array([[[0.2, 0.8]]])
  p = jnp.array([[[0.6, 0.4], [0.5, 0.5]]])
  np.testing.assert_allclose(rules.overlap(q, p), [[0.6]], rtol=1e-6)


def test_point_mass_acceptance_never_exceeds_the_full_rule():
  """sum_x q p (a point-mass verifier's acceptance) <= sum_x min(p, q),
  with equality when q is one-hot."""
  keys = jax.random.split(jax.random.key(0), 2)
  q = jax.nn.softmax(2 * jax.random.normal(keys[0], (64, 3, 10)))
  p = jax.nn.softmax(2 * jax.random.normal(keys[1], (64, 4, 10)))
  full, point = rules.overlap(q, p), rules.point_mass_acceptance(q, p)
  assert (point <= full + 1e-7).all() and float((full - point).mean()) > 0.1
  one_hot = jax.nn.one_hot(jnp.argmax(q, -1), 10)
  np.testing.assert_allclose(rules.point_mass_acceptance(one_hot, p),
                             rules.overlap(one_hot, p), rtol=1e-6)
