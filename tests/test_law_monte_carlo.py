"""Monte Carlo: the whole jitted, batched loop samples the target's law.

For one prompt, the joint law of the first 3 generated tokens is computed
exactly from the target (all 8^3 continuations scored). Speculative decoding
then draws N = 100,000 samples through `generate`, and a chi-square
goodness-of-fit test compares the counts with the exact law (cells with an
expected count below 5 are pooled). The test fails when p < 1e-3, so a
correct sampler fails with probability 0.001 per seed; the seeds are fixed,
so the outcome is deterministic. The negative control runs the same test on a
loop whose correction is drawn from p instead of norm(max(0, p - q)) and
requires p < 1e-3 there, for a draft model and for prompt lookup (one-hot q).
Every drafter passes the same test: prompt lookup on a prompt that repeats
itself (so it has matches to propose), layer skip and dynamic gamma.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import decoding
from conftest import chi_square_p_value, tiny_pair

VOCAB = 8
NUM_NEW = 3
NUM_SAMPLES = 100_000
CHUNK = 25_000
SIGNIFICANCE = 1e-3
PROMPT = [1, 5, 2, 6]
# "1 5" recurs, so prompt lookup proposes "2 6 1" at the first cycle.
REPEATING_PROMPT = [1, 5, 2, 6, 1, 5]


@pytest.fixture(scope="module")
def pair8():
  # A draft far enough from the target (mean overlap about 0.5) that a wrong
  # correction rule shifts the law by more than the noise of N samples.
  return tiny_pair(vocab_size=VOCAB, seed=1, draft_noise=0.6)


def exact_law(target, sampling, prompt=PROMPT):
  """[V^3] probability of each continuation, in lexicographic order."""
  continuations = np.array(list(itertools.product(range(VOCAB),
                                                  repeat=NUM_NEW)))
  prompts = np.broadcast_to(prompt, (len(continuations), len(prompt)))
  sequences = jnp.asarray(np.concatenate([prompts, continuations], 1))
  start = len(prompt) - 1
  probs = sampling.probs(
      sj.score(target, sequences)[:, start:start + NUM_NEW])  # [V^3, 3, V]
  chosen = jnp.take_along_axis(probs, continuations[..., None], -1)[..., 0]
  return np.asarray(chosen, np.float64).prod(-1)


def sampled_counts(decode, seed, prompt=PROMPT):
  """Counts [V^3] of the first 3 tokens over NUM_SAMPLES rows."""
  prompts, lengths = sj.pad_prompts([prompt] * CHUNK)
  counts = np.zeros(VOCAB**NUM_NEW, np.int64)
  for chunk in range(NUM_SAMPLES // CHUNK):
    tokens = np.asarray(decode(jax.random.key(seed * 1000 + chunk), prompts,
                               lengths))
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    counts += np.bincount(index, minlength=VOCAB**NUM_NEW)
  return counts


def speculative(target, drafter, gamma, sampling, generate_fn):
  config = decoding.DecodeConfig(gamma=gamma, max_new_tokens=NUM_NEW,
                                 sampling=sampling)
  return lambda key, prompts, lengths: generate_fn(
      key, target, drafter, prompts, lengths, config).tokens


CASES = [
    (sj.Sampling(temperature=1.0), 2),
    pytest.param(sj.Sampling(temperature=1.0, top_k=3), 3,
                 marks=pytest.mark.slow),
    pytest.param(sj.Sampling(temperature=0.8, top_p=0.8), 1,
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sampling,gamma", CASES)
def test_speculative_samples_follow_target_law(pair8, sampling, gamma):
  target, draft = pair8
  law = exact_law(target, sampling)
  decode = speculative(target, sj.ModelDrafter(draft), gamma, sampling,
                       sj.generate)
  p_value = chi_square_p_value(sampled_counts(decode, seed=gamma), law)
  assert p_value > SIGNIFICANCE, p_value


def block_correction_from_p(key, draft_tokens, draft_probs, target_probs, *,
                            greedy=False):
  """A wrong block rule: the block rule's number of accepted drafts n, then
  a token drawn from p_{n+1} instead of norm(R_n)."""
  tokens, num_accepted = sj.resample_block(key, draft_tokens, draft_probs,
                                           target_probs, greedy=greedy)
  p = jnp.take_along_axis(target_probs, num_accepted[:, None, None],
                          1)[:, 0]  # [B, V]
  token = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(p))
  position = jnp.arange(tokens.shape[1])
  return (jnp.where(position < num_accepted[:, None], tokens,
                    token[:, None]).astype(jnp.int32), num_accepted)


@pytest.mark.parametrize("rule, exact", [
    (sj.resample_block, True),
    # The negative control: the same test must reject it.
    pytest.param(block_correction_from_p, False, marks=pytest.mark.slow)])
def test_block_verification_samples_the_target_law(pair8, rule, exact):
  """The block rule through the whole jitted loop, as the token rule above."""
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  config = decoding.DecodeConfig(
      gamma=3, max_new_tokens=NUM_NEW, sampling=sampling, resample=rule)
  decode = lambda key, prompts, lengths: sj.generate(
      key, target, sj.ModelDrafter(draft), prompts, lengths, config).tokens
  p_value = chi_square_p_value(sampled_counts(decode, seed=11),
                               exact_law(target, sampling))
  assert (p_value > SIGNIFICANCE) == exact, p_value


def other_drafters(target, draft):
  return {
      "ngram": sj.NgramDrafter(VOCAB, max_n=2),
      "layer_skip": sj.LayerSkipDrafter(target, num_layers=1),
      "dynamic_gamma": sj.ModelDrafter(draft, confidence_threshold=0.5),
  }


@pytest.mark.parametrize("name", [
    "ngram",
    pytest.param("layer_skip", marks=pytest.mark.slow),
    pytest.param("dynamic_gamma", marks=pytest.mark.slow),
])
def test_every_drafter_samples_the_target_law(pair8, name):
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  drafter = other_drafters(target, draft)[name]
  decode = speculative(target, drafter, 3, sampling, sj.generate)
  counts = sampled_counts(decode, seed=7, prompt=REPEATING_PROMPT)
  p_value = chi_square_p_value(counts,
                               exact_law(target, sampling, REPEATING_PROMPT))
  assert p_value > SIGNIFICANCE, p_value


def test_autoregressive_samples_follow_target_law(pair8):
  """The harness itself: the plain sampler passes the same test."""
  target, _ = pair8
  sampling = sj.Sampling(temperature=1.0)
  config = decoding.DecodeConfig(max_new_tokens=NUM_NEW, sampling=sampling)
  decode = lambda key, prompts, lengths: sj.generate_autoregressive(
      key, target, prompts, lengths, config).tokens
  p_value = chi_square_p_value(sampled_counts(decode, seed=0),
                               exact_law(target, sampling))
  assert p_value > SIGNIFICANCE, p_value


@pytest.mark.parametrize("name", ["model", "ngram"])
def test_negative_control_wrong_correction_is_rejected(pair8, name):
  target, draft = pair8
  drafter = (sj.ModelDrafter(draft) if name == "model"
             else other_drafters(target, draft)[name])
  prompt = PROMPT if name == "model" else REPEATING_PROMPT
  sampling = sj.Sampling(temperature=1.0)
  # Draw the correction from p instead of the residual, through the real
  # loop: the rejection rule is a public setting of the decode.
  wrong = functools.partial(sj.resample, correction=lambda q, p: p)
  config = decoding.DecodeConfig(gamma=2, max_new_tokens=NUM_NEW,
                                 sampling=sampling, resample=wrong)
  decode = lambda key, prompts, lengths: sj.generate(
      key, target, drafter, prompts, lengths, config).tokens
  p_value = chi_square_p_value(sampled_counts(decode, seed=2, prompt=prompt),
                               exact_law(target, sampling, prompt))
  assert p_value < SIGNIFICANCE, p_value
