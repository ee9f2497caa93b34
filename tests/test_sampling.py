"""Sampling transforms: temperature, then top-k, then top-p."""

import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj

LOGITS = jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15]))


def test_temperature_one_is_softmax():
  np.testing.assert_allclose(sj.Sampling().probs(LOGITS),
                             [0.05, 0.4, 0.1, 0.3, 0.15], rtol=1e-5)


def test_greedy_is_one_hot_argmax():
  np.testing.assert_array_equal(sj.Sampling(temperature=0).probs(LOGITS),
                                [0, 1, 0, 0, 0])


def test_top_k_keeps_k_most_likely():
  probs = sj.Sampling(top_k=2).probs(LOGITS)
  np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], rtol=1e-5)


def test_top_p_keeps_smallest_set_reaching_p():
  # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. Mass before 0.15 is 0.7 < 0.75: kept.
  probs = sj.Sampling(top_p=0.75).probs(LOGITS)
  np.testing.assert_allclose(probs, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85],
                             rtol=1e-5)
  np.testing.assert_allclose(sj.Sampling(top_p=0.1).probs(LOGITS),
                             [0, 1, 0, 0, 0])


def test_top_k_applies_before_top_p():
  # After top-k=3 the laws are 0.4/0.85, 0.3/0.85, 0.15/0.85; top-p=0.8 keeps
  # the first two (mass before the third is 0.82 >= 0.8).
  probs = sj.Sampling(top_k=3, top_p=0.8).probs(LOGITS)
  np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], rtol=1e-5)


def test_temperature_sharpens():
  cold = sj.Sampling(temperature=0.5).probs(LOGITS)
  expected = np.array([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2
  np.testing.assert_allclose(cold, expected / expected.sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_settings_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sj.Sampling(**kwargs)


def test_argmax_matches_jnp_argmax_with_ties_and_nan():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 4, (64, 7, 50)).astype(np.float32)  # many ties
  x[3, 2, 10] = np.nan
  x[5, 0, [4, 9]] = np.nan
  np.testing.assert_array_equal(sj.sampling.argmax(jnp.asarray(x)),
                                jnp.argmax(jnp.asarray(x), -1))
