"""The model families spec_jax reads and writes, one record each.

A record holds what is particular to a family, as data: its Hugging Face names
(model_type, architecture, the config.json key of each TransformerConfig
field), the architecture switches it sets, where each parameter sits in its
checkpoints, and its llama.cpp (GGUF) names. hf.py and gguf.py read and write
every family through these records, so a new family is one entry in FAMILIES
(often a `dataclasses.replace` of a close one), plus its switches in model.py
if it has a feature no family has yet.
"""

import dataclasses
from typing import Any, Callable, Mapping

# In `Family.requires`: any value but None.
SET = "set"
# In `Family.keys`: no default; a config.json without the key is refused.
REQUIRED = "required"


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a checkpoint keeps each of our parameters.

  Our leaf "bias" is the HF tensor "<module>.bias"; every other leaf (kernel,
  scale, embedding, the position table) is "<module>.weight".

  top: our modules outside the blocks -> their HF modules ("embed" ->
    "model.embed_tokens"); "positions" is the learned position table.
  block: the HF prefix of block {i}.
  blocks: each module of a block -> the HF modules stacked along the output
    axis to form it (q, k and v into our fused qkv; gate and up into mlp_in).
  strip: a prefix some checkpoints save every name under (GPT2LMHeadModel's
    "transformer."), dropped on reading.
  buffers: endings of tensors checkpoints store that are not parameters.
  conv1d: kernels are stored [in, out] (GPT-2's Conv1D), ours [out, in].
  """

  top: Mapping[str, str]
  block: str
  blocks: Mapping[str, tuple[str, ...]]
  strip: str = ""
  buffers: tuple[str, ...] = ()
  conv1d: bool = False


@dataclasses.dataclass(frozen=True)
class Gguf:
  """A family's names in llama.cpp's GGUF files. Metadata keys common to all
  architectures ("{architecture}.block_count"...) and tensor names
  ("blk.{i}.attn_q"...) are llama.cpp's, in gguf.py.

  architecture: general.architecture, also the prefix of its metadata keys.
  keys: TransformerConfig fields this family stores under a metadata key of
    its own (after the prefix).
  hard_coded: the fields llama.cpp hard-codes for the family rather than
    stores, from the fields read.
  permuted_qk: the converter permuted the query and key rows for llama.cpp's
    rotary pairing (Llama's), which reading undoes.
  tokenizers: the tokenizer.ggml.model values read: "gpt2" (byte-level BPE)
    and "llama" (Gemma's SentencePiece vocabulary).
  """

  architecture: str
  keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
  hard_coded: Callable[[Mapping[str, Any]], dict] | None = None
  permuted_qk: bool = False
  tokenizers: tuple[str, ...] = ("gpt2",)


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: how its checkpoints map to a TransformerConfig and
  its parameters.

  model_type, architecture: config.json's "model_type" and "architectures".
  switches: the TransformerConfig fields the family sets; a config is saved
    as this family only if it has these values.
  keys: TransformerConfig field -> (config.json key, value when the key is
    absent or null), read and written. The value is REQUIRED, a constant, or
    a function of the fields read (GPT-2's d_ff).
  activation: the config.json key naming the MLP's nonlinearity; the values
    accepted follow from switches["mlp"] (hf.py).
  checks: config.json key -> the only value spec_jax runs, for features it
    does not have (mlp_bias); a checkpoint setting another is refused.
  layout: where each parameter sits in its checkpoints.
  requires: what else a config needs to be saved as this family (SET: any
    value but None): what tells it from a close family (Mistral's window),
    and what its export is limited to (Gemma 2 without rope scaling).
  global_every: every global_every-th layer is global and the others slide,
    unless config.json lists layer_types (Gemma; GGUF files, which list
    none, always follow it); None: no layer types.
  local_rope: the sliding layers have their own rotary base (Gemma 3).
  gguf: its GGUF names; None: no GGUF reader.
  """

  model_type: str
  architecture: str
  switches: Mapping[str, Any]
  keys: Mapping[str, tuple[str, Any]]
  activation: str
  checks: Mapping[str, Any]
  layout: Layout
  requires: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  global_every: int | None = None
  local_rope: bool = False
  gguf: Gguf | None = None


GPT2_LAYOUT = Layout(
    top={"embed": "wte", "positions": "wpe", "ln_final": "ln_f",
         "lm_head": "lm_head"},
    block="h.{i}.",
    blocks={"ln_attn": ("ln_1",), "qkv": ("attn.c_attn",),
            "attn_out": ("attn.c_proj",), "ln_mlp": ("ln_2",),
            "mlp_in": ("mlp.c_fc",), "mlp_out": ("mlp.c_proj",)},
    strip="transformer.", buffers=(".attn.bias", ".attn.masked_bias"),
    conv1d=True)
LLAMA_LAYOUT = Layout(
    top={"embed": "model.embed_tokens", "ln_final": "model.norm",
         "lm_head": "lm_head"},
    block="model.layers.{i}.",
    blocks={"ln_attn": ("input_layernorm",),
            "qkv": ("self_attn.q_proj", "self_attn.k_proj",
                    "self_attn.v_proj"),
            "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",),
            "attn_out": ("self_attn.o_proj",),
            "ln_mlp": ("post_attention_layernorm",),
            "mlp_in": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp_out": ("mlp.down_proj",)},
    buffers=("rotary_emb.inv_freq",))
# Gemma's post_attention_layernorm follows the attention; Llama's, under the
# same name, precedes the MLP.
GEMMA_LAYOUT = dataclasses.replace(LLAMA_LAYOUT, blocks={
    **LLAMA_LAYOUT.blocks, "post_attn": ("post_attention_layernorm",),
    "ln_mlp": ("pre_feedforward_layernorm",),
    "post_mlp": ("post_feedforward_layernorm",)})

# Gemma's switches, off.
_NOT_GEMMA = dict(post_norms=False, embed_scale=False,
                  query_pre_attn_scalar=None, rope_local_theta=None,
                  attn_softcap=None, final_softcap=None)
_LLAMA_SWITCHES = dict(norm="rms", position="rope", mlp="swiglu", bias=False,
                       qkv_bias=False, qk_norm=False, **_NOT_GEMMA)
_GEMMA_SWITCHES = dict(norm="gemma_rms", position="rope", mlp="geglu",
                       bias=False, qkv_bias=False, post_norms=True,
                       embed_scale=True)
_LLAMA_KEYS = {
    "vocab_size": ("vocab_size", REQUIRED),
    "d_model": ("hidden_size", REQUIRED),
    "num_layers": ("num_hidden_layers", REQUIRED),
    "num_heads": ("num_attention_heads", REQUIRED),
    "num_kv_heads": ("num_key_value_heads", None),  # None: num_heads.
    "head_dim": ("head_dim", None),  # None: d_model // num_heads.
    "d_ff": ("intermediate_size", REQUIRED),
    "max_len": ("max_position_embeddings", REQUIRED),
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
}
_NO_BIASES = {"attention_bias": False, "mlp_bias": False,
              "use_bidirectional_attention": False}


def _gemma3_hard_coded(fields: Mapping[str, Any]) -> dict:
  """llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B model
  (62 layers), whose query_pre_attn_scalar is d_model / heads; its sliding
  layers' rotary base is 10000."""
  scalar = (fields["d_model"] // fields["num_heads"]
            if fields["num_layers"] == 62 else fields["head_dim"])
  return {"query_pre_attn_scalar": float(scalar), "rope_local_theta": 10_000.0}


GPT2 = Family(
    "gpt2", "GPT2LMHeadModel",
    switches=dict(norm="layer", position="learned", mlp="gelu", qkv_bias=True,
                  bias=True, qk_norm=False, sliding_window=None,
                  num_kv_heads=None, **_NOT_GEMMA),
    keys={"vocab_size": ("vocab_size", REQUIRED),
          "d_model": ("n_embd", REQUIRED),
          "num_layers": ("n_layer", REQUIRED),
          "num_heads": ("n_head", REQUIRED),
          "d_ff": ("n_inner", lambda fields: 4 * fields["d_model"]),
          "max_len": ("n_positions", REQUIRED),
          "norm_eps": ("layer_norm_epsilon", 1e-5),
          "tie_embeddings": ("tie_word_embeddings", True)},
    activation="activation_function",
    checks={"scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True},
    layout=GPT2_LAYOUT, requires={"tie_embeddings": True})
LLAMA = Family(
    "llama", "LlamaForCausalLM",
    switches=dict(_LLAMA_SWITCHES, sliding_window=None), keys=_LLAMA_KEYS,
    activation="hidden_act", checks=_NO_BIASES, layout=LLAMA_LAYOUT,
    gguf=Gguf("llama", permuted_qk=True))
QWEN2 = dataclasses.replace(
    LLAMA, model_type="qwen2", architecture="Qwen2ForCausalLM",
    switches=dict(LLAMA.switches, qkv_bias=True),
    checks={"mlp_bias": False, "use_sliding_window": False,
            "use_bidirectional_attention": False},
    gguf=Gguf("qwen2"))
QWEN3 = dataclasses.replace(
    LLAMA, model_type="qwen3", architecture="Qwen3ForCausalLM",
    switches=dict(LLAMA.switches, qk_norm=True),
    checks=dict(_NO_BIASES, use_sliding_window=False), gguf=Gguf("qwen3"))
# A Mistral config without a window is saved as Llama, the same model.
MISTRAL = dataclasses.replace(
    LLAMA, model_type="mistral", architecture="MistralForCausalLM",
    switches=dict(_LLAMA_SWITCHES, layer_types=None),
    keys=dict(_LLAMA_KEYS, sliding_window=("sliding_window", None)),
    requires={"sliding_window": SET}, gguf=None)
GEMMA2 = Family(
    "gemma2", "Gemma2ForCausalLM",
    switches=dict(_GEMMA_SWITCHES, qk_norm=False, rope_local_theta=None),
    keys=dict(_LLAMA_KEYS,
              tie_embeddings=("tie_word_embeddings", True),
              sliding_window=("sliding_window", 4096),
              query_pre_attn_scalar=("query_pre_attn_scalar", 256.0),
              attn_softcap=("attn_logit_softcapping", None),
              final_softcap=("final_logit_softcapping", None)),
    activation="hidden_activation", checks=_NO_BIASES, layout=GEMMA_LAYOUT,
    requires={"tie_embeddings": True, "layer_types": SET,
              "rope_scaling": None},
    global_every=2)
GEMMA3 = dataclasses.replace(
    GEMMA2, model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    switches=dict(_GEMMA_SWITCHES, qk_norm=True),
    requires={"tie_embeddings": True, "layer_types": SET,
              "attn_softcap": None, "final_softcap": None},
    global_every=6, local_rope=True,
    gguf=Gguf("gemma3", keys={"sliding_window": "attention.sliding_window"},
              hard_coded=_gemma3_hard_coded, tokenizers=("gpt2", "llama")))

FAMILIES = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA2, GEMMA3)
