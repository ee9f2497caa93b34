"""Matmul weights stored in bfloat16 under float32 activations: what is stored,
what survives a checkpoint, how far the logits move, and that speculative
decoding stays exact for the bfloat16 model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from configs import quickstart
from experiments.harness import config as config_lib
from experiments.harness import loading
from spec_jax import model as model_lib
from spec_jax import sharding
from spec_jax.io import checkpoint, pretrained

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [2, 7, 1, 8, 2]]

# The matmul weights; every other parameter keeps the activation dtype.
MATMUL_WEIGHTS = ("kernel", "embedding")


def llama_style(weight_dtype=None):
  """Untied output layer (lm_head), RMSNorm, rotary positions, GQA."""
  config = sj.TransformerConfig(
      vocab_size=32, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2,
      d_ff=64, max_len=64, norm="rms", position="rope", mlp="swiglu",
      qkv_bias=False, bias=False, tie_embeddings=False,
      weight_dtype=weight_dtype)
  return sj.Model.init(config, jax.random.key(1))


def dtypes(model):
  """{parameter path: dtype name}."""
  flat, _ = jax.tree_util.tree_flatten_with_path(model.params)
  return {"/".join(str(k.key) for k in path): x.dtype.name
          for path, x in flat}


def check_stored_in_bfloat16(model):
  for name, dtype in dtypes(model).items():
    wanted = ("bfloat16" if name.rsplit("/", 1)[-1] in MATMUL_WEIGHTS
              else "float32")
    assert dtype == wanted, name


def test_matmul_weights_are_bfloat16_and_the_rest_float32(pair):
  target, _ = pair
  check_stored_in_bfloat16(target.with_weight_dtype("bfloat16"))
  untied = llama_style("bfloat16")  # initialised so
  assert "lm_head/kernel" in dtypes(untied)
  check_stored_in_bfloat16(untied)
  check_stored_in_bfloat16(llama_style().with_weight_dtype("bfloat16"))
  # Activations, the cache and the logits stay float32.
  model = target.with_weight_dtype("bfloat16")
  logits, cache = model(np.array([[1, 2, 3]]), model.init_cache(1, 8))
  assert logits.dtype == cache.keys[0].dtype == np.float32


def test_weight_dtype_equal_to_dtype_is_the_plain_model(pair):
  target, _ = pair
  assert dataclasses.replace(target.config,
                             weight_dtype="float32") == target.config
  back = target.with_weight_dtype("bfloat16").with_weight_dtype(None)
  assert back.config == target.config
  assert set(dtypes(back).values()) == {"float32"}
  with pytest.raises(ValueError, match="floating dtype"):
    dataclasses.replace(target.config, weight_dtype="int8")


@pytest.mark.parametrize("make", ["builtin_pair", "llama_style"])
def test_logits_are_close_to_float32(pair, make):
  """bfloat16 keeps 8 significant bits: the logits move by well under 1% of
  their spread, and the greedy choice almost never changes."""
  model = pair[0] if make == "builtin_pair" else llama_style()
  tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, model.vocab_size)
  full = np.asarray(sj.score(model, tokens))
  half = np.asarray(sj.score(model.with_weight_dtype("bfloat16"), tokens))
  spread = full.max() - full.min()
  error = np.abs(half - full).max()
  assert 0 < error < 0.01 * spread, (error, spread)
  assert (half.argmax(-1) == full.argmax(-1)).mean() >= 0.95


def test_config_and_dtypes_round_trip_through_a_checkpoint(pair, tmp_path):
  model = pair[0].with_weight_dtype("bfloat16")
  tokenizer = checkpoint.load_tokenizer(pretrained.resolve("pretrained/target"))
  checkpoint.save_model(tmp_path / "bf16", model, tokenizer)
  loaded, _ = checkpoint.load_model(tmp_path / "bf16")
  assert loaded.config == model.config
  assert loaded.config.weight_dtype == "bfloat16"
  check_stored_in_bfloat16(loaded)
  tokens = np.array([[1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(sj.score(loaded, tokens),
                                sj.score(model, tokens))
  # A float32 model saved in bfloat16 files comes back float32 throughout.
  checkpoint.save_model(tmp_path / "f32", pair[0], tokenizer,
                        storage_dtype="bfloat16")
  loaded, _ = checkpoint.load_model(tmp_path / "f32")
  assert set(dtypes(loaded).values()) == {"float32"}


def test_checkpoint_loads_into_shardings_in_its_dtypes(pair, tmp_path):
  """A mesh of one device: the restore targets and the placement take each
  parameter's own dtype, and casting a sharded model keeps its shardings."""
  mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
  model = pair[0].with_weight_dtype("bfloat16")
  tokenizer = checkpoint.load_tokenizer(pretrained.resolve("pretrained/target"))
  checkpoint.save_model(tmp_path / "bf16", model, tokenizer)
  placed, _ = checkpoint.load_model(tmp_path / "bf16", mesh)
  check_stored_in_bfloat16(placed)
  sharded = sharding.shard_model(pair[0], mesh).with_weight_dtype("bfloat16")
  check_stored_in_bfloat16(sharded)
  kernel = sharded.params["block_0"]["qkv"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("model", None)
  tokens = np.array([[1, 2, 3, 4, 5]])
  np.testing.assert_allclose(sj.score(placed, tokens), sj.score(model, tokens),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("draft_dtype", ["bfloat16", "float32"])
def test_greedy_speculative_equals_greedy_autoregressive(pair, gamma,
                                                         draft_dtype):
  """The law speculative decoding preserves is the bfloat16 target's: greedy,
  its tokens, whatever the draft's dtype."""
  target, draft = pair
  target = target.with_weight_dtype("bfloat16")
  draft = draft.with_weight_dtype(draft_dtype)
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = sj.DecodeConfig(gamma=gamma, max_new_tokens=24,
                           sampling=sj.Sampling(temperature=0))
  key = jax.random.key(0)
  spec = sj.generate(key, target, sj.ModelDrafter(draft), padded, lengths,
                     config)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.num_tokens, plain.num_tokens)
  assert spec.stats.summary()["acceptance_rate"] > 0.3


def test_harness_config_casts_both_models_after_loading():
  config = quickstart.get_config("runlocal")
  config.weight_dtype = "bfloat16"
  loaded = loading.load_models(config)
  check_stored_in_bfloat16(loaded.target.model)
  check_stored_in_bfloat16(loaded.drafter.model)
  config.weight_dtype = "int8"
  with pytest.raises(ValueError, match="weight_dtype='int8'"):
    config_lib.check(config)


def test_a_decode_loop_takes_bfloat16_embedding_rows_without_a_float32_table():
  """The embedding lookup takes the bfloat16 table's bits, so no float32
  copy of the table is made and hoisted out of a loop (35 ms a decode loop
  with SmolLM2's). Control: `jnp.take` of the bfloat16 table makes one."""
  model = llama_style("bfloat16")
  table = model.params["embed"]["embedding"]
  copy = f"f32[{table.shape[0]},{table.shape[1]}]"

  def compiled(embed):
    def loop(table, token):
      return jax.lax.fori_loop(
          0, 4, lambda i, x: x + embed(table, (token + i) % 32).sum(), 0.0)
    return jax.jit(loop).lower(table, 3).compile().as_text()

  module = model_lib.Embed(32, 48, jnp.float32, "bfloat16")
  by_module = lambda table, t: module.apply({"params": {"embedding": table}},
                                            t)
  assert copy not in compiled(by_module)
  assert copy in compiled(lambda table, t: jnp.take(table, t, axis=0).astype(
      jnp.float32))
  np.testing.assert_array_equal(
      by_module(table, jnp.arange(32)), table.astype(jnp.float32))
