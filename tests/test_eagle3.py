"""EAGLE-3 heads in the published formats: parity with an independent
reference, loading and saving both layouts, refusals, and exact decoding with
a loaded head.

The reference (eagle3_reference.py) is numpy written from the published
description; the heads are random, in the published names and shapes:
  minimal      SpecForge's layout without head_dim, rope_theta or
               embed_tokens (so theta 10,000 and the target's raw embedding
               table), on a Gemma-style target (which scales its own
               embeddings), a reduced vocabulary;
  full         with head_dim != hidden / heads, rope_theta, embed_tokens,
               grouped-query attention, a head wider than the target
               (target_hidden_size) and named feature layers;
  speculators  the nested layout, `layers.0.*` names, norm_before_residual
               and the whole vocabulary as its draft vocabulary;
  fc_norm      SpecForge's fc_norm (an RMSNorm per feature layer before fc,
               of the target's width, narrower than the head's) and
               norm_output false (lm_head reads the layer's output without
               the final norm, whose weight the file still holds).
"""

import builtins
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import spec_jax as sj
from spec_jax import eagle
import eagle3_reference as reference
from conftest import tiny_pair
from test_gemma_style import gemma_pair

STEPS = 5


@pytest.fixture(scope="module")
def gpt2_target():
  return tiny_pair(seed=3, num_layers=3)[0]


@pytest.fixture(scope="module")
def gemma_target():
  return gemma_pair(16, seed=2)[0]


VARIANTS = {
    "minimal": dict(target="gemma", hidden_size=32, target_hidden_size=32,
                    vocab=16, draft_vocab=10, heads=4, kv_heads=4,
                    intermediate=64),
    "full": dict(target="gpt2", hidden_size=48, target_hidden_size=32,
                 vocab=16, draft_vocab=12, heads=4, kv_heads=2,
                 intermediate=80, head_dim=16, rope_theta=1e6,
                 embed_tokens=True, aux_layers=(0, 1, 2), norm_output=True),
    "speculators": dict(target="gpt2", hidden_size=32,
                        target_hidden_size=32, vocab=16, draft_vocab=16,
                        heads=2, kv_heads=1, intermediate=64,
                        speculators=True, norm_before_residual=True,
                        aux_layers=(1, 0, 2)),
    "fc_norm": dict(target="gpt2", hidden_size=48, target_hidden_size=32,
                    vocab=16, draft_vocab=12, heads=4, kv_heads=2,
                    intermediate=64, embed_tokens=True, fc_norm=True,
                    norm_output=False),
}


def make_head(tmp_path, name, seed=0):
  """(folder, config dict, tensors) of a random head of variant `name`."""
  options = dict(VARIANTS[name])
  del options["target"]
  config, tensors = reference.random_head(np.random.default_rng(seed),
                                          **options)
  folder = tmp_path / name
  reference.write_head(folder, config, tensors)
  return folder, config, tensors


@pytest.fixture
def targets(gpt2_target, gemma_target):
  return {"gpt2": gpt2_target, "gemma": gemma_target}


