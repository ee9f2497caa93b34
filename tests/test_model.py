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


def _rope_model():
  config = sj.TransformerConfig(vocab_size=16, d_model=32, num_layers=2,
                                num_heads=4, num_kv_heads=2, d_ff=64,
                                max_len=32, norm="rms", position="rope",
                                mlp="swiglu", qkv_bias=False, bias=False)
  return sj.Model.init(config, jax.random.key(3))


def test_tree_pass_scores_each_node_as_its_own_path(pair):
  """One pass over a tree under the ancestor mask gives every node the
  logits of its root-to-node path scored alone, and leaves the context's
  slots as they were."""
  context = jnp.array([[3, 1, 4, 1, 5]])
  # Call tokens: the context's last token, then six nodes. Parents index the
  # call's tokens; -1 hangs from the cached context.
  tokens = jnp.array([[5, 9, 2, 6, 5, 3, 8]])
  parents = jnp.array([[-1, 0, 0, 1, 1, 3, 2]])
  depth = jnp.array([[0, 1, 1, 2, 2, 3, 2]])
  for model in (pair[0], _rope_model()):
    cache = model.prefill(context, jnp.array([5]), 16)  # 4 slots valid
    logits, tree_cache = model(tokens, cache, 4 + depth, parents=parents)
    np.testing.assert_array_equal(tree_cache.lengths, [4 + 7])
    for node in range(7):
      path, index = [], node
      while index >= 0:
        path.insert(0, int(tokens[0, index]))
        index = int(parents[0, index])
      alone = sj.score(model, jnp.array([[3, 1, 4, 1] + path]))[0, -1]
      np.testing.assert_allclose(logits[0, node], alone, atol=1e-5)


def test_hidden_states_are_the_inputs_of_the_blocks(pair):
  target, _ = pair
  tokens = jnp.array([[3, 1, 4, 1, 5]])
  cache = target.init_cache(1, 8)
  logits, _, (first, last) = target.forward(
      tokens, cache, hidden_layers=(0, target.config.num_layers))
  assert first.shape == last.shape == (1, 5, target.config.d_model)
  # The first block's input is the embedding plus the position table.
  params = target.params
  np.testing.assert_allclose(
      first, params["embed"]["embedding"][tokens] + params["positions"][:5],
      atol=1e-6)
  # The last block's output, through the final norm and the tied head.
  scale, bias = params["ln_final"]["scale"], params["ln_final"]["bias"]
  mean = last.mean(-1, keepdims=True)
  normed = (last - mean) / jnp.sqrt(last.var(-1, keepdims=True)
                                    + target.config.norm_eps) * scale + bias
  np.testing.assert_allclose(normed @ params["embed"]["embedding"].T, logits,
                             atol=1e-4)


def test_a_call_that_leaves_its_keys_unwritten_matches_one_that_writes():
  """write=False (the verify inside the loop's width switch): the logits,
  and the cache once committed, are the writing call's, for rows at
  different pointers and a sliding-window layer; a following step then
  reads the same cache. The control commits at slots one off, and the same
  check rejects it."""
  config = sj.TransformerConfig(vocab_size=97, d_model=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, d_ff=128,
                                max_len=64, position="rope", norm="rms",
                                mlp="swiglu", sliding_window=4,
                                layer_types=("sliding", "full"))
  target = sj.Model.init(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 14), 0, 97)
  cache = target.prefill(tokens[:, :7], jnp.array([4, 7]), 32)  # pointers 3, 6
  written_logits, written, _ = target.forward(tokens[:, 7:12], cache)
  logits, pending, _ = target.forward(tokens[:, 7:12], cache, write=False)
  np.testing.assert_allclose(logits, written_logits, atol=1e-5)

  def next_step(cache):
    return target(tokens[:, 12:13], cache)[0]

  committed = target.commit(cache, pending)
  np.testing.assert_array_equal(committed.lengths, written.lengths)
  expected = next_step(written)
  np.testing.assert_allclose(next_step(committed), expected, atol=1e-5)
  one_off = pending.replace(slots=pending.slots + 1)
  assert not np.allclose(next_step(target.commit(cache, one_off)), expected,
                         atol=1e-3)
