"""EAGLE-3 heads in the layouts the field publishes: `load_eagle3` and
`save_eagle3`.

  SpecForge and the EAGLE authors': config.json (LlamaForCausalLMEagle3, the
    layer's settings at the top level) and model.safetensors, or
    pytorch_model.bin (a torch pickle: older heads); tensors `fc.*`,
    `midlayer.*`, `norm.*`, `lm_head.*`, `d2t`, `t2d`, maybe `embed_tokens.*`;
    with fc_norm true, `fc_norm.{i}.*` too (one RMSNorm per feature layer).
  speculators (Eagle3Speculator): the layer's settings nested in
    transformer_layer_config, tensors `layers.0.*` instead of `midlayer.*`,
    and norm_before_residual true unless the config says otherwise.

`save_eagle3` writes the SpecForge layout, which vLLM, SGLang and SpecForge
load. Every refusal names the file and the key or tensor at fault.
"""

import dataclasses
import json
import logging
import pathlib

import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from spec_jax.eagle import EagleConfig, EagleDrafter, default_feature_layers
from spec_jax.io import files
from spec_jax.io.hf import rope_settings
from spec_jax.model import Model

_log = logging.getLogger(__name__)

# Boolean keys a config may set to true without changing the computation.
_HARMLESS_FLAGS = {"use_cache", "tie_word_embeddings", "embed_requires_grad",
                   "return_dict", "_attn_implementation_autoset"}
# Variant flags this module implements, each of which config.json may hold.
_VARIANTS = {"norm_before_residual", "fc_norm", "norm_output"}


def _layer_names(prefix: str, config: EagleConfig) -> dict[str, tuple]:
  """Published tensor name -> (our parameter path, its row range in a fused
  kernel or None, expected shape)."""
  c = config
  h, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, (
      c.num_kv_heads * c.head_dim)
  attn, mlp = prefix + "self_attn.", prefix + "mlp."
  names = {
      "fc.weight": (("fc", "kernel"), None,
                    (h, len(c.feature_layers) * c.target_hidden_size)),
      attn + "q_proj.weight": (("qkv", "kernel"), (0, q_rows), (q_rows, 2 * h)),
      attn + "k_proj.weight": (("qkv", "kernel"), (q_rows, q_rows + kv_rows),
                               (kv_rows, 2 * h)),
      attn + "v_proj.weight": (("qkv", "kernel"),
                               (q_rows + kv_rows, q_rows + 2 * kv_rows),
                               (kv_rows, 2 * h)),
      attn + "o_proj.weight": (("o_proj", "kernel"), None, (h, q_rows)),
      mlp + "gate_proj.weight": (("mlp_in", "kernel"),
                                 (0, c.intermediate_size),
                                 (c.intermediate_size, h)),
      mlp + "up_proj.weight": (("mlp_in", "kernel"),
                               (c.intermediate_size, 2 * c.intermediate_size),
                               (c.intermediate_size, h)),
      mlp + "down_proj.weight": (("down_proj", "kernel"), None,
                                 (h, c.intermediate_size)),
      "norm.weight": (("norm", "scale"), None, (h,)),
      "lm_head.weight": (("lm_head", "kernel"), None,
                         (c.draft_vocab_size, h)),
  }
  for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
    names[f"{prefix}{norm}.weight"] = ((norm, "scale"), None, (h,))
  if c.fc_norm:
    for i in range(len(c.feature_layers)):
      names[f"fc_norm.{i}.weight"] = ((f"fc_norm_{i}", "scale"), None,
                                      (c.target_hidden_size,))
  if not c.norm_output:
    del names["norm.weight"]
  if c.own_embedding:
    names["embed_tokens.weight"] = (("embed_tokens", "embedding"), None,
                                    (c.vocab_size, h))
  return names


def _check_flags(settings: dict, where: str, handled: set) -> None:
  for key, value in settings.items():
    if value is True and key not in _HARMLESS_FLAGS | handled:
      raise ValueError(
          f"{where}: {key}=true is a variant spec_jax does not implement "
          f"(it runs {', '.join(sorted(_VARIANTS))} and the published "
          "EAGLE-3 layer); convert the head or drop the flag if it does not "
          "change the computation.")


