"""Hugging Face checkpoints: GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2 and
Gemma 3 (text) folders in and out.

A Hugging Face model folder holds config.json, model.safetensors (or shards
listed in model.safetensors.index.json) and tokenizer.json. `load_hf` reads
one into a `Model`; `save_hf` writes a `Model` as one, so transformers and
other tools run the same weights. No torch is needed for either.

Parameter names map one to one, except that spec_jax fuses projections that
run on the same input into one matmul: q, k and v into `qkv`, and Llama's gate
and up into `mlp_in`. GPT-2's Conv1D kernels are stored [in, out], the
transpose of ours. Gemma's norms are stored as w and scale by 1 + w, in both.
"""

import contextlib
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.flax
import tokenizers

from spec_jax import sharding
from spec_jax.io import files
from spec_jax.io import pretrained
from spec_jax.io.bundle import ModelBundle
from spec_jax.model import Model, RopeScaling, TransformerConfig

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2",
            "gemma3_text")
# HF layer_types names <-> ours.
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# Buffers some checkpoints store that are not parameters.
_BUFFERS = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def family(config: TransformerConfig) -> str:
  """The HF architecture whose layout holds this config exactly."""
  has = lambda **switches: all(getattr(config, k) == v
                                for k, v in switches.items())
  gemma_only = has(post_norms=False, embed_scale=False,
                   query_pre_attn_scalar=None, rope_local_theta=None,
                   attn_softcap=None, final_softcap=None)
  if has(norm="layer", position="learned", mlp="gelu", qkv_bias=True,
         bias=True, tie_embeddings=True, qk_norm=False, sliding_window=None,
         num_kv_heads=config.num_heads) and gemma_only:
    return "gpt2"
  if has(norm="rms", position="rope", mlp="swiglu", bias=False) and gemma_only:
    if config.sliding_window is not None:
      if has(layer_types=None, qk_norm=False, qkv_bias=False):
        return "mistral"
    elif config.qk_norm:
      if not config.qkv_bias:
        return "qwen3"
    else:
      return "qwen2" if config.qkv_bias else "llama"
  if has(norm="gemma_rms", position="rope", mlp="geglu", bias=False,
         qkv_bias=False, post_norms=True, embed_scale=True,
         tie_embeddings=True) and config.layer_types is not None:
    if config.qk_norm and config.attn_softcap is None and (
        config.final_softcap is None):
      return "gemma3_text"
    if not config.qk_norm and config.rope_local_theta is None and (
        config.rope_scaling is None):
      return "gemma2"
  raise ValueError(
      f"no Hugging Face architecture matches {config}; export supports GPT-2 "
      "(layer norm, learned positions, GELU, biases, tied embeddings), "
      "Llama/Qwen2/Qwen3/Mistral (RMS norm, rope, SwiGLU, no output biases) "
      "and Gemma 2/3 (Gemma norms, four per block, GeGLU, tied embeddings).")


def _rope(hf: dict, layer_type: str | None = None
          ) -> tuple[float, RopeScaling | None]:
  """rope_theta and the Llama-3 or linear scaling, from either config.json
  style.

  Older transformers write rope_theta and rope_scaling at the top level,
  newer ones one rope_parameters dict, per layer type for Gemma 3
  ({"full_attention": {...}, "sliding_attention": {...}}).
  """
  params = dict(hf.get("rope_scaling") or {})
  nested = hf.get("rope_parameters") or {}
  if layer_type is not None and layer_type in nested:
    params = dict(nested[layer_type])
  elif layer_type is None or not (nested.keys() & _LAYER_TYPES.keys()):
    params.update(nested)
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported.")
  if kind == "default":
    return float(theta), None
  if kind == "linear":
    return float(theta), RopeScaling(kind="linear",
                                     factor=float(params["factor"]))
  if kind != "llama3":
    raise ValueError(f"rope type {kind!r} is not supported; only the default, "
                     "'linear' and 'llama3' are.")
  return float(theta), RopeScaling(
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_len=int(params["original_max_position_embeddings"]))


