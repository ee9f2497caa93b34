"""The KV cache: incremental decoding equals full scoring, rollback is a pointer."""

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax as sj


def test_incremental_decoding_matches_full_scoring(pair):
  target, _ = pair
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 16)
  full = sj.score(target, tokens)
  cache = target.init_cache(2, 16)
  logits, cache = target(tokens[:, :5], cache)  # prefill 5
  steps = [logits]
  for t in range(5, 12, 3):  # then blocks of up to 3 tokens
    logits, cache = target(tokens[:, t:t + 3], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [12, 12])


def test_prefill_of_different_lengths_in_one_batch(pair):
  target, _ = pair
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
  cache = target.prefill(prompts, lengths, 24)
  np.testing.assert_array_equal(cache.lengths, lengths - 1)
  # Feeding each row's last prompt token gives that row's own next-token logits.
  last = jnp.take_along_axis(prompts, lengths[:, None] - 1, 1)
  logits, _ = target(last, cache)
  for row, n in enumerate(lengths):
    alone = sj.score(target, prompts[row:row + 1, :n])[0, -1]
    np.testing.assert_allclose(logits[row, 0], alone, atol=1e-5)


def test_rollback_hides_stale_slots(pair):
  target, _ = pair
  tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6]])
  cache = target.init_cache(1, 16)
  _, cache = target(tokens[:, :4], cache)
  _, cache = target(jnp.array([[7, 7, 7, 7]]), cache)  # rejected drafts
  cache = cache.rollback(jnp.array([4]))
  logits, _ = target(tokens[:, 4:], cache)
  np.testing.assert_allclose(logits, sj.score(target, tokens)[:, 4:],
                             atol=1e-5)


def test_logits_are_float32_for_bfloat16_params():
  config = sj.TransformerConfig(vocab_size=11, d_model=16, num_layers=1,
                                num_heads=2, d_ff=32, max_len=8,
                                dtype="bfloat16")
  model = sj.Model.init(config, jax.random.key(0))
  assert model.params["embed"]["embedding"].dtype == jnp.bfloat16
  logits = sj.score(model, jnp.array([[1, 2, 3]]))
  assert logits.dtype == jnp.float32 and logits.shape == (1, 3, 11)
  probs = sj.Sampling(temperature=0.7, top_k=5).probs(logits)
  assert probs.dtype == jnp.float32