def _config(hf: dict, where: str, target: Model,
            tensors: dict) -> tuple[EagleConfig, str]:
  """The head's EagleConfig and its tensors' layer prefix."""
  nested = hf.get("transformer_layer_config")
  layer = nested if nested is not None else hf
  prefix = "layers.0." if nested is not None else "midlayer."
  # speculators' own default; SpecForge's and EAGLE's heads have no such key
  # and add the plain hidden input.
  norm_before_residual = bool(hf.get("norm_before_residual",
                                     nested is not None))
  _check_flags(hf, where, _VARIANTS | {"transformer_layer_config"})
  if nested is not None:
    _check_flags(nested, f"{where} (transformer_layer_config)", set())
  if layer.get("num_hidden_layers", 1) != 1:
    raise ValueError(f"{where}: num_hidden_layers="
                     f"{layer['num_hidden_layers']}; spec_jax runs one-layer "
                     "EAGLE-3 heads.")
  if layer.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act={layer['hidden_act']!r}; the "
                     "EAGLE-3 layer is a SiLU-gated MLP.")
  aux = hf.get("eagle_aux_hidden_state_layer_ids",
               (hf.get("eagle_config") or {}).get(
                   "eagle_aux_hidden_state_layer_ids"))
  # The engines capture the layers in block order, whatever the list's.
  feature_layers = (default_feature_layers(target.config.num_layers)
                    if aux is None else tuple(sorted(int(i) + 1 for i in aux)))
  if len(set(feature_layers)) != len(feature_layers):
    raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} "
                     "names a layer twice.")
  vocab_size = layer.get("vocab_size", hf.get("vocab_size"))
  try:
    if vocab_size is None:
      raise KeyError("vocab_size")
    theta, scaling = rope_settings(layer)
    hidden_size = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    config = EagleConfig(
        hidden_size=hidden_size,
        intermediate_size=int(layer["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads", heads)),
        head_dim=int(layer.get("head_dim") or hidden_size // heads),
        vocab_size=int(vocab_size),
        draft_vocab_size=int(hf.get("draft_vocab_size",
                                    layer.get("draft_vocab_size",
                                              vocab_size))),
        target_hidden_size=int(hf.get("target_hidden_size") or hidden_size),
        feature_layers=feature_layers,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        norm_before_residual=norm_before_residual,
        fc_norm=bool(hf.get("fc_norm", False)),
        norm_output=bool(hf.get("norm_output", True)),
        own_embedding="embed_tokens.weight" in tensors)
  except KeyError as error:
    raise ValueError(f"{where} has no usable {error.args[0]!r}.") from None
  except TypeError as error:  # a null or non-numeric size
    raise ValueError(f"{where} holds a setting of the wrong type "
                     f"({error}).") from None
  except ValueError as error:  # EagleConfig's own checks
    raise ValueError(f"{where}: {error}") from None
  if config.vocab_size != target.vocab_size:
    raise ValueError(
        f"{where}: vocab_size={config.vocab_size}, but the target's "
        f"vocabulary has {target.vocab_size} tokens; the head drafts for "
        "another tokenizer.")
  return config, prefix


def _read_tensors(folder: pathlib.Path) -> tuple[dict, pathlib.Path]:
  """{name: numpy array} from model.safetensors or pytorch_model.bin."""
  path = folder / "model.safetensors"
  if path.exists():
    try:
      return safetensors.numpy.load_file(str(path)), path
    except Exception as error:  # safetensors raises its own error types
      raise ValueError(f"{path} is not a readable safetensors file "
                       f"({type(error).__name__}: {error}).") from None
  path = folder / "pytorch_model.bin"
  if not path.exists():
    raise FileNotFoundError(
        f"no model.safetensors or pytorch_model.bin in {folder}: an EAGLE-3 "
        "head folder holds config.json and one of them.")
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(
        f"{path} is a torch pickle, which needs torch to read: install "
        "torch (CPU is enough), or convert the head to model.safetensors."
    ) from None
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as error:  # pickle, zip and torch errors alike
    raise ValueError(f"{path} is not a readable torch checkpoint "
                     f"({type(error).__name__}: {error}).") from None
  return {name: (t.float() if t.is_floating_point() else t).numpy()
          for name, t in state.items()}, path


def _vocab_ids(tensors: dict, config: EagleConfig, where) -> np.ndarray | None:
  """[K] the target ids of the draft vocabulary, from d2t (checked against
  t2d); None for the whole vocabulary."""
  present = {"d2t", "t2d"} & tensors.keys()
  k, v = config.draft_vocab_size, config.vocab_size
  if not present and k == v:
    return None
  for name in ("d2t", "t2d"):
    if name not in tensors:
      raise ValueError(f"{where} has no {name!r}: a draft vocabulary of {k} "
                       f"of {v} tokens needs both d2t and t2d.")
  d2t, t2d = np.asarray(tensors["d2t"]), np.asarray(tensors["t2d"])
  if d2t.shape != (k,) or t2d.shape != (v,):
    raise ValueError(f"{where}: d2t {d2t.shape} and t2d {t2d.shape} should "
                     f"be ({k},) and ({v},) (draft_vocab_size, vocab_size).")
  vocab_ids = d2t.astype(np.int64) + np.arange(k)
  if not np.array_equal(np.nonzero(t2d)[0], vocab_ids):
    raise ValueError(f"{where}: d2t and t2d disagree (nonzero(t2d) != d2t + "
                     "arange(draft_vocab_size)); the vocabulary mapping is "
                     "corrupt.")
  return None if k == v else vocab_ids.astype(np.int32)


def _params(tensors: dict, config: EagleConfig, prefix: str, where) -> dict:
  names = _layer_names(prefix, config)
  # SpecForge writes norm.weight whether or not lm_head reads it.
  unused = {"d2t", "t2d"} | ({"norm.weight"} if not config.norm_output
                             else set())
  unknown = sorted(tensors.keys() - names.keys() - unused)
  if unknown:
    raise ValueError(
        f"{where} holds tensors the published EAGLE-3 layer has no place "
        f"for: {', '.join(unknown)}; it is a variant spec_jax does not "
        "implement.")
  fused = {}
  for name, (path, rows, shape) in names.items():
    if name not in tensors:
      raise ValueError(f"{where} has no tensor {name!r}.")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
      raise ValueError(
          f"{where}: {name} is {tuple(tensor.shape)}, but config.json makes "
          f"it {shape}.")
    fused.setdefault(path, []).append((rows, tensor))
  params = {}
  for (module, leaf), parts in fused.items():
    parts = sorted(parts, key=lambda part: part[0] or (0,))
    value = np.concatenate([p for _, p in parts], 0)
    params.setdefault(module, {})[leaf] = jnp.asarray(
        value.astype(np.float32), config.dtype)
  return params


def load_eagle3(path, target: Model, dtype: str = "float32") -> EagleDrafter:
  """The EAGLE-3 head in folder `path` (SpecForge, EAGLE or speculators
  layout), drafting for `target`.

  When the head has no embed_tokens it reads the target's table; when its
  config names no feature layers, EAGLE-3's default (2, L // 2, L - 3).

  Raises:
    FileNotFoundError: no config.json, or no weights file.
    ImportError: a pytorch_model.bin without torch installed.
    ValueError: a tensor missing or of the wrong shape, a head for another
      target (vocabulary or feature width), d2t/t2d that disagree, or a
      variant this module does not implement.
  """
  folder = pathlib.Path(path).absolute()
  config_path = folder / "config.json"
  if not config_path.exists():
    raise FileNotFoundError(
        f"no EAGLE-3 head at {folder}: expected config.json there (with "
        "model.safetensors or pytorch_model.bin). Train one with `python -m "
        "experiments.train_eagle`.")
  try:
    hf = json.loads(config_path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"{config_path} is not JSON ({error}).") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{config_path} holds no JSON object.")
  tensors, weights_path = _read_tensors(folder)
  config, prefix = _config(hf, str(config_path), target, tensors)
  config = dataclasses.replace(config, dtype=dtype)
  params = _params(tensors, config, prefix, str(weights_path))
  vocab_ids = _vocab_ids(tensors, config, str(weights_path))
  drafter = EagleDrafter(target, params, config,
                         None if vocab_ids is None else jnp.asarray(vocab_ids))
  try:
    drafter.validate(target, 0)
  except ValueError as error:
    raise ValueError(f"{config_path}: {error}") from None
  return drafter


def config_json(config: EagleConfig, dtype: str = "bfloat16") -> dict:
  """The head's config.json, SpecForge's LlamaForCausalLMEagle3."""
  hf = {
      "architectures": ["LlamaForCausalLMEagle3"],
      "model_type": "llama",
      "num_hidden_layers": 1,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "vocab_size": config.vocab_size,
      "draft_vocab_size": config.draft_vocab_size,
      "target_hidden_size": config.target_hidden_size,
      "rope_theta": config.rope_theta,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [
          i - 1 for i in config.feature_layers]},
      "attention_bias": False,
      "mlp_bias": False,
      "tie_word_embeddings": False,
      "torch_dtype": dtype,
  }
  if config.norm_before_residual:
    hf["norm_before_residual"] = True
  if config.fc_norm:
    hf["fc_norm"] = True
  if not config.norm_output:
    hf["norm_output"] = False
  scaling = config.rope_scaling
  if scaling is not None and scaling.kind == "linear":
    hf["rope_scaling"] = {"rope_type": "linear", "factor": scaling.factor}
  elif scaling is not None:
    hf["rope_scaling"] = {
        "rope_type": "llama3", "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_len}
  return hf


def servable_problems(config: EagleConfig, num_layers: int) -> list[str]:
  """Why the serving engines (vLLM, SGLang) could not feed this head what
  it was trained on: they fuse exactly three feature layers, and capture
  the inputs of blocks 0..L - 1, not the last block's output."""
  problems = []
  if len(config.feature_layers) != 3:
    problems.append(f"{len(config.feature_layers)} feature layers, not 3")
  if max(config.feature_layers) >= num_layers:
    problems.append(f"feature layer {max(config.feature_layers)} is the "
                    "last block's output")
  return problems


def save_eagle3(drafter: EagleDrafter, path, dtype: str = "bfloat16",
                metadata: dict | None = None) -> None:
  """Writes the head as a SpecForge folder, atomically: config.json and
  model.safetensors with the published names, weights in `dtype`, d2t int64
  and t2d bool; metadata.json too when given (training records; other
  tools ignore it).

  Raises:
    ValueError: a draft vocabulary that names a token twice.
  """
  config = drafter.config
  problems = servable_problems(config, drafter.target.config.num_layers)
  if problems:
    _log.warning("%s: %s; spec_jax loads it, the serving engines may not.",
                 path, "; ".join(problems))
  storage = np.dtype(jnp.dtype(dtype))
  vocab_ids = (np.arange(config.vocab_size) if drafter.vocab_ids is None
               else np.asarray(drafter.vocab_ids, np.int64))
  # The format lists the draft vocabulary in ascending target ids.
  order = np.argsort(vocab_ids, kind="stable")
  vocab_ids = vocab_ids[order]
  if np.any(np.diff(vocab_ids) == 0):
    raise ValueError("the head's vocab_ids name a token twice; a draft "
                     "vocabulary lists distinct target ids.")
  tensors = {}
  for name, (path_in, rows, _) in _layer_names("midlayer.", config).items():
    value = np.asarray(drafter.params[path_in[0]][path_in[1]], np.float32)
    if rows is not None:
      value = value[rows[0]:rows[1]]
    if path_in[0] == "lm_head":
      value = value[order]
    tensors[name] = np.ascontiguousarray(value).astype(storage)
  if not config.norm_output:
    # Unread, but SpecForge's head always has it, and loads strictly.
    tensors["norm.weight"] = np.ones(config.hidden_size, storage)
  tensors["d2t"] = (vocab_ids - np.arange(len(vocab_ids))).astype(np.int64)
  t2d = np.zeros(config.vocab_size, bool)
  t2d[vocab_ids] = True
  tensors["t2d"] = t2d
  hf = config_json(config, storage.name)
  with files.atomic_directory(path) as staging:
    (staging / "config.json").write_text(json.dumps(hf, indent=2))
    safetensors.numpy.save_file(tensors, str(staging / "model.safetensors"),
                                metadata={"format": "pt"})
    if metadata is not None:
      (staging / "metadata.json").write_text(json.dumps(metadata, indent=2))

