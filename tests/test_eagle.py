"""EAGLE-3 heads in the loop: exact in chains and trees, consistent state,
training that learns.

The head for the tiny target is trained here for a few hundred steps on the
target's own greedy continuations, so that cycles accept several drafts (a
random head would only exercise rejections). Its Monte Carlo law tests are
those of test_law_monte_carlo.py (100,000 samples of the first 6 tokens,
two cycles of 2 drafts or of a depth-2 tree, chi-square at 1e-3), with the
same negative controls. Parity with the published architecture and the
checkpoint formats are test_eagle3.py's.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spec_jax as sj
from spec_jax import eagle, eagle_training
from conftest import loop_cycles, tiny_pair
from test_law_monte_carlo import (  # pylint: disable=unused-import
    correction_from_p, follows_law, law_check, pair8, speculative)
from test_tree_loop import WRONG_RULES

PROMPTS = [[3, 9, 4, 7, 3, 9, 4, 7, 3, 9], [4, 5, 6, 7, 8], [13], [2, 7, 1, 8]]
MAX_NEW = 24


def features_batch(target, tokens, layers, top_k):
  """A FeatureCache-like batch computed on the fly."""
  tokens = jnp.asarray(tokens)
  logits, _, hidden = target.forward(
      tokens, target.init_cache(*tokens.shape), hidden_layers=layers)
  top_logits, top_ids = jax.lax.top_k(logits, top_k)
  return {"tokens": tokens,
          "lengths": jnp.full(tokens.shape[:1], tokens.shape[1]),
          "loss_from": jnp.zeros(tokens.shape[:1], jnp.int32),
          "hidden": jnp.stack(hidden, 2), "top_ids": top_ids,
          "top_logits": top_logits}


def train_head(target, config, vocab_ids=None, steps=300, seed=0):
  """A head trained on the target's greedy continuations of random
  prompts."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, target.vocab_size, (64, 4))
  padded, lengths = sj.pad_prompts(prompts.tolist())
  greedy = sj.generate_autoregressive(
      jax.random.key(0), target, padded, lengths,
      sj.DecodeConfig(max_new_tokens=28, sampling=sj.Sampling(temperature=0)))
  sequences = np.concatenate([prompts, np.asarray(greedy.tokens)], 1)
  batch = features_batch(target, sequences, config.feature_layers, 8)
  optimizer = optax.adam(3e-3)
  params = eagle.init_params(config, jax.random.key(seed), target, vocab_ids)
  opt_state = optimizer.init(params)
  for _ in range(steps):
    params, opt_state, metrics = eagle_training.train_step(
        params, opt_state, config, target, batch, vocab_ids, optimizer, 3)
  return eagle.EagleDrafter(target, params, config, vocab_ids), metrics


TREE = (3, 2, 1)


@pytest.fixture(scope="module")
def target():
  return tiny_pair(seed=3, num_layers=3)[0]


@pytest.fixture(scope="module")
def head(target):
  config = eagle.EagleConfig.for_target(target.config)
  return train_head(target, config)[0]


@pytest.fixture(scope="module")
def reduced_head(target):
  """Over the 12 tokens most often the target's greedy choice."""
  config = eagle.EagleConfig.for_target(target.config, feature_layers=(3,),
                                        draft_vocab_size=12)
  return train_head(target, config, jnp.arange(12, dtype=jnp.int32) + 4)[0]


def test_training_time_test_sees_what_drafting_sees():
  """Step 2 at position 4 stands for the second draft after position 2: the
  target's keys up to 2, then step 1's at 3 and its own at 4."""
  mask = eagle_training.ttt_mask(length=5, num_steps=3, step=2)
  expected = np.zeros((3, 5), bool)
  expected[0, :3] = True
  expected[1, 3] = True
  expected[2, 4] = True
  np.testing.assert_array_equal(mask[4].reshape(3, 5), expected)
  np.testing.assert_array_equal(
      eagle_training.ttt_mask(5, 3, 0)[:, :5], np.tril(np.ones((5, 5), bool)))