def _gpt2_config(hf: dict, dtype: str) -> TransformerConfig:
  activation = hf.get("activation_function", "gelu_new")
  if activation not in ("gelu_new", "gelu_pytorch_tanh"):
    raise ValueError(f"GPT-2 activation {activation!r} is not supported; "
                     "only the tanh GELU ('gelu_new') is.")
  if (not hf.get("scale_attn_weights", True)
      or hf.get("scale_attn_by_inverse_layer_idx", False)):
    raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) "
                     "is not supported.")
  if not hf.get("tie_word_embeddings", True):
    raise ValueError("GPT-2 with untied embeddings is not supported.")
  return TransformerConfig(
      vocab_size=hf["vocab_size"], d_model=hf["n_embd"],
      num_layers=hf["n_layer"], num_heads=hf["n_head"],
      d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
      max_len=hf["n_positions"], dtype=dtype,
      norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def _check_supported(hf: dict, model_type: str, gemma: bool) -> None:
  """Raises ValueError on features of a Llama-like config we do not run."""
  if model_type not in FAMILIES:
    raise ValueError(f"model_type {model_type!r} is not supported; spec_jax "
                     f"reads {', '.join(FAMILIES)}.")
  activation = hf.get("hidden_activation" if gemma else "hidden_act",
                      "gelu_pytorch_tanh" if gemma else "silu")
  if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
    raise ValueError(f"activation {activation!r} is not supported for "
                     f"{model_type}.")
  if hf.get("mlp_bias", False) or (model_type != "qwen2"
                                    and hf.get("attention_bias", False)):
    raise ValueError(f"{model_type} with attention_bias or mlp_bias is not "
                     "supported.")
  if hf.get("use_sliding_window", False) and model_type in ("qwen2", "qwen3"):
    raise ValueError(f"{model_type} sliding-window attention "
                     "(use_sliding_window) is not supported.")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("bidirectional attention is not supported.")


def _gemma_fields(hf: dict, model_type: str) -> dict:
  """The TransformerConfig switches of Gemma 2 and Gemma 3 text."""
  every = 6 if model_type == "gemma3_text" else 2
  layer_types = hf.get("layer_types") or [
      "full_attention" if (i + 1) % hf.get("sliding_window_pattern", every)
      == 0 else "sliding_attention" for i in range(hf["num_hidden_layers"])]
  fields = dict(
      norm="gemma_rms", mlp="geglu", post_norms=True, embed_scale=True,
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
      sliding_window=hf.get("sliding_window", 4096),
      layer_types=tuple(_LAYER_TYPES[t] for t in layer_types),
      attn_softcap=hf.get("attn_logit_softcapping"),
      final_softcap=hf.get("final_logit_softcapping"))
  if model_type == "gemma3_text":
    local_theta, local_scaling = _rope(
        dict(hf, rope_theta=hf.get("rope_local_base_freq", 10_000.0),
             rope_scaling=None), "sliding_attention")
    if local_scaling is not None:
      raise ValueError("rope scaling on Gemma 3's sliding layers is not "
                       "supported.")
    fields.update(rope_local_theta=local_theta)
  return fields


def config_from_hf(hf: dict, dtype: str = "float32") -> TransformerConfig:
  """The TransformerConfig of an HF config.json dict; unsupported features
  raise ValueError rather than load into a model that computes something
  else."""
  model_type = hf.get("model_type")
  if model_type == "gpt2":
    return _gpt2_config(hf, dtype)
  gemma = model_type in ("gemma2", "gemma3_text")
  _check_supported(hf, model_type, gemma)
  heads = hf["num_attention_heads"]
  theta, scaling = _rope(hf, "full_attention" if gemma else None)
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      d_ff=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
      dtype=dtype, norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
      position="rope", rope_theta=theta, rope_scaling=scaling, mlp="swiglu",
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      qkv_bias=model_type == "qwen2", bias=False,
      tie_embeddings=hf.get("tie_word_embeddings", gemma),
      qk_norm=model_type in ("qwen3", "gemma3_text"))
  if model_type == "mistral":
    fields.update(sliding_window=hf.get("sliding_window"))
  if gemma:
    fields.update(_gemma_fields(hf, model_type))
  return TransformerConfig(**fields)


def _rope_to_hf(config: TransformerConfig) -> dict:
  """HF rope_parameters of the (global) rotary embedding."""
  scaling = config.rope_scaling
  if scaling is None:
    return {"rope_type": "default", "rope_theta": config.rope_theta}
  if scaling.kind == "linear":
    return {"rope_type": "linear", "rope_theta": config.rope_theta,
            "factor": scaling.factor}
  return {"rope_type": "llama3", "rope_theta": config.rope_theta,
          "factor": scaling.factor,
          "low_freq_factor": scaling.low_freq_factor,
          "high_freq_factor": scaling.high_freq_factor,
          "original_max_position_embeddings": scaling.original_max_len}