def reference_drafts(target, config, tensors, tokens, wrong=None):
  """The reference's drafts and logits for each row of tokens [B, n + 1],
  on the target features the reference selects from the config."""
  prompt = jnp.asarray(tokens[:, :-1])
  layers = tuple(reference.feature_layers(config, target.config.num_layers))
  _, _, hidden = target.forward(prompt, target.init_cache(*prompt.shape),
                                hidden_layers=layers)
  features = np.concatenate([np.asarray(h, np.float64) for h in hidden], -1)
  table = np.asarray(target.params["embed"]["embedding"], np.float64)
  rows = [reference.greedy_drafts(tensors, config, features[b], tokens[b],
                                  table, STEPS, wrong)
          for b in range(len(tokens))]
  return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_drafts_equal_the_reference(tmp_path, targets, name):
  target = targets[VARIANTS[name]["target"]]
  folder, config, tensors = make_head(tmp_path, name)
  drafter = sj.load_eagle3(folder, target)
  tokens = np.random.default_rng(1).integers(0, 16, (3, 7)).astype(np.int32)
  drafts, logits = eagle.greedy_drafts(target, drafter, jnp.asarray(tokens),
                                       STEPS)
  expected_drafts, expected_logits = reference_drafts(target, config,
                                                      tensors, tokens)
  np.testing.assert_array_equal(drafts, expected_drafts)
  logits = np.asarray(logits)
  in_vocab = np.broadcast_to(tensors["t2d"], logits.shape)
  np.testing.assert_array_equal(np.isfinite(logits), in_vocab)
  np.testing.assert_allclose(logits[in_vocab], expected_logits[in_vocab],
                             atol=1e-4, rtol=0)
  # The rows of a batch do not affect each other. Alone, a row's passes
  # are small enough for the CPU kernels and together they are not, so the
  # sums run in other orders: equal to float32 rounding, where a leak
  # between rows would be of the logits' size.
  for row in range(len(tokens)):
    alone = eagle.greedy_drafts(target, drafter,
                                jnp.asarray(tokens[row:row + 1]), STEPS)
    np.testing.assert_array_equal(alone[0][0], drafts[row])
    np.testing.assert_allclose(alone[1][0], logits[row], atol=1e-4)


@pytest.mark.parametrize("name,wrong", [
    ("minimal", {"theta": 1e6}),  # the target's rotary base, not the head's
    ("full", {"norm_before_residual": True}),
    ("speculators", {"norm_before_residual": False}),
    ("fc_norm", {"fc_norm": False}),
    ("fc_norm", {"norm_output": True}),
])
def test_the_parity_check_rejects_a_wrong_layer(tmp_path, targets, name,
                                                wrong):
  """Negative control: the same comparison against a reference with one
  setting wrong finds logits more than 1e-4 apart."""
  target = targets[VARIANTS[name]["target"]]
  folder, config, tensors = make_head(tmp_path, name)
  drafter = sj.load_eagle3(folder, target)
  tokens = np.random.default_rng(1).integers(0, 16, (3, 7)).astype(np.int32)
  _, logits = eagle.greedy_drafts(target, drafter, jnp.asarray(tokens), STEPS)
  _, expected = reference_drafts(target, config, tensors, tokens, wrong)
  in_vocab = np.broadcast_to(tensors["t2d"], expected.shape)
  assert np.abs(np.asarray(logits)[in_vocab] - expected[in_vocab]).max() > 1e-2


def test_settings_are_read_as_published(tmp_path, targets):
  minimal = sj.load_eagle3(make_head(tmp_path, "minimal")[0],
                           targets["gemma"]).config
  # No head_dim, rope_theta or embed_tokens: hidden / heads, 10,000 (not the
  # target's 1e6) and the target's table.
  assert (minimal.head_dim, minimal.rope_theta) == (8, 10_000.0)
  assert not minimal.own_embedding
  assert minimal.feature_layers == (0, 1, 2)  # 2, L // 2, L - 3 of 3 blocks
  full = sj.load_eagle3(make_head(tmp_path, "full")[0], targets["gpt2"]).config
  assert (full.head_dim, full.rope_theta, full.target_hidden_size) == (
      16, 1e6, 32)
  assert full.own_embedding and full.feature_layers == (1, 2, 3)
  spec = sj.load_eagle3(make_head(tmp_path, "speculators")[0],
                        targets["gpt2"])
  assert spec.config.norm_before_residual and spec.vocab_ids is None
  # Listed (1, 0, 2): fused in block order, as the engines capture them.
  assert spec.config.feature_layers == (1, 2, 3)
  assert full.norm_output and not full.fc_norm
  normed = sj.load_eagle3(make_head(tmp_path, "fc_norm")[0],
                          targets["gpt2"])
  assert normed.config.fc_norm and not normed.config.norm_output
  # The unread norm.weight is dropped, not loaded.
  assert "norm" not in normed.params