def test_training_loss_is_on_positions_from_loss_from(target):
  """A self-distilled row trains on its reply: what the target's law says
  on the prompt before loss_from changes nothing, and after it, everything."""
  config = eagle.EagleConfig.for_target(target.config)
  params = eagle.init_params(config, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, target.vocab_size, (2, 12))
  batch = dict(features_batch(target, tokens, config.feature_layers, 8),
               loss_from=jnp.array([5, 0]))
  loss = jax.jit(lambda b: eagle_training.ttt_loss(params, config, target, b,
                                                   None, 3)[0])
  noise = jax.random.normal(jax.random.key(1), batch["top_logits"].shape)
  before = jnp.arange(12)[None, :, None] < batch["loss_from"][:, None, None]
  on_prompt = dict(batch, top_logits=batch["top_logits"] + 5 * noise * before)
  on_reply = dict(batch, top_logits=batch["top_logits"] + 5 * noise * ~before)
  assert float(loss(on_prompt)) == pytest.approx(float(loss(batch)), rel=1e-6)
  assert abs(float(loss(on_reply)) - float(loss(batch))) > 1e-2


@pytest.mark.slow  # 22 s; the head fixture's training runs by default
def test_training_raises_acceptance(target):
  config = eagle.EagleConfig.for_target(target.config)
  _, untrained = train_head(target, config, steps=1)
  _, trained = train_head(target, config, steps=300)
  assert float(trained["top1"][0]) > float(untrained["top1"][0]) + 0.3
  assert float(trained["top1"][0]) > 0.8, trained
  assert float(trained["top1"][1]) > 0.5, trained  # on its own features


# A tree's template fixes its drafts: gamma plays no part.
@pytest.mark.parametrize("which,gamma", [
    ("head", 1), ("head", 4), ("reduced_head", 1), ("reduced_head", 4),
    ("tree", 4), ("reduced_tree", 4)])
def test_greedy_speculative_equals_greedy_target(target, head, reduced_head,
                                                 which, gamma):
  drafter = {"head": head, "reduced_head": reduced_head,
             "tree": head.with_tree(TREE),
             "reduced_tree": reduced_head.with_tree(TREE)}[which]
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = sj.DecodeConfig(gamma=gamma, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=0), eos_id=15)
  key = jax.random.key(0)
  spec = sj.generate(key, target, drafter, padded, lengths, config)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  stats = spec.stats.summary()
  assert 0 < stats["accepted"] < stats["drafted"]
  if gamma > 1:
    # Some cycles accepted every draft (the tree's deepest level), some
    # rejected.
    assert spec.stats.position_acceptance[-1] > 0


def test_greedy_batch_one_equals_target(target, head):
  padded, lengths = sj.pad_prompts([PROMPTS[0]])
  config = sj.DecodeConfig(gamma=3, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=0))
  key = jax.random.key(0)
  np.testing.assert_array_equal(
      sj.generate(key, target, head, padded, lengths, config).tokens,
      sj.generate_autoregressive(key, target, padded, lengths,
                                 config).tokens)


def accept_all(key, draft_tokens, draft_probs, target_probs, greedy):
  """Keeps every draft and appends p's argmax: wrong, but it drives the
  state through full acceptance every cycle."""
  del key, draft_probs, greedy
  gamma = draft_tokens.shape[1]
  bonus = jnp.argmax(target_probs[:, gamma], -1)[:, None]
  return (jnp.concatenate([draft_tokens, bonus], 1).astype(jnp.int32),
          jnp.full(draft_tokens.shape[:1], gamma, jnp.int32))


def reject_all(key, draft_tokens, draft_probs, target_probs, greedy):
  del key, draft_probs, greedy
  tokens = jnp.zeros((draft_tokens.shape[0], draft_tokens.shape[1] + 1),
                     jnp.int32)
  tokens = tokens.at[:, 0].set(jnp.argmax(target_probs[:, 0], -1))
  return tokens, jnp.zeros(draft_tokens.shape[:1], jnp.int32)


