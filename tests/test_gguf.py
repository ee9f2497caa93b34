"""GGUF files: tiny ones written here with llama.cpp's writer (exact round
trips, quantized tensors, clear errors), and the real SmolLM2 and Gemma 3
files against transformers reading the same bytes (slow; skipped unless their
pip packages are installed)."""

import dataclasses
import zlib

import jax
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF tests need `pip install gguf`")

import spec_jax as sj
from spec_jax.io import families, hf
from spec_jax.io import gguf as sj_gguf
from test_hf import tiny_config

# A byte-level vocabulary: the 256 byte symbols, two merges, two chat tokens.
SPELLING = sj_gguf._bytes_to_unicode()  # pylint: disable=protected-access
TOKENS = [SPELLING[b] for b in range(256)] + ["he", "hel", "<|im_start|>",
                                             "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _config(arch):
  return sj.TransformerConfig(
      vocab_size=len(TOKENS), d_model=96, num_layers=2, num_heads=6,
      num_kv_heads=2, d_ff=64, max_len=64, norm="rms",
      norm_eps=2.0**-17,  # Exact in float32, as GGUF stores it.
      position="rope", rope_theta=10_000.0, mlp="swiglu",
      qkv_bias=arch == "qwen2", bias=False, tie_embeddings=arch == "qwen2")


def _permute(weight, heads):
  """convert_hf_to_gguf.py's LlamaModel.permute, which load_gguf undoes."""
  return (weight.reshape(heads, 2, weight.shape[0] // heads // 2,
                         *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def _gguf_names(layout):
  """HF tensor name -> GGUF name, from the family's layout and llama.cpp's
  names in gguf.py."""
  # pylint: disable=protected-access
  names = {layout.top[ours]: theirs
           for theirs, ours in sj_gguf._TOP.items() if ours in layout.top}
  for theirs, (ours, place) in sj_gguf._BLOCK.items():
    if ours in layout.blocks:
      names[layout.blocks[ours][place]] = theirs
  return names


def write_gguf(path, model, arch="llama", tensor_type="F32", extra=None,
               quantize=gguf.quants.quantize):
  """model as llama.cpp's converter writes it: GGUF names, q/k rows permuted
  where the architecture's record says so, Gemma norms stored as 1 + w,
  tensors of `tensor_type` (norms stay F32, as llama.cpp keeps them), made
  by quantize(x [out, in], type) -> bytes."""
  cfg = model.config
  family = hf.family_of(cfg)
  record = {f.gguf.architecture: f.gguf for f in families.FAMILIES
            if f.gguf}.get(arch)
  permuted = record is not None and record.permuted_qk
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(cfg.num_layers)
  writer.add_context_length(cfg.max_len)
  writer.add_embedding_length(cfg.d_model)
  writer.add_feed_forward_length(cfg.d_ff)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_key_length(cfg.head_dim)
  writer.add_value_length(cfg.head_dim)
  writer.add_layer_norm_rms_eps(cfg.norm_eps)
  writer.add_rope_freq_base(cfg.rope_theta)
  for field, name in (record.keys if record else {}).items():
    writer.add_uint32(f"{arch}.{name}", getattr(cfg, field))
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(TOKENS)
  writer.add_token_types([1] * 258 + [3, 3])
  writer.add_token_merges(["h e", "he l"])
  writer.add_eos_token_id(len(TOKENS) - 1)
  writer.add_chat_template(TEMPLATE)
  names = _gguf_names(family.layout)
  prefixes = [family.layout.block.format(i=i) for i in range(cfg.num_layers)]
  quant = gguf.GGMLQuantizationType[tensor_type]
  for name, value in hf.params_to_hf(model.params, cfg).items():
    value = np.asarray(value, np.float32)
    stem, suffix = name.rsplit(".", 1)
    block = [i for i, prefix in enumerate(prefixes) if stem.startswith(prefix)]
    if block:
      stem = stem.removeprefix(prefixes[block[0]])
      gguf_name = f"blk.{block[0]}.{names[stem]}.{suffix}"
    else:
      gguf_name = f"{names[stem]}.{suffix}"
    if permuted and ".attn_q." in gguf_name:
      value = _permute(value, cfg.num_heads)
    elif permuted and ".attn_k." in gguf_name:
      value = _permute(value, cfg.num_kv_heads)
    elif cfg.norm == "gemma_rms" and gguf_name.endswith("norm.weight"):
      value = value + 1
    if value.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
      writer.add_tensor(gguf_name, quantize(value, quant), raw_dtype=quant)
    else:
      writer.add_tensor(gguf_name, value)
  for gguf_name, (data, quant) in (extra or {}).items():
    writer.add_tensor(gguf_name, data, raw_dtype=quant)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize(
    "family", [family for family in families.FAMILIES if family.gguf],
    ids=lambda family: family.gguf.architecture)
def test_every_gguf_family_round_trips_through_its_record(tmp_path, family):
  """Each record's GGUF names are what load_gguf reads: a tiny model of the
  family, written as llama.cpp would, loads back exactly, config and
  parameters, and reads as the family's config.json does."""
  model = sj.Model.init(tiny_config(family), jax.random.key(0))
  loaded = sj_gguf.load_gguf(write_gguf(tmp_path / "m.gguf", model,
                                        family.gguf.architecture)).model
  assert loaded.config == model.config
  assert hf.family_of(loaded.config) is family
  jax.tree.map(np.testing.assert_array_equal, loaded.params, model.params)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_file_loads_exactly(tmp_path, arch):
  """Llama's permuted q/k rows come back in HF order, Qwen2's were never
  permuted; the tokenizer, stop ids and chat template travel with them."""
  model = sj.Model.init(_config(arch), jax.random.key(0))
  bundle = sj_gguf.load_gguf(write_gguf(tmp_path / "m.gguf", model, arch))
  assert bundle.model.config == model.config
  jax.tree.map(np.testing.assert_array_equal, bundle.model.params,
               model.params)
  assert bundle.tokenizer.encode("hello<|im_end|>").ids == [
      257, ord("l"), ord("o"), 259]
  assert bundle.stop_ids == (259,) and bundle.eos_id == 259
  assert bundle.encode_chat([{"role": "user", "content": "he"}]) == (
      [258] + [ord(c) for c in "user\n"] + [256, 259, ord("\n"), 258]
      + [ord(c) for c in "assistant\n"])


def _dequantized_params(model, quant, quantize):
  """What load_gguf must return for a file of write_gguf(..., quantize)."""
  return hf.params_from_hf({
      name: gguf.quants.dequantize(quantize(x, quant), quant)
      if x.ndim == 2 else x
      for name, x in ((n, np.asarray(v, np.float32)) for n, v in
                      hf.params_to_hf(model.params, model.config).items())
  }, model.config)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0",
                                         "Q5_1", "BF16", "F16"])
def test_quantized_tensors_land_where_their_float_ones_do(tmp_path,
                                                          tensor_type):
  """Each kernel loads as llama.cpp's own dequantization of its quantized
  rows: quantization works along rows, so the q/k permutation commutes with
  it and the result is exact."""
  model = sj.Model.init(_config("llama"), jax.random.key(0))
  path = write_gguf(tmp_path / "q.gguf", model, tensor_type=tensor_type)
  quant = gguf.GGMLQuantizationType[tensor_type]
  jax.tree.map(np.testing.assert_array_equal,
               sj_gguf.load_gguf(path).model.params,
               _dequantized_params(model, quant, gguf.quants.quantize))


def _random_k_blocks(x, quant):
  """Random K-quant blocks for x [out, in] (in a multiple of 256), with
  finite f16 scales: the gguf package reads K-quants but cannot write them.
  Deterministic in x, so the expected params see the same blocks."""
  rng = np.random.default_rng(zlib.crc32(x.tobytes()))
  block_size, type_size = gguf.GGML_QUANT_SIZES[quant]
  blocks = rng.integers(0, 256, (x.size // block_size, type_size), np.uint8)
  scales = rng.uniform(1e-3, 1e-2, (len(blocks), 2)).astype(np.float16)
  if quant == gguf.GGMLQuantizationType.Q6_K:  # d is the block's last f16.
    blocks[:, -2:] = scales[:, :1].view(np.uint8)
  else:  # Q4_K, Q5_K: d and dmin open the block.
    blocks[:, :4] = scales.view(np.uint8)
  return blocks.reshape(x.shape[0], -1)


@pytest.mark.parametrize("tensor_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensors_land_where_their_float_ones_do(tmp_path,
                                                        tensor_type):
  """The K-quants, on rows of 256 (a model whose every kernel is 256
  wide): each loads as the gguf package's dequantization of its blocks.
  Qwen2, whose q/k rows GGUF does not permute: random blocks, unlike real
  quantization, do not commute with the permutation."""
  config = dataclasses.replace(_config("qwen2"), d_model=256, num_heads=4,
                               num_kv_heads=2, head_dim=64, d_ff=256)
  model = sj.Model.init(config, jax.random.key(0))
  path = write_gguf(tmp_path / "k.gguf", model, arch="qwen2",
                    tensor_type=tensor_type, quantize=_random_k_blocks)
  quant = gguf.GGMLQuantizationType[tensor_type]
  jax.tree.map(np.testing.assert_array_equal,
               sj_gguf.load_gguf(path).model.params,
               _dequantized_params(model, quant, _random_k_blocks))


def test_bad_files_are_refused_by_name(tmp_path):
  model = sj.Model.init(_config("llama"), jax.random.key(0))
  good = write_gguf(tmp_path / "good.gguf", model).read_bytes()
  (tmp_path / "cut.gguf").write_bytes(good[:len(good) // 2])
  with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF"):
    sj_gguf.load_gguf(tmp_path / "cut.gguf")
  (tmp_path / "text.gguf").write_text("not a gguf")
  with pytest.raises(ValueError, match="text.gguf is not a readable GGUF"):
    sj_gguf.load_gguf(tmp_path / "text.gguf")
  with pytest.raises(FileNotFoundError, match="no GGUF file"):
    sj_gguf.load_gguf(tmp_path / "missing.gguf")

  iq4 = gguf.GGMLQuantizationType.IQ4_NL
  odd = write_gguf(tmp_path / "iq4.gguf", model, extra={
      "blk.0.attn_q_norm.weight": (np.zeros((8, 18), np.uint8), iq4)})
  with pytest.raises(ValueError, match=r"iq4.gguf: tensor "
                     r"'blk.0.attn_q_norm.weight' has type IQ4_NL"):
    sj_gguf.load_gguf(odd)

  mamba = write_gguf(tmp_path / "mamba.gguf", model, arch="mamba")
  with pytest.raises(ValueError, match="mamba.gguf: architecture 'mamba'"):
    sj_gguf.load_gguf(mamba)


# Real files: transformers reads the same GGUF (dequantized to float32 with
# the same gguf code), so the only differences left are float rounding.
PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
           "Once upon a time, in a small village by the sea,"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "And an even one?"}]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct",
                                        "gemma3-270m"])
def real_pair(request):
  """(spec_jax bundle, transformers model, transformers tokenizer)."""
  path = sj_gguf.packaged(request.param)
  if path is None:
    pytest.skip(f"{request.param} is not installed; see the README's set-up.")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch_model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  return sj_gguf.load_gguf(path), torch_model, tokenizer


@pytest.mark.slow
def test_real_gguf_logits_match_transformers(real_pair):
  import torch  # pylint: disable=import-outside-toplevel
  bundle, torch_model, tokenizer = real_pair
  for prompt in PROMPTS:
    ids = tokenizer(prompt).input_ids
    assert bundle.tokenizer.encode(prompt).ids == ids
    with torch.no_grad():
      theirs = torch_model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(sj.score(bundle.model, np.asarray([ids])))
    print(f"{prompt[:20]!r}: max |logit diff| "
          f"{np.abs(ours - theirs).max():.2e}")
    np.testing.assert_allclose(ours, theirs, atol=5e-4, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.slow
def test_real_gguf_greedy_continuations_match_transformers(real_pair):
  import torch  # pylint: disable=import-outside-toplevel
  bundle, torch_model, tokenizer = real_pair
  ids = tokenizer(PROMPTS[0]).input_ids
  # Greedy by hand: `generate` with min_new_tokens would forbid EOS, which
  # these chat models do emit (and spec_jax, without eos_id, emits too).
  sequence = list(ids)
  with torch.no_grad():
    for _ in range(64):
      logits = torch_model(torch.tensor([sequence])).logits[0, -1]
      sequence.append(int(logits.argmax()))
  theirs = sequence[len(ids):]
  prompts, lengths = sj.pad_prompts([ids])
  ours = sj.generate_autoregressive(
      jax.random.key(0), bundle.model, prompts, lengths,
      sj.DecodeConfig(max_new_tokens=64,
                      sampling=sj.Sampling(temperature=0.0)))
  assert np.asarray(ours.tokens[0]).tolist() == theirs


@pytest.mark.slow
def test_real_gguf_chat_template_matches_transformers(real_pair):
  bundle, _, tokenizer = real_pair
  if bundle.chat_template is None:
    assert tokenizer.chat_template is None
    pytest.skip("this GGUF carries no chat template")
  for prompt in (True, False):
    assert bundle.apply_chat_template(CHAT, prompt) == (
        tokenizer.apply_chat_template(CHAT, tokenize=False,
                                      add_generation_prompt=prompt))
  assert bundle.encode_chat(CHAT) == tokenizer.apply_chat_template(
      CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