@pytest.mark.parametrize("name", ["full", "fc_norm"])
def test_save_then_load_gives_identical_drafts(tmp_path, targets, name):
  target = targets["gpt2"]
  loaded = sj.load_eagle3(make_head(tmp_path, name)[0], target)
  sj.save_eagle3(loaded, tmp_path / "saved", dtype="float32",
                 metadata={"note": "round trip"})
  again = sj.load_eagle3(tmp_path / "saved", target)
  assert again.config == loaded.config
  for a, b in zip(jax.tree.leaves(again.params),
                  jax.tree.leaves(loaded.params)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(again.vocab_ids, loaded.vocab_ids)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 16, (2, 6)))
  for x, y in zip(eagle.greedy_drafts(target, again, tokens, STEPS),
                  eagle.greedy_drafts(target, loaded, tokens, STEPS)):
    np.testing.assert_array_equal(x, y)
  # The published names and dtypes; bfloat16 by default, stable once
  # rounded.
  sj.save_eagle3(again, tmp_path / "bf16")
  first = safetensors.numpy.load_file(str(tmp_path / "bf16" /
                                          "model.safetensors"))
  assert first["d2t"].dtype == np.int64 and first["t2d"].dtype == bool
  assert first["midlayer.self_attn.q_proj.weight"].dtype.name == "bfloat16"
  assert set(first) == set(safetensors.numpy.load_file(
      str(tmp_path / name / "model.safetensors")))
  config = json.loads((tmp_path / "bf16" / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
      i - 1 for i in loaded.config.feature_layers]
  assert config.get("fc_norm", False) == loaded.config.fc_norm
  assert config.get("norm_output", True) == loaded.config.norm_output
  sj.save_eagle3(sj.load_eagle3(tmp_path / "bf16", target), tmp_path / "bf16b")
  second = safetensors.numpy.load_file(str(tmp_path / "bf16b" /
                                           "model.safetensors"))
  for name, value in first.items():
    np.testing.assert_array_equal(value, second[name])


def test_unsorted_draft_vocabulary_is_saved_ascending(tmp_path, targets):
  """A head whose vocab_ids are not ascending is saved with lm_head's rows
  permuted to the published order: the same drafts after loading."""
  target = targets["gpt2"]
  loaded = sj.load_eagle3(make_head(tmp_path, "full")[0], target)
  order = np.random.default_rng(0).permutation(12)
  params = dict(loaded.params, lm_head={
      "kernel": loaded.params["lm_head"]["kernel"][order]})
  shuffled = loaded.replace(params=params, vocab_ids=loaded.vocab_ids[order])
  sj.save_eagle3(shuffled, tmp_path / "saved", dtype="float32")
  again = sj.load_eagle3(tmp_path / "saved", target)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 16, (2, 6)))
  np.testing.assert_array_equal(
      eagle.greedy_drafts(target, again, tokens, STEPS)[0],
      eagle.greedy_drafts(target, loaded, tokens, STEPS)[0])


def test_pytorch_bin_loads_as_the_safetensors(tmp_path, targets):
  torch = pytest.importorskip("torch")
  target = targets["gpt2"]
  folder, config, tensors = make_head(tmp_path, "full")
  from_safetensors = sj.load_eagle3(folder, target)
  pickled = tmp_path / "pickled"
  pickled.mkdir()
  (pickled / "config.json").write_text(json.dumps(config))
  torch.save({name: torch.from_numpy(np.asarray(t))
              for name, t in tensors.items()}, pickled / "pytorch_model.bin")
  from_bin = sj.load_eagle3(pickled, target)
  for a, b in zip(jax.tree.leaves(from_bin.params),
                  jax.tree.leaves(from_safetensors.params)):
    np.testing.assert_array_equal(a, b)


def refused(folder, target, error, match):
  with pytest.raises(error, match=match):
    sj.load_eagle3(folder, target)


def rewrite(folder, config=None, tensors=None):
  if config is not None:
    (folder / "config.json").write_text(json.dumps(config))
  if tensors is not None:
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))