# The head's prefill and proposal, jitted once for every check: run eagerly,
# op by op, each check took seconds.
_prefill = jax.jit(lambda drafter, *args: drafter.prefill(*args),
                   static_argnums=3)
_propose = jax.jit(lambda drafter, *args: drafter.propose(*args),
                   static_argnums=(6, 7))


def assert_state_from_scratch(state, drafter, target):
  """The head's state after a cycle equals one built from scratch on each
  row's sequence: its cache below its pointer and the features of every
  position whose target features exist (all but the last token's); and its
  next proposal is the same."""
  width = state.tokens.shape[1]
  lengths = state.lengths
  _, hidden = target.prefill_with_hidden(state.tokens, lengths, width,
                                         drafter.target_layers)
  scratch = _prefill(drafter, state.tokens, lengths, width, hidden)
  head = state.draft_state
  pointer = np.asarray(head.cache.lengths)
  for row, length in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(head.features[row, :length - 1],
                               scratch.features[row, :length - 1],
                               atol=2e-4, rtol=2e-4)
    for ours, theirs in ((head.cache.keys[0], scratch.cache.keys[0]),
                         (head.cache.values[0], scratch.cache.values[0])):
      np.testing.assert_allclose(ours[row, :, :pointer[row]],
                                 theirs[row, :, :pointer[row]],
                                 atol=2e-4, rtol=2e-4)
  sampling = sj.Sampling(temperature=0)
  ours = _propose(drafter, head, None, state.tokens, lengths, state.key, 3,
                  sampling)
  theirs = _propose(drafter, scratch, None, state.tokens, lengths, state.key,
                    3, sampling)
  np.testing.assert_array_equal(ours.tokens, theirs.tokens)


# The real rule runs by default; the forced extremes and the tree (about 35 s
# each) with the slow set.
@pytest.mark.parametrize("resample", [
    pytest.param(accept_all, marks=pytest.mark.slow),
    pytest.param(reject_all, marks=pytest.mark.slow), sj.resample,
    pytest.param("tree", marks=pytest.mark.slow)])
def test_head_state_equals_a_prefill_after_every_cycle(target, head,
                                                       resample):
  drafter = head.with_tree(TREE) if resample == "tree" else head
  config = sj.DecodeConfig(
      gamma=3, max_new_tokens=MAX_NEW,
      resample=sj.resample if resample == "tree" else resample,
      sampling=sj.Sampling(temperature=1.0))
  advances = set()
  for state, advance in loop_cycles(target, drafter, PROMPTS, config):
    advances |= set(advance.tolist())
    assert_state_from_scratch(state, drafter, target)
  if resample is accept_all:
    assert advances == {4}
  elif resample is reject_all:
    assert advances == {1}
  else:
    assert len(advances) > 1, advances


@pytest.fixture(scope="module")
def head8(pair8):
  target = pair8[0]
  config = eagle.EagleConfig.for_target(target.config)
  return train_head(target, config, steps=100)[0]