def _family_to_hf(config: TransformerConfig, kind: str) -> dict:
  """The config.json fields only Mistral and Gemma have."""
  if kind == "mistral":
    return {"sliding_window": config.sliding_window}
  if kind not in ("gemma2", "gemma3_text"):
    return {}
  names = {ours: theirs for theirs, ours in _LAYER_TYPES.items()}
  return {"hidden_activation": "gelu_pytorch_tanh",
          # An int where it is one: transformers' config type-checks it.
          "query_pre_attn_scalar": _int_if_whole(
              config.query_pre_attn_scalar or config.head_dim),
          "sliding_window": config.sliding_window,
          "layer_types": [names[t] for t in config.layer_types],
          "attn_logit_softcapping": config.attn_softcap,
          "final_logit_softcapping": config.final_softcap}


def config_to_hf(config: TransformerConfig) -> dict:
  """The HF config.json dict of a config that `family` accepts."""
  kind = family(config)
  if kind == "gpt2":
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_embd": config.d_model,
        "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": config.d_ff, "n_positions": config.max_len,
        "layer_norm_epsilon": config.norm_eps,
        "activation_function": "gelu_new", "tie_word_embeddings": True,
        "dtype": config.dtype,
    }
  rope = _rope_to_hf(config)
  architecture = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
                  "mistral": "Mistral", "gemma2": "Gemma2",
                  "gemma3_text": "Gemma3"}[kind] + "ForCausalLM"
  extra = _family_to_hf(config, kind)
  if kind == "gemma3_text":
    local = {"rope_type": "default",
             "rope_theta": config.rope_local_theta or config.rope_theta}
    extra.update(rope_local_base_freq=local["rope_theta"])
    rope = {"full_attention": rope, "sliding_attention": local}
  return {
      "architectures": [architecture], **extra,
      "model_type": kind, "vocab_size": config.vocab_size,
      "head_dim": config.head_dim,
      "hidden_size": config.d_model, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "intermediate_size": config.d_ff,
      "max_position_embeddings": config.max_len,
      "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
      "tie_word_embeddings": config.tie_embeddings,
      # Both styles, so older and newer transformers read it alike.
      "rope_theta": config.rope_theta, "rope_parameters": rope,
      "rope_scaling": (rope if config.rope_scaling is not None
                       and kind != "gemma3_text" else None),
      "dtype": config.dtype,
  }


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else x