def test_bad_heads_are_refused_with_the_file_and_tensor(tmp_path, targets,
                                                        monkeypatch):
  target = targets["gpt2"]
  refused(tmp_path / "nothing", target, FileNotFoundError, "config.json")
  folder, config, tensors = make_head(tmp_path, "full")
  (folder / "model.safetensors").unlink()
  refused(folder, target, FileNotFoundError, "pytorch_model.bin")
  (folder / "pytorch_model.bin").write_bytes(b"")
  real_import = builtins.__import__
  monkeypatch.setattr(builtins, "__import__", lambda name, *args, **kw: (
      _raise(ImportError(name)) if name == "torch"
      else real_import(name, *args, **kw)))
  refused(folder, target, ImportError, "needs torch")
  monkeypatch.undo()
  (folder / "pytorch_model.bin").unlink()

  def bad(change_config=None, change_tensors=None, match=""):
    c = json.loads(json.dumps(config))
    t = dict(tensors)
    if change_config:
      change_config(c)
    if change_tensors:
      change_tensors(t)
    rewrite(folder, c, t)
    refused(folder, target, ValueError, match)

  bad(change_tensors=lambda t: t.pop("midlayer.hidden_norm.weight"),
      match="model.safetensors has no tensor 'midlayer.hidden_norm.weight'")
  bad(change_tensors=lambda t: t.update({"midlayer.self_attn.k_proj.weight":
                                         np.zeros((16, 96), np.float32)}),
      match=r"k_proj.weight is \(16, 96\), but config.json makes it "
            r"\(32, 96\)")
  bad(change_config=lambda c: c.update(vocab_size=32),
      change_tensors=lambda t: t.update(
          t2d=np.concatenate([t["t2d"], np.zeros(16, bool)]),
          **{"embed_tokens.weight": np.zeros((32, 48), np.float32)}),
      match="vocab_size=32, but the target's vocabulary has 16")
  bad(change_config=lambda c: c.update(target_hidden_size=24),
      change_tensors=lambda t: t.update(
          {"fc.weight": np.zeros((48, 72), np.float32)}),
      match="features 24 wide, but the target's d_model is 32")
  bad(change_config=lambda c: c.update(
      eagle_aux_hidden_state_layer_ids=[0, 0, 1]),
      match="names a layer twice")
  bad(change_tensors=lambda t: t.update(d2t=t["d2t"] + 1),
      match="d2t and t2d disagree")
  bad(change_tensors=lambda t: t.pop("t2d"), match="no 't2d'")
  bad(change_config=lambda c: c.update(norm_before_fc=True),
      match="norm_before_fc=true is a variant")
  bad(change_config=lambda c: c.update(fc_norm=True),
      match="model.safetensors has no tensor 'fc_norm.0.weight'")
  bad(change_tensors=lambda t: t.update(
      {"midlayer.self_attn.q_norm.weight": np.ones(16, np.float32)}),
      match="no place for: midlayer.self_attn.q_norm.weight")
  (folder / "config.json").write_text("{not json")
  refused(folder, target, ValueError, "config.json is not JSON")
  rewrite(folder, dict(config, num_hidden_layers=2), tensors)
  refused(folder, target, ValueError, "num_hidden_layers=2")
  wrong = dict(config)
  del wrong["hidden_size"]
  rewrite(folder, wrong, tensors)
  refused(folder, target, ValueError, "has no usable 'hidden_size'")


def _raise(error):
  raise error


PROMPTS = [[3, 9, 4, 7, 3, 9, 4, 7, 3, 9], [4, 5, 6, 7, 8], [13], [2, 7, 1, 8]]


@pytest.mark.parametrize("tree", [None, (3, 2, 1)])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_greedy_target_with_a_loaded_head(
    tmp_path, targets, tree, batch):
  """A loaded random head, rows of mixed lengths, EOS (15) mid-way."""
  target = targets["gpt2"]
  drafter = sj.load_eagle3(make_head(tmp_path, "full")[0],
                           target).with_tree(tree)
  padded, lengths = sj.pad_prompts(PROMPTS[:batch])
  key = jax.random.key(0)
  rules = [sj.resample] if tree else [sj.resample, sj.resample_block]
  for rule in rules:
    config = sj.DecodeConfig(gamma=3, max_new_tokens=24, eos_id=15,
                             sampling=sj.Sampling(temperature=0),
                             resample=rule)
    spec = sj.generate(key, target, drafter, padded, lengths, config)
    plain = sj.generate_autoregressive(key, target, padded, lengths, config)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
  if batch == 4:
    assert (np.asarray(plain.num_tokens) < 24).any()  # an EOS mid-way
