"""Hugging Face folders without torch: config styles, export and re-import,
sharded weights, grouped-query caches, and clear errors."""

import dataclasses
import json
import sys

import jax
import numpy as np
import pytest
import safetensors.flax

import spec_jax as sj
from experiments.harness import loading
from spec_jax import sharding
from spec_jax.io import checkpoint, families, hf, pretrained

LLAMA_NEW_STYLE = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 96,
    "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0,
                        "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
}


# Values of the TransformerConfig fields a family's config.json may hold;
# each family's own keys pick theirs. norm_eps is exact in float32 (GGUF's),
# query_pre_attn_scalar is head_dim (what llama.cpp hard-codes for Gemma 3),
# the window is shorter than the sequences.
TINY = dict(vocab_size=260, d_model=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, d_ff=48, max_len=64,
            norm_eps=2.0**-17, sliding_window=8, query_pre_attn_scalar=16)


def tiny_config(family: families.Family) -> sj.TransformerConfig:
  """The config of a tiny config.json of the family, built from its record."""
  return hf.config_from_hf({"model_type": family.model_type, **{
      key: TINY[field] for field, (key, _) in family.keys.items()
      if field in TINY}})


def llama_config():
  return hf.config_from_hf(LLAMA_NEW_STYLE)


def test_old_and_new_rope_keys_read_alike():
  old_style = dict(LLAMA_NEW_STYLE, rope_theta=500_000.0, rope_scaling={
      "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
  del old_style["rope_parameters"]
  config = llama_config()
  assert hf.config_from_hf(old_style) == config
  assert config.num_kv_heads == 2 and config.rope_theta == 500_000.0
  assert config.rope_scaling == sj.RopeScaling(
      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_len=32)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "phi3"}, "model_type 'phi3'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "activation .gelu."),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_features_are_refused(change, message):
  with pytest.raises(ValueError, match=message):
    hf.config_from_hf(dict(LLAMA_NEW_STYLE, **change))


@pytest.mark.parametrize("family", families.FAMILIES,
                         ids=lambda family: family.model_type)
def test_every_family_round_trips_through_its_record(family):
  """Each record is what reading and writing use: a tiny config.json of the
  family reads into a config that is saved as that family and reads back the
  same, and its parameters go to the record's tensor names and back."""
  config = tiny_config(family)
  assert hf.family_of(config) is family
  written = hf.config_to_hf(config)
  assert written["model_type"] == family.model_type
  assert written["architectures"] == [family.architecture]
  assert hf.config_from_hf(written) == config
  model = sj.Model.init(config, jax.random.key(0))
  tensors = hf.params_to_hf(model.params, config)
  layout = family.layout
  assert all(name.startswith((layout.block.format(i=0),
                              layout.block.format(i=1), *layout.top.values()))
             for name in tensors)
  jax.tree.map(np.testing.assert_array_equal,
               hf.params_from_hf(tensors, config), model.params)


def test_a_config_no_family_holds_is_refused_with_the_families():
  config = dataclasses.replace(llama_config(), post_norms=True)
  with pytest.raises(ValueError, match="save_hf writes gpt2, llama, qwen2"):
    hf.config_to_hf(config)


def test_cache_holds_only_the_key_value_heads():
  model = sj.Model.init(llama_config(), jax.random.key(0))
  assert model.init_cache(1, 8).keys[0].shape == (1, 2, 8, 16)
  assert model.params["block_0"]["qkv"]["kernel"].shape == (
      (6 + 2 * 2) * 16, 96)


def test_rope_gqa_incremental_decoding_matches_full_scoring():
  model = sj.Model.init(llama_config(), jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 512)
  cache = model.init_cache(2, 16)
  first, cache = model(tokens[:, :6], cache)
  rest, _ = model(tokens[:, 6:], cache)
  np.testing.assert_allclose(np.concatenate([first, rest], 1),
                             sj.score(model, tokens), atol=1e-5)


def test_export_then_import_is_exact_with_sharded_weights(tmp_path):
  """The built-in draft, exported and re-read, from one file and from two
  shards, gives the same parameters; its EOS id travels with it."""
  draft, tokenizer = checkpoint.load_model(pretrained.ROOT / "draft")
  hf.save_hf(tmp_path / "one", draft, tokenizer)
  bundle = sj.load_hf(tmp_path / "one")
  assert bundle.model.config == draft.config
  jax.tree.map(np.testing.assert_array_equal, bundle.model.params,
               draft.params)
  assert bundle.eos_id == tokenizer.token_to_id("<|endoftext|>")

  sharded = tmp_path / "sharded"
  sharded.mkdir()
  for name in ("config.json", "tokenizer.json"):
    (sharded / name).write_bytes((tmp_path / "one" / name).read_bytes())
  tensors = safetensors.flax.load_file(str(tmp_path / "one" /
                                           "model.safetensors"))
  names = sorted(tensors)
  weight_map = {}
  for shard, part in enumerate((names[::2], names[1::2])):
    filename = f"model-{shard + 1:05d}-of-00002.safetensors"
    safetensors.flax.save_file({n: tensors[n] for n in part},
                               str(sharded / filename))
    weight_map.update(dict.fromkeys(part, filename))
  (sharded / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": weight_map}))
  jax.tree.map(np.testing.assert_array_equal,
               sj.load_hf(sharded).model.params, draft.params)


def test_missing_tensors_are_named(tmp_path):
  draft, tokenizer = checkpoint.load_model(pretrained.ROOT / "draft")
  hf.save_hf(tmp_path, draft, tokenizer)
  tensors = safetensors.flax.load_file(str(tmp_path / "model.safetensors"))
  del tensors["h.1.mlp.c_fc.bias"]
  safetensors.flax.save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="h.1.mlp.c_fc.bias"):
    sj.load_hf(tmp_path)


def test_hub_name_without_huggingface_hub_says_pass_a_folder(monkeypatch):
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)
  with pytest.raises(ValueError, match="pass a local folder"):
    sj.load_hf("HuggingFaceTB/SmolLM2-135M")
  with pytest.raises(FileNotFoundError, match="no Hugging Face model folder"):
    sj.load_hf("/no/such/folder")


def test_main_job_refuses_a_draft_of_another_vocabulary(tmp_path):
  _, tokenizer = checkpoint.load_model(pretrained.ROOT / "draft")
  other = sj.Model.init(sj.TransformerConfig(
      vocab_size=256, d_model=16, num_layers=1, num_heads=2, d_ff=32,
      max_len=64), jax.random.key(0))
  hf.save_hf(tmp_path / "draft", other, tokenizer)
  with pytest.raises(ValueError, match="one vocabulary"):
    loading.load_pair("pretrained/draft", f"hf:{tmp_path / 'draft'}")


def test_load_hf_with_a_mesh_places_params_in_their_shardings(tmp_path):
  draft, tokenizer = checkpoint.load_model(
      pretrained.resolve("pretrained/draft"))
  hf.save_hf(tmp_path, draft, tokenizer)
  mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
  loaded = hf.load_hf(tmp_path, mesh=mesh).model
  kernel = loaded.params["block_0"]["qkv"]["kernel"]
  assert kernel.sharding.mesh.shape == mesh.shape
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("model", None)
  tokens = jax.numpy.asarray([tokenizer.encode("def f(x):\n").ids])
  np.testing.assert_allclose(sj.score(loaded, tokens), sj.score(draft, tokens),
                             atol=1e-5)
