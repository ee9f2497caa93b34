"""Monte Carlo: the whole jitted, batched loop samples the target's law.

The horizon is NUM_NEW = 2 gamma + 2 = 6 tokens at gamma 2: a cycle that
accepts both drafts emits 3 tokens and is followed by at least one more
cycle, whose draft is fed the last two of them; tests with other gammas
keep gamma <= 2 so that two full cycles fit. For each prompt the joint law
of the 6 generated tokens is computed exactly from the target (all 8^6
continuations scored). Speculative decoding draws NUM_SAMPLES = 100,000
samples through `generate`, the prompts' rows side by side in one batch, and a
chi-square goodness-of-fit test per prompt compares the counts with the
exact law (cells expected below 5 pooled). With P prompts a test passes when
every p-value is above SIGNIFICANCE / P (1e-3 in all); a correct sampler
fails with probability at most 0.001, and the seeds are fixed, so the
outcome is deterministic.

Each test also asserts that its sample is large enough: the smallest total
variation between the sampled and the exact law (over the tested cells) that
it detects with probability 0.9 is at most MAX_DETECTABLE_TV
(`conftest.detectable_total_variation`: 0.029-0.031 at 100,000 samples per
prompt, at significance 1e-3, or 1e-3 / 2 for each of two prompts).

Negative controls run the same test on a loop whose correction is drawn from
p instead of norm(max(0, p - q)), and must fail it: for a draft model (two
prompt lengths), for prompt lookup (one-hot q) and, in the files that use
this one, for trees, the block rule, EAGLE heads and a Gemma-style model.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import decoding
from conftest import chi_square_p_value, detectable_total_variation, tiny_pair

# Every test here is slow, about a minute or more each. The default suite
# checks the rules' own code by exact enumeration instead
# (tests/test_rules_by_uniforms.py); CI runs these too.
pytestmark = pytest.mark.slow

VOCAB = 8
GAMMA = 2
NUM_NEW = 2 * GAMMA + 2
NUM_SAMPLES = 100_000
CHUNK = 25_000
SIGNIFICANCE = 1e-3
MAX_DETECTABLE_TV = 0.05
PROMPT = [1, 5, 2, 6]
SHORT_PROMPT = [3, 7]
# "1 5" recurs, so prompt lookup proposes "2 6 ..." at the first cycle.
REPEATING_PROMPT = [1, 5, 2, 6, 1, 5]


@pytest.fixture(scope="module")
def pair8():
  # A draft far enough from the target (mean overlap about 0.5) that a wrong
  # correction rule shifts the law by more than the noise of N samples.
  return tiny_pair(vocab_size=VOCAB, seed=1, draft_noise=0.6)


_EXACT_LAWS = {}


def exact_law(target, sampling, prompt=PROMPT):
  """[V^NUM_NEW] probability of each continuation, in lexicographic order.

  Level by level: p(. | prompt + prefix) for every prefix of k tokens, then
  the product along each continuation; kept per (target, sampling, prompt).
  """
  key = (id(target), sampling, tuple(prompt))
  if key not in _EXACT_LAWS:
    law = np.ones(1)
    for k in range(NUM_NEW):
      prefixes = np.array(list(itertools.product(range(VOCAB), repeat=k)),
                          np.int32).reshape(VOCAB**k, k)
      sequences = np.concatenate(
          [np.broadcast_to(prompt, (len(prefixes), len(prompt))), prefixes], 1)
      probs = sampling.probs(sj.score(target, jnp.asarray(sequences))[:, -1])
      law = (law[:, None] * np.asarray(probs, np.float64)).reshape(-1)
    _EXACT_LAWS[key] = (target, law)  # target kept so that id stays unique
  return _EXACT_LAWS[key][1]


@functools.partial(jax.jit, static_argnames="num_cells")
def _cell_counts(tokens, num_cells):
  """Counts [V^NUM_NEW] of the rows of tokens [R, NUM_NEW]."""
  index = jnp.zeros(tokens.shape[0], jnp.int32)
  for i in range(NUM_NEW):
    index = index * VOCAB + tokens[:, i]
  return jnp.bincount(index, length=num_cells)


def sampled_counts(decode, seed, prompts=(PROMPT,)):
  """Counts [P, V^NUM_NEW] of the generated tokens over NUM_SAMPLES rows per
  prompt, and the rows' DecodeStats. One batch holds every prompt, its rows
  in turn, so rows of different prompt lengths decode side by side."""
  per_chunk = CHUNK // len(prompts)
  padded, lengths = sj.pad_prompts(
      [prompt for _ in range(per_chunk) for prompt in prompts])
  counts = np.zeros((len(prompts), VOCAB**NUM_NEW), np.int64)
  stats = []
  for chunk in range(NUM_SAMPLES // per_chunk):
    result = decode(jax.random.key(seed * 1000 + chunk), padded, lengths)
    assert (np.asarray(result.num_tokens) == NUM_NEW).all()
    for i in range(len(prompts)):
      counts[i] += np.asarray(_cell_counts(result.tokens[i::len(prompts)],
                                           VOCAB**NUM_NEW))
    stats.append(result.stats)
  return counts, stats


def law_check(decode, target, sampling, seed, prompts=(PROMPT,)):
  """p-values [P], one per prompt, and the rows' DecodeStats. Also asserts
  that the sample detects a total variation of MAX_DETECTABLE_TV."""
  counts, stats = sampled_counts(decode, seed, prompts)
  p_values = []
  for prompt, prompt_counts in zip(prompts, counts):
    law = exact_law(target, sampling, prompt)
    detectable = detectable_total_variation(prompt_counts, law,
                                            SIGNIFICANCE / len(prompts))
    assert detectable <= MAX_DETECTABLE_TV, detectable
    p_values.append(chi_square_p_value(prompt_counts, law))
    print(f"prompt {prompt}: {prompt_counts.sum()} samples, detects TV "
          f"{detectable:.3f}, p = {p_values[-1]:.3g}")
  return p_values, stats


def follows_law(p_values):
  return min(p_values) > SIGNIFICANCE / len(p_values)


def speculative(target, drafter, gamma, sampling, **config):
  config = decoding.DecodeConfig(gamma=gamma, max_new_tokens=NUM_NEW,
                                 sampling=sampling, **config)
  return lambda key, prompts, lengths: sj.generate(
      key, target, drafter, prompts, lengths, config)


def full_acceptance_then_more(stats, gamma):
  """Fraction of rows with a cycle that accepted all gamma drafts and at
  least one cycle after it (a full cycle emits gamma + 1 < NUM_NEW)."""
  full = np.concatenate([np.asarray(s.accepted_per_position[:, gamma - 1])
                         for s in stats])
  return float(np.mean(full > 0))


CASES = [
    (sj.Sampling(temperature=1.0), GAMMA),
    (sj.Sampling(temperature=1.0, top_k=3), GAMMA),
    (sj.Sampling(temperature=0.8, top_p=0.8), 1),
]


@pytest.mark.parametrize("sampling,gamma", CASES)
def test_speculative_samples_follow_target_law(pair8, sampling, gamma):
  """Rows of two prompt lengths side by side; a third of the rows accept
  every draft in a cycle before the last."""
  target, draft = pair8
  decode = speculative(target, sj.ModelDrafter(draft), gamma, sampling)
  p_values, stats = law_check(decode, target, sampling, seed=gamma,
                              prompts=(PROMPT, SHORT_PROMPT))
  assert follows_law(p_values), p_values
  assert full_acceptance_then_more(stats, gamma) > 0.1


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
    (block_correction_from_p, False)])
def test_block_verification_samples_the_target_law(pair8, rule, exact):
  """The block rule through the whole jitted loop, as the token rule above."""
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  decode = speculative(target, sj.ModelDrafter(draft), GAMMA, sampling,
                       resample=rule)
  p_values, _ = law_check(decode, target, sampling, seed=11)
  assert follows_law(p_values) == exact, p_values


def other_drafters(target, draft):
  return {
      "ngram": sj.NgramDrafter(VOCAB, max_n=2),
      "layer_skip": sj.LayerSkipDrafter(target, num_layers=1),
      "dynamic_gamma": sj.ModelDrafter(draft, confidence_threshold=0.5),
  }


@pytest.mark.parametrize("name", ["ngram", "layer_skip", "dynamic_gamma"])
def test_every_drafter_samples_the_target_law(pair8, name):
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  decode = speculative(target, other_drafters(target, draft)[name], GAMMA,
                       sampling)
  p_values, _ = law_check(decode, target, sampling, seed=7,
                          prompts=(REPEATING_PROMPT,))
  assert follows_law(p_values), p_values


def test_autoregressive_samples_follow_target_law(pair8):
  """The harness itself: the plain sampler passes the same test."""
  target, _ = pair8
  sampling = sj.Sampling(temperature=1.0)
  config = decoding.DecodeConfig(max_new_tokens=NUM_NEW, sampling=sampling)
  decode = lambda key, prompts, lengths: sj.generate_autoregressive(
      key, target, prompts, lengths, config)
  p_values, _ = law_check(decode, target, sampling, seed=0,
                          prompts=(PROMPT, SHORT_PROMPT))
  assert follows_law(p_values), p_values


def correction_from_p():
  """The token rule with its correction drawn from p: a wrong rule."""
  return functools.partial(sj.resample, correction=lambda q, p: p)


@pytest.mark.parametrize("name", ["model", "ngram"])
def test_negative_control_wrong_correction_is_rejected(pair8, name):
  target, draft = pair8
  drafter = (sj.ModelDrafter(draft) if name == "model"
             else other_drafters(target, draft)[name])
  prompts = (PROMPT, SHORT_PROMPT) if name == "model" else (REPEATING_PROMPT,)
  sampling = sj.Sampling(temperature=1.0)
  # Draw the correction from p instead of the residual, through the real
  # loop: the rejection rule is a public setting of the decode.
  decode = speculative(target, drafter, GAMMA, sampling,
                       resample=correction_from_p())
  p_values, _ = law_check(decode, target, sampling, seed=2, prompts=prompts)
  assert not follows_law(p_values), p_values


@pytest.mark.parametrize("adaptive, rule, exact", [
    (False, sj.resample, True),
    (True, sj.resample, True),
    # The negative control: the same test must reject it.
    (True, correction_from_p(), False)])
def test_refill_and_adaptive_draft_length_sample_the_target_law(
    pair8, adaptive, rule, exact):
  """Half the rows of each batch decode a second prompt, prefilled into the
  row inside the loop when its first finished; with the adaptive draft
  length, whose prior (0.9) starts it at 2 drafts and whose rows' counts
  (overlap about 0.5) bring it down during the run, to 0 in some cycles:
  plain target steps, after which the draft model catches up."""
  target, draft = pair8
  sampling = sj.Sampling(temperature=1.0)
  policy, costs = {}, None
  if adaptive:
    policy = {"verify_buckets": 3,
              "adaptive": sj.AdaptiveDraftLength(prior_rate=0.9)}
    costs = sj.CycleCosts.of(0.2, [1.0, 1.5, 2.0])
  config = decoding.DecodeConfig(gamma=GAMMA, max_new_tokens=NUM_NEW,
                                 sampling=sampling, resample=rule, **policy)
  decode = lambda key, prompts, lengths: sj.generate(
      key, target, sj.ModelDrafter(draft), prompts, lengths, config,
      slots=len(prompts) // 2, costs=costs)
  p_values, stats = law_check(decode, target, sampling, seed=13,
                              prompts=(PROMPT, SHORT_PROMPT))
  assert follows_law(p_values) == exact, p_values
  if adaptive:
    limits = sum(np.asarray(s.limit_cycles) for s in stats)
    print("cycles by draft length:", limits)
    assert (limits > 0).sum() >= 2 and limits[0] > 0, limits
