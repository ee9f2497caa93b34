"""Speculative decoding on a Gemma-style model: (1 + w) RMS norms, four norms
per block, query/key norms, GeGLU, scaled embeddings, soft-capping, and
sliding-window layers whose window is shorter than the sequence, so that
drafts and verifies cross the window's edge."""

import functools

import jax
import numpy as np
import pytest

import spec_jax as sj
from conftest import _perturb, chi_square_p_value
from test_law_monte_carlo import (NUM_NEW, PROMPT, correction_from_p,
                                  follows_law, law_check, speculative)

WINDOW = 3


def gemma_pair(vocab_size, seed=0, draft_noise=0.3):
  config = sj.TransformerConfig(
      vocab_size=vocab_size, d_model=32, num_layers=3, num_heads=4,
      num_kv_heads=2, head_dim=16, d_ff=64, max_len=128, norm="gemma_rms",
      position="rope", mlp="geglu", qkv_bias=False, bias=False,
      qk_norm=True, post_norms=True, embed_scale=True,
      query_pre_attn_scalar=16.0, sliding_window=WINDOW,
      layer_types=("sliding", "full", "sliding"), rope_local_theta=10_000.0,
      rope_theta=1_000_000.0, attn_softcap=20.0, final_softcap=15.0)
  target_key, noise_key = jax.random.split(jax.random.key(seed))
  target = sj.Model.init(config, target_key)
  params = dict(target.params)
  # Peaked laws, as in conftest.tiny_pair: random weights predict nearly
  # uniform tokens, which makes every sampler look right.
  params["embed"] = {"embedding": params["embed"]["embedding"] * 8}
  target = target.replace(params=params)
  return target, target.replace(params=_perturb(target.params, noise_key,
                                               draft_noise))


def test_window_changes_the_logits():
  """The window really masks: the same model without it scores differently."""
  target, _ = gemma_pair(16)
  tokens = np.random.default_rng(0).integers(0, 16, (1, 12))
  full = target.replace(config=sj.TransformerConfig(**{
      **vars(target.config), "sliding_window": 64}))
  assert np.abs(np.asarray(sj.score(target, tokens))
                - np.asarray(sj.score(full, tokens)))[:, WINDOW:].max() > 1e-3


@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_speculative_equals_greedy_target_across_the_window(gamma):
  target, draft = gemma_pair(16)
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
  config = sj.DecodeConfig(gamma=gamma, max_new_tokens=24, eos_id=7,
                           sampling=sj.Sampling(temperature=0.0))
  ar = sj.generate_autoregressive(jax.random.key(0), target, prompts,
                                  lengths, config)
  for drafter in (sj.ModelDrafter(draft), sj.NgramDrafter(16)):
    sd = sj.generate(jax.random.key(0), target, drafter, prompts, lengths,
                     config)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    np.testing.assert_array_equal(sd.num_tokens, ar.num_tokens)
  assert int(ar.num_tokens.max()) + 10 > 2 * WINDOW  # the edge is crossed


@pytest.mark.slow  # 100,000 samples; the Gemma-style greedy test is fast
def test_speculative_samples_follow_target_law_on_gemma_style_model():
  """The Monte Carlo law test of test_law_monte_carlo.py (100,000 samples of
  6 tokens, chi-square at 1e-3) with the window shorter than prompt plus
  output."""
  target, draft = gemma_pair(8, seed=1, draft_noise=0.6)
  sampling = sj.Sampling(temperature=1.0)
  assert len(PROMPT) + NUM_NEW > WINDOW
  decode = speculative(target, sj.ModelDrafter(draft), 2, sampling)
  p_values, _ = law_check(decode, target, sampling, seed=5)
  assert follows_law(p_values), p_values


@pytest.mark.slow  # the token rule's negative control runs by default
def test_negative_control_is_rejected_on_gemma_style_model():
  target, draft = gemma_pair(8, seed=1, draft_noise=0.6)
  sampling = sj.Sampling(temperature=1.0)
  decode = speculative(target, sj.ModelDrafter(draft), 2, sampling,
                       resample=correction_from_p())
  p_values, _ = law_check(decode, target, sampling, seed=6)
  assert not follows_law(p_values), p_values
