"""Hugging Face checkpoints in and out, for the families in families.py:
GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 (text).

A Hugging Face model folder holds config.json, model.safetensors (or shards
listed in model.safetensors.index.json) and tokenizer.json. `load_hf` reads
one into a `Model`; `save_hf` writes a `Model` as one, so transformers and
other tools run the same weights. No torch is needed for either.

What is particular to a family (its config.json keys, switches and tensor
names) is its record in families.py; the code here reads and writes any of
them. Parameter names map one to one, except that spec_jax fuses projections
that run on the same input into one matmul: q, k and v into `qkv`, and
Llama's gate and up into `mlp_in`. GPT-2's Conv1D kernels are stored [in,
out], the transpose of ours. Gemma's norms are stored as w and scale by
1 + w, in both.
"""

import contextlib
import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.flax
import tokenizers

from spec_jax import sharding
from spec_jax.io import families, files, pretrained
from spec_jax.io.bundle import ModelBundle
from spec_jax.model import (Model, RopeScaling, TransformerConfig,
                            abstract_params)

_BY_MODEL_TYPE = {family.model_type: family for family in families.FAMILIES}
# HF layer_types names <-> ours.
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# The HF names of each of our MLP nonlinearities; the first is written.
_ACTIVATIONS = {"gelu": ("gelu_new", "gelu_pytorch_tanh"),
                "swiglu": ("silu",), "geglu": ("gelu_pytorch_tanh",)}
# Fields read as floats whatever number config.json writes (256 for 256.0),
# so that equal checkpoints give equal configs.
_FLOATS = {field.name for field in dataclasses.fields(TransformerConfig)
           if field.type in (float, float | None)}


def family_of(config: TransformerConfig) -> families.Family:
  """The family whose checkpoints hold this config exactly: the config has
  the family's switches and what else the family requires."""
  for family in families.FAMILIES:
    conditions = {**family.switches, **family.requires}
    fixed = {k: v for k, v in conditions.items() if v != families.SET}
    try:
      # num_kv_heads=None in GPT-2's switches is normalised to num_heads.
      same = dataclasses.replace(config, **fixed) == config
    except ValueError:  # The switches contradict the config's other fields.
      same = False
    if same and all(getattr(config, k) is not None
                    for k, v in conditions.items() if v == families.SET):
      return family
  raise ValueError(
      f"no Hugging Face family holds {config}; save_hf writes "
      f"{', '.join(_BY_MODEL_TYPE)}, each with the switches (norm, position, "
      "mlp, biases...) that its record in spec_jax/io/families.py sets.")