def _tensor_names(config: TransformerConfig) -> dict[tuple, list[str]]:
  """spec_jax parameter path -> the HF tensors stacked along the output axis
  (in this order) to form it."""
  kind = family(config)
  names = {}
  if kind == "gpt2":
    names[("embed", "embedding")] = ["wte.weight"]
    names[("positions",)] = ["wpe.weight"]
    norms = {"ln_attn": "ln_1", "ln_mlp": "ln_2"}
    linears = {"qkv": "attn.c_attn", "attn_out": "attn.c_proj",
               "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}
    for i in range(config.num_layers):
      for modules, weight in ((norms, "scale"), (linears, "kernel")):
        for ours, theirs in modules.items():
          names[(f"block_{i}", ours, weight)] = [f"h.{i}.{theirs}.weight"]
          names[(f"block_{i}", ours, "bias")] = [f"h.{i}.{theirs}.bias"]
    names[("ln_final", "scale")] = ["ln_f.weight"]
    names[("ln_final", "bias")] = ["ln_f.bias"]
    return names
  names[("embed", "embedding")] = ["model.embed_tokens.weight"]
  # Gemma's post_attention_layernorm follows the attention; Llama's, under
  # the same name, precedes the MLP.
  norms = {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}
  if config.post_norms:
    norms = {"ln_attn": "input_layernorm",
             "post_attn": "post_attention_layernorm",
             "ln_mlp": "pre_feedforward_layernorm",
             "post_mlp": "post_feedforward_layernorm"}
  if config.qk_norm:
    norms.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
  for i in range(config.num_layers):
    prefix = f"model.layers.{i}."
    block = f"block_{i}"
    for ours, theirs in norms.items():
      names[(block, ours, "scale")] = [f"{prefix}{theirs}.weight"]
    names[(block, "qkv", "kernel")] = [
        f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
    if config.qkv_bias:
      names[(block, "qkv", "bias")] = [
          f"{prefix}self_attn.{p}_proj.bias" for p in "qkv"]
    names[(block, "attn_out", "kernel")] = [prefix + "self_attn.o_proj.weight"]
    names[(block, "mlp_in", "kernel")] = [prefix + "mlp.gate_proj.weight",
                                        prefix + "mlp.up_proj.weight"]
    names[(block, "mlp_out", "kernel")] = [prefix + "mlp.down_proj.weight"]
  names[("ln_final", "scale")] = ["model.norm.weight"]
  if not config.tie_embeddings:
    names[("lm_head", "kernel")] = ["lm_head.weight"]
  return names


def _is_conv1d(config: TransformerConfig, name: str) -> bool:
  """GPT-2 stores its projection kernels [in, out] (Conv1D)."""
  return family(config) == "gpt2" and name.startswith("h.") and \
      name.endswith(".weight") and ".ln_" not in name


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_hf(tensors: dict, config: TransformerConfig) -> dict:
  """spec_jax params from HF tensors {name: array}; checks names and shapes."""
  if family(config) == "gpt2":  # GPT2LMHeadModel saves under "transformer.".
    tensors = {name.removeprefix("transformer."): x
               for name, x in tensors.items()}
  if config.tie_embeddings:  # Some checkpoints store the tied copy too.
    tensors = {n: x for n, x in tensors.items() if n != "lm_head.weight"}
  tensors = {n: x for n, x in tensors.items() if not _BUFFERS.match(n)}
  names = _tensor_names(config)
  wanted = {n for parts in names.values() for n in parts}
  missing, unexpected = wanted - tensors.keys(), tensors.keys() - wanted
  if missing or unexpected:
    raise ValueError(
        f"the checkpoint's tensors do not match its config.json: missing "
        f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}.")
  expected = jax.eval_shape(lambda: Model.init(config, jax.random.key(0)))
  params = {}
  for path, parts in names.items():
    arrays = [tensors[n].T if _is_conv1d(config, n) else tensors[n]
              for n in parts]
    value = jnp.concatenate([jnp.asarray(a, config.dtype) for a in arrays])
    shape = expected.params
    for key in path:
      shape = shape[key]
    if value.shape != shape.shape:
      raise ValueError(f"{parts} give shape {value.shape} for {path}, but "
                       f"config.json implies {shape.shape}.")
    _set(params, path, value)
  return params


def params_to_hf(params: dict, config: TransformerConfig) -> dict:
  """HF tensors {name: array} of spec_jax params."""
  tensors = {}
  for path, parts in _tensor_names(config).items():
    value = params
    for key in path:
      value = value[key]
    if parts[0].endswith("q_proj.weight") or parts[0].endswith("q_proj.bias"):
      rows = config.head_dim * np.array(
          [config.num_heads, config.num_kv_heads, config.num_kv_heads])
      pieces = jnp.split(value, np.cumsum(rows)[:-1])
    else:
      pieces = jnp.split(value, len(parts))
    for name, piece in zip(parts, pieces):
      tensors[name] = piece.T if _is_conv1d(config, name) else piece
  return tensors


def _local_folder(path) -> pathlib.Path:
  """path itself if it is a folder, else a hub download of the repo it names."""
  folder = pathlib.Path(path).expanduser()
  if folder.is_dir():
    return folder
  if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) or folder.exists():
    raise FileNotFoundError(f"no Hugging Face model folder at {path}.")
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(
        f"{path!r} is not a local folder, and huggingface_hub is not installed "
        "to download it; pass a local folder holding config.json, "
        "*.safetensors and tokenizer.json.") from None
  try:
    return pathlib.Path(huggingface_hub.snapshot_download(
        str(path), allow_patterns=["*.json", "*.safetensors"]))
  except Exception as error:  # Offline, unknown repo, gated repo...
    raise ValueError(
        f"could not download {path!r} from the Hugging Face hub ({error}); "
        "offline, pass a local folder holding config.json, *.safetensors and "
        "tokenizer.json.") from error


def _read_tensors(folder: pathlib.Path) -> dict:
  index = folder / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (folder / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {folder}; "
        "re-save the model with save_pretrained(safe_serialization=True).")
  tensors = {}
  for name in files:
    # The flax reader, unlike the numpy one, understands bfloat16.
    tensors.update(safetensors.flax.load_file(str(folder / name)))
  return tensors


def load_stop_ids(path) -> tuple[int, ...]:
  """The checkpoint's end-of-sequence ids, in its order (chat models often
  list the end of turn too)."""
  folder = _local_folder(path)
  eos = None
  for name in ("config.json", "generation_config.json"):  # The latter wins.
    if (folder / name).exists():
      eos = json.loads((folder / name).read_text()).get("eos_token_id", eos)
  if eos is None:
    return ()
  return tuple(eos) if isinstance(eos, list) else (eos,)


def load_eos_id(path) -> int | None:
  """The checkpoint's end-of-sequence id (the first, if it lists several)."""
  stop_ids = load_stop_ids(path)
  return stop_ids[0] if stop_ids else None


def load_chat_template(folder: pathlib.Path) -> tuple[str | None, dict]:
  """The chat template and the special tokens it may name, from
  chat_template.jinja (newer transformers) or tokenizer_config.json."""
  config = {}
  if (folder / "tokenizer_config.json").exists():
    config = json.loads((folder / "tokenizer_config.json").read_text())
  template = config.get("chat_template")
  if (folder / "chat_template.jinja").exists():
    template = (folder / "chat_template.jinja").read_text()
  if isinstance(template, list):  # [{"name": "default", "template": ...}...]
    template = {t["name"]: t["template"] for t in template}.get("default")
  tokens = {}
  for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
    token = config.get(name)
    if isinstance(token, dict):  # A serialised AddedToken.
      token = token.get("content")
    if token is not None:
      tokens[name] = token
  return template, tokens


def load_hf(path, dtype: str = "float32", mesh=None,
            replicate: bool = False) -> ModelBundle:
  """Reads a Hugging Face GPT-2, Llama or Qwen2 model.

  Args:
    path: a local folder with config.json, model.safetensors (or a sharded
      model.safetensors.index.json) and tokenizer.json; or a hub name such as
      "HuggingFaceTB/SmolLM2-135M" when huggingface_hub and the network are
      there.
    dtype: parameter and activation dtype; weights are cast to it.
    mesh: if given, the weights are read into host memory and each device
      receives only its shards (sharding.py's rules), replicated if
      `replicate`.

  Raises:
    FileNotFoundError: a file is missing.
    ValueError: the architecture or one of its features is not supported, or
      the weights do not match the config.
  """
  folder = _local_folder(path)
  if not (folder / "config.json").exists():
    raise FileNotFoundError(f"no config.json in {folder}.")
  if not (folder / "tokenizer.json").exists():
    raise FileNotFoundError(
        f"no tokenizer.json in {folder}; spec_jax reads tokenizers through "
        "the `tokenizers` library. Save one with "
        "AutoTokenizer.from_pretrained(...).save_pretrained(folder).")
  hf = json.loads((folder / "config.json").read_text())
  config = config_from_hf(hf, dtype)
  # With a mesh, stage the weights in host memory, not on one accelerator.
  staging = (jax.default_device(jax.local_devices(backend="cpu")[0])
             if mesh is not None else contextlib.nullcontext())
  with staging:
    model = Model(config, params_from_hf(_read_tensors(folder), config))
  if mesh is not None:
    model = sharding.shard_model(model, mesh, replicate)
  tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
  chat_template, tokens = load_chat_template(folder)
  return ModelBundle(model, tokenizer, load_stop_ids(folder), chat_template,
                     tokens)


def save_hf(path, model: Model, tokenizer: tokenizers.Tokenizer,
            eos_id: int | None = None) -> None:
  """Writes model as a Hugging Face folder that transformers loads.

  GPT-2-like configs are written as GPT2LMHeadModel, Llama-like ones as
  LlamaForCausalLM or Qwen2ForCausalLM. The folder is written under a
  temporary name and renamed when complete.

  eos_id: by default the tokenizer's "<|endoftext|>", if it has one.
  """
  hf = config_to_hf(model.config)
  if eos_id is None:
    eos_id = tokenizer.token_to_id(pretrained.EOS)
  hf.update(bos_token_id=eos_id, eos_token_id=eos_id)
  eos_token = tokenizer.id_to_token(eos_id) if eos_id is not None else None
  with files.atomic_directory(path) as staging:
    (staging / "config.json").write_text(json.dumps(hf, indent=2))
    (staging / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id}, indent=2))
    (staging / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
         "bos_token": eos_token}, indent=2))
    tokenizer.save(str(staging / "tokenizer.json"))
    safetensors.flax.save_file(params_to_hf(model.params, model.config),
                                str(staging / "model.safetensors"),
                                metadata={"format": "pt"})