@pytest.mark.slow  # about a minute each (100,000 samples of 6 tokens)
@pytest.mark.parametrize("sampling,gamma,tree,resample", [
    (sj.Sampling(temperature=1.0), 2, None, sj.resample),
    (sj.Sampling(temperature=0.8, top_p=0.8), 1, None, sj.resample),
    (sj.Sampling(temperature=1.0), 2, None, sj.resample_block),
    (sj.Sampling(temperature=1.0), 2, (2, 2), sj.resample),
    (sj.Sampling(temperature=0.8, top_p=0.8), 2, (3, 1), sj.resample),
])
def test_head_samples_the_target_law(pair8, head8, sampling, gamma, tree,
                                     resample):
  target = pair8[0]
  decode = speculative(target, head8.with_tree(tree), gamma, sampling,
                       resample=resample)
  p_values, stats = law_check(decode, target, sampling, seed=21)
  assert follows_law(p_values), p_values
  assert float(stats[0].summary()["accepted"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_negative_control_with_head_is_rejected(pair8, head8, tree):
  """The correction drawn from p instead of norm(max(0, p - q)): for a
  chain through the token rule, for a tree through the tree rule."""
  target = pair8[0]
  sampling = sj.Sampling(temperature=1.0)
  wrong = (dict(resample=correction_from_p()) if tree is None
           else dict(resample_tree=WRONG_RULES["correction_from_p"]))
  decode = speculative(target, head8.with_tree(tree), 2, sampling, **wrong)
  p_values, _ = law_check(decode, target, sampling, seed=22)
  assert not follows_law(p_values), p_values


def test_trained_head_round_trips_through_the_published_format(
    tmp_path, target, reduced_head):
  sj.save_eagle3(reduced_head, tmp_path / "head", dtype="float32")
  loaded = sj.load_eagle3(tmp_path / "head", target)
  assert loaded.config == reduced_head.config
  np.testing.assert_array_equal(loaded.vocab_ids, reduced_head.vocab_ids)
  for a, b in zip(jax.tree.leaves(loaded.params),
                  jax.tree.leaves(reduced_head.params)):
    np.testing.assert_array_equal(a, b)


def test_bad_head_settings_are_refused(target, head):
  other = tiny_pair(vocab_size=32, seed=3, num_layers=3)[0]
  with pytest.raises(ValueError, match="vocabulary"):
    head.validate(other, 64)
  with pytest.raises(ValueError, match="draft_vocab_size=17"):
    eagle.EagleConfig.for_target(target.config, draft_vocab_size=17)
  with pytest.raises(ValueError, match="more distinct children"):
    eagle.EagleDrafter(target, {}, dataclasses.replace(
        head.config, draft_vocab_size=2), template=(3,)).validate(target, 64)


@flax.struct.dataclass
class PointMass:
  """The head's chains verified as point masses (q one-hot at each draft),
  the rule tpu-inference and sglang-jax apply to EAGLE drafts."""

  head: eagle.EagleDrafter
  proposes_fewer = False

  vocab_size = property(lambda self: self.head.vocab_size)
  target_layers = property(lambda self: self.head.target_layers)

  def validate(self, target, max_len):
    self.head.validate(target, max_len)

  def cycle_shape(self, gamma):
    return self.head.cycle_shape(gamma)

  def describe(self):
    return "point-mass " + self.head.describe()

  def prefill(self, *args):
    return self.head.prefill(*args)

  def update(self, *args):
    return self.head.update(*args)

  def propose(self, *args):
    proposal = self.head.propose(*args)
    proposed = proposal.probs.sum(-1, keepdims=True) > 0
    return proposal.replace(probs=jax.nn.one_hot(
        proposal.tokens, self.vocab_size) * proposed)


@pytest.mark.slow  # two law checks, about two minutes
def test_point_mass_verification_is_exact_and_accepts_less(pair8, head8):
  """Both rules sample the target's law at T=1; on the same draft laws the
  full-q rule accepts more (the loop's `mean_point_mass_acceptance` is what
  the point-mass rule accepts of them), and in its own run the point-mass
  rule accepts less."""
  target = pair8[0]
  sampling = sj.Sampling(temperature=1.0)
  full_p, full_stats = law_check(speculative(target, head8, 2, sampling),
                                 target, sampling, seed=23)
  point_p, point_stats = law_check(
      speculative(target, PointMass(head8), 2, sampling), target, sampling,
      seed=23)
  assert follows_law(full_p) and follows_law(point_p), (full_p, point_p)
  full = sj.DecodeStats.merge(full_stats)
  point = sj.DecodeStats.merge(point_stats)
  assert full.mean_point_mass_acceptance < full.mean_overlap
  assert point.tokens_per_cycle < full.tokens_per_cycle
  print(f"alpha {full.mean_overlap:.3f}, point mass on the same drafts "
        f"{full.mean_point_mass_acceptance:.3f}; tau {full.tokens_per_cycle:.3f}"
        f" against {point.tokens_per_cycle:.3f}")