def rope_settings(hf: dict, layer_type: str | None = None
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


def _check_supported(hf: dict, family: families.Family) -> None:
  """Raises ValueError on config.json features spec_jax does not run."""
  accepted = _ACTIVATIONS[family.switches["mlp"]]
  activation = hf.get(family.activation, accepted[0])
  if activation not in accepted:
    raise ValueError(f"activation {activation!r} is not supported for "
                     f"{family.model_type}; spec_jax runs "
                     f"{' or '.join(map(repr, accepted))}.")
  for key, value in family.checks.items():
    if hf.get(key) not in (None, value):
      raise ValueError(f"{family.model_type} with {key}={hf[key]!r} is not "
                       f"supported; spec_jax runs {key}={value!r}.")


def _read_keys(hf: dict, family: families.Family) -> dict:
  """The fields config.json holds under the family's keys, with the
  family's defaults where it holds none."""
  fields, derived = {}, {}
  for field, (key, default) in family.keys.items():
    if hf.get(key) is not None or default == families.REQUIRED:
      fields[field] = hf[key]  # A KeyError names a missing key.
    elif callable(default):
      derived[field] = default
    else:
      fields[field] = default
  fields.update({field: default(fields) for field, default in derived.items()})
  return {field: float(value) if field in _FLOATS and value is not None
          else value for field, value in fields.items()}


def _rope_fields(hf: dict, family: families.Family) -> dict:
  """rope_theta and rope_scaling; rope_local_theta too where the family's
  sliding layers have their own base."""
  theta, scaling = rope_settings(
      hf, "full_attention" if family.global_every is not None else None)
  fields = dict(rope_theta=theta, rope_scaling=scaling)
  if family.local_rope:
    local_theta, local_scaling = rope_settings(
        dict(hf, rope_theta=hf.get("rope_local_base_freq", 10_000.0),
             rope_scaling=None), "sliding_attention")
    if local_scaling is not None:
      raise ValueError(f"rope scaling on {family.model_type}'s sliding layers "
                       "is not supported.")
    fields.update(rope_local_theta=local_theta)
  return fields


def alternating_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
  """Every `every`-th layer "full", the others "sliding" (Gemma's pattern)."""
  return tuple("full" if (i + 1) % every == 0 else "sliding"
               for i in range(num_layers))


def config_from_hf(hf: dict, dtype: str = "float32") -> TransformerConfig:
  """The TransformerConfig of an HF config.json dict; unsupported features
  raise ValueError rather than load into a model that computes something
  else."""
  model_type = hf.get("model_type")
  if model_type not in _BY_MODEL_TYPE:
    raise ValueError(f"model_type {model_type!r} is not supported; spec_jax "
                     f"reads {', '.join(_BY_MODEL_TYPE)}.")
  family = _BY_MODEL_TYPE[model_type]
  _check_supported(hf, family)
  fields = dict(family.switches, dtype=dtype, **_read_keys(hf, family))
  if family.global_every is not None:
    types = hf.get("layer_types")
    fields.update(layer_types=tuple(_LAYER_TYPES[t] for t in types) if types
                  else alternating_layer_types(
                      fields["num_layers"],
                      hf.get("sliding_window_pattern", family.global_every)))
  if fields["position"] == "rope":
    fields.update(_rope_fields(hf, family))
  return TransformerConfig(**fields)


def _rope_parameters(config: TransformerConfig) -> dict:
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


def _rope_to_hf(config: TransformerConfig, local: bool) -> dict:
  """The config.json rope keys, in both styles, so that older and newer
  transformers read them alike; per layer type if `local` (the sliding
  layers' own base, Gemma 3's)."""
  rope = _rope_parameters(config)
  if not local:
    return {"rope_theta": config.rope_theta, "rope_parameters": rope,
            "rope_scaling": rope if config.rope_scaling is not None else None}
  sliding = {"rope_type": "default",
             "rope_theta": config.rope_local_theta or config.rope_theta}
  return {"rope_local_base_freq": sliding["rope_theta"],
          "rope_theta": config.rope_theta,
          "rope_parameters": {"full_attention": rope,
                              "sliding_attention": sliding},
          "rope_scaling": None}


def _value_to_hf(config: TransformerConfig, field: str):
  value = getattr(config, field)
  if field == "query_pre_attn_scalar":
    # None means head_dim. An int where it is one: transformers' config
    # type-checks it.
    return _int_if_whole(value or config.head_dim)
  return value


def config_to_hf(config: TransformerConfig) -> dict:
  """The HF config.json dict of a config that `family_of` accepts."""
  family = family_of(config)
  hf = {"architectures": [family.architecture],
        "model_type": family.model_type}
  hf.update({key: _value_to_hf(config, field)
             for field, (key, _) in family.keys.items()})
  hf[family.activation] = _ACTIVATIONS[config.mlp][0]
  if family.global_every is not None:
    names = {ours: theirs for theirs, ours in _LAYER_TYPES.items()}
    hf["layer_types"] = [names[t] for t in config.layer_types]
  if config.position == "rope":
    hf.update(_rope_to_hf(config, family.local_rope))
  hf["dtype"] = config.dtype
  return hf


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else x


def _tensor_names(config: TransformerConfig) -> dict[tuple, list[str]]:
  """spec_jax parameter path -> the HF tensors stacked along the output axis
  (in this order) to form it."""
  layout = family_of(config).layout
  names = {}
  for keys, _ in jax.tree_util.tree_leaves_with_path(abstract_params(config)):
    path = tuple(key.key for key in keys)
    suffix = "bias" if path[-1] == "bias" else "weight"
    if path[0].startswith("block_"):
      prefix = layout.block.format(i=path[0].removeprefix("block_"))
      names[path] = [f"{prefix}{module}.{suffix}"
                     for module in layout.blocks[path[1]]]
    else:
      names[path] = [f"{layout.top[path[0]]}.{suffix}"]
  return names


def _is_conv1d(layout: families.Layout, path: tuple) -> bool:
  """Whether the checkpoint stores this parameter [in, out] (GPT-2's Conv1D
  kernels)."""
  return layout.conv1d and path[-1] == "kernel"


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_hf(tensors: dict, config: TransformerConfig) -> dict:
  """spec_jax params from HF tensors {name: array}; checks names and shapes."""
  layout = family_of(config).layout
  tensors = {name.removeprefix(layout.strip): x
             for name, x in tensors.items()}
  if config.tie_embeddings:  # Some checkpoints store the tied copy too.
    tensors.pop(f"{layout.top['lm_head']}.weight", None)
  tensors = {n: x for n, x in tensors.items() if not n.endswith(layout.buffers)}
  names = _tensor_names(config)
  wanted = {n for parts in names.values() for n in parts}
  missing, unexpected = wanted - tensors.keys(), tensors.keys() - wanted
  if missing or unexpected:
    raise ValueError(
        f"the checkpoint's tensors do not match its config.json: missing "
        f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}.")
  expected = abstract_params(config)
  params = {}
  for path, parts in names.items():
    arrays = [tensors[n].T if _is_conv1d(layout, path) else tensors[n]
              for n in parts]
    value = jnp.concatenate([jnp.asarray(a, config.dtype) for a in arrays])
    shape = expected
    for key in path:
      shape = shape[key]
    if value.shape != shape.shape:
      raise ValueError(f"{parts} give shape {value.shape} for {path}, but "
                       f"config.json implies {shape.shape}.")
    _set(params, path, value)
  return params


def params_to_hf(params: dict, config: TransformerConfig) -> dict:
  """HF tensors {name: array} of spec_jax params."""
  layout = family_of(config).layout
  tensors = {}
  for path, parts in _tensor_names(config).items():
    value = params
    for key in path:
      value = value[key]
    if path[-2:-1] == ("qkv",) and len(parts) == 3:  # q, k and v rows.
      rows = config.head_dim * np.array(
          [config.num_heads, config.num_kv_heads, config.num_kv_heads])
      pieces = jnp.split(value, np.cumsum(rows)[:-1])
    else:
      pieces = jnp.split(value, len(parts))
    for name, piece in zip(parts, pieces):
      tensors[name] = piece.T if _is_conv1d(layout, path) else piece
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
  """Reads a Hugging Face model of one of the families in families.py.

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

  The config is written as the architecture of the family that holds it
  (`family_of`: GPT2LMHeadModel for the built-in pair, LlamaForCausalLM...).
  The folder is written under a temporary name and renamed when complete.

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
