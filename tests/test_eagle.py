"""EAGLE heads: exact in the loop, consistent state, training that learns.

The head for the tiny target is trained here for a few hundred steps on the
target's own greedy continuations, so that cycles accept several drafts (a
random head would only exercise rejections). Its Monte Carlo law tests are
those of test_law_monte_carlo.py (100,000 samples of the first 6 tokens,
two cycles of 2 drafts, chi-square at 1e-3), with the same negative
control.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spec_jax as sj
from spec_jax import decoding, eagle, eagle_training
from conftest import chi_square_p_value, loop_cycles, tiny_pair
from test_law_monte_carlo import (  # pylint: disable=unused-import
    correction_from_p, follows_law, law_check, pair8, speculative)

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
  params = eagle.init_params(config, jax.random.key(seed))
  opt_state = optimizer.init(params)
  for _ in range(steps):
    params, opt_state, metrics = eagle_training.train_step(
        params, opt_state, config, target, batch, vocab_ids, optimizer, 3)
  return eagle.EagleDrafter(target, params, config, vocab_ids), metrics


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
                                        reduced_vocab=12)
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
  loss = lambda b: eagle_training.ttt_loss(params, config, target, b, None,
                                           3)[0]
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


@pytest.mark.parametrize("which", ["head", "reduced_head"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_greedy_target(target, head, reduced_head,
                                                 which, gamma):
  drafter = {"head": head, "reduced_head": reduced_head}[which]
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
    # Some cycles accepted every draft, some rejected.
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


def assert_state_from_scratch(state, drafter, target):
  """The head's state after a cycle equals one built from scratch on each
  row's sequence: its cache below its pointer and the features of every
  position whose target features exist (all but the last token's); and its
  next proposal is the same."""
  width = state.tokens.shape[1]
  lengths = state.lengths
  _, hidden = target.prefill_with_hidden(state.tokens, lengths, width,
                                         drafter.target_layers)
  scratch = drafter.prefill(state.tokens, lengths, width, hidden)
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
  ours = drafter.propose(head, None, state.tokens, lengths, state.key, 3,
                         sampling)
  theirs = drafter.propose(scratch, None, state.tokens, lengths, state.key,
                           3, sampling)
  np.testing.assert_array_equal(ours.tokens, theirs.tokens)


@pytest.mark.parametrize("resample", [accept_all, reject_all, sj.resample])
def test_head_state_equals_a_prefill_after_every_cycle(target, head,
                                                       resample):
  config = sj.DecodeConfig(gamma=3, max_new_tokens=MAX_NEW, resample=resample,
                           sampling=sj.Sampling(temperature=1.0))
  advances = set()
  for state, advance in loop_cycles(target, head, PROMPTS, config):
    advances |= set(advance.tolist())
    assert_state_from_scratch(state, head, target)
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
@pytest.mark.parametrize("sampling,gamma", [
    (sj.Sampling(temperature=1.0), 2),
    (sj.Sampling(temperature=0.8, top_p=0.8), 1),
])
def test_head_samples_the_target_law(pair8, head8, sampling, gamma):
  target = pair8[0]
  decode = speculative(target, head8, gamma, sampling)
  p_values, _ = law_check(decode, target, sampling, seed=21)
  assert follows_law(p_values), p_values


@pytest.mark.slow
def test_negative_control_with_head_is_rejected(pair8, head8):
  target = pair8[0]
  sampling = sj.Sampling(temperature=1.0)
  decode = speculative(target, head8, 2, sampling,
                       resample=correction_from_p())
  p_values, _ = law_check(decode, target, sampling, seed=22)
  assert not follows_law(p_values), p_values


def test_save_and_load_round_trip(tmp_path, target, reduced_head):
  eagle.save_head(tmp_path / "head", reduced_head, {"tokens_seen": 1})
  loaded = eagle.load_head(tmp_path / "head", target)
  assert loaded.config == reduced_head.config
  np.testing.assert_array_equal(loaded.vocab_ids, reduced_head.vocab_ids)
  for a, b in zip(jax.tree.leaves(loaded.params),
                  jax.tree.leaves(reduced_head.params)):
    np.testing.assert_array_equal(a, b)


def test_bad_heads_are_refused(tmp_path, target, head):
  with pytest.raises(FileNotFoundError, match="train_eagle"):
    eagle.load_head(tmp_path / "missing", target)
  eagle.save_head(tmp_path / "head", head)
  (tmp_path / "head" / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt"):
    eagle.load_head(tmp_path / "head", target)
  other = tiny_pair(vocab_size=32, seed=3, num_layers=3)[0]
  with pytest.raises(ValueError, match="vocabulary"):
    head.validate(other, 64)
  with pytest.raises(ValueError, match="reduced_vocab"):
    eagle.EagleConfig.for_target(target.config, reduced_vocab=17)
