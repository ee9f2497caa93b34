"""Model directories: config, tokenizer and orbax parameters, saved atomically.

A model directory holds:
  config.json      the TransformerConfig fields;
  tokenizer.json   the `tokenizers` tokenizer shared by draft and target;
  params/          an orbax checkpoint of the parameters.
It is written under a temporary name and renamed when complete, so a crash
leaves either the old directory or the new one, never half of one.

Orbax is imported on first use: it pulls in absl and more, which
`import spec_jax` should not.
"""

import dataclasses
import json
import pathlib

import jax
import tokenizers

from spec_jax import sharding
from spec_jax.io import files
from spec_jax.model import Model, TransformerConfig, abstract_params


def save_model(path, model: Model, tokenizer: tokenizers.Tokenizer,
               storage_dtype: str | None = None) -> None:
  """Writes a model directory at path, replacing any old one atomically.

  storage_dtype: e.g. "bfloat16" to halve the files; loading casts each
    parameter back to the dtype the config gives it (`weight_dtype` for
    matmul weights, `dtype` for the rest).
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  params = model.params
  if storage_dtype:
    params = jax.tree.map(lambda x: x.astype(storage_dtype), params)
  with files.atomic_directory(path) as staging:
    (staging / "config.json").write_text(
        json.dumps(dataclasses.asdict(model.config), indent=2))
    tokenizer.save(str(staging / "tokenizer.json"))
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(staging / "params", params)


def load_tokenizer(path) -> tokenizers.Tokenizer:
  path = pathlib.Path(path)
  if not (path / "tokenizer.json").exists():
    raise FileNotFoundError(f"no tokenizer.json in {path}.")
  return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def _restore_params(path: pathlib.Path, config: TransformerConfig, mesh,
                    replicate: bool, name: str):
  """The stored params, cast to the config's dtypes as they are read: on the
  default device, or straight into their shardings on a mesh (each device
  reads only its shards)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  expected = abstract_params(config)
  if mesh is not None:
    targets = sharding.restore_targets(config, mesh, replicate, name)
  else:
    # Named explicitly: orbax would otherwise restore onto the devices that
    # wrote the checkpoint, which a CPU-written model lacks on a GPU or TPU.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        expected)
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(path / "params", targets)
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if shapes(params) != shapes(expected):
    raise ValueError("the stored parameters do not match config.json")
  return params


def load_model(path, mesh: jax.sharding.Mesh | None = None,
               replicate: bool = False,
               name: str = "model") -> tuple[Model, tokenizers.Tokenizer]:
  """Reads a model directory written by `save_model`.

  With a mesh, the params are read straight into their shardings (see
  sharding.py), replicated over the mesh if `replicate`; `name` says which
  model an error is about.

  Raises:
    FileNotFoundError: the directory or one of its parts is missing.
    ValueError: a part is corrupt or does not match the config.
    sharding.MeshError: the mesh does not fit the model.
  """
  path = pathlib.Path(path).absolute()
  if not (path / "config.json").exists() or not (path / "params").exists():
    raise FileNotFoundError(
        f"no model at {path}: expected config.json and params/ there. Train "
        "one with `python -m experiments.train` or point the config at an "
        "existing model directory.")
  try:
    config = TransformerConfig(**json.loads((path / "config.json").read_text()))
    tokenizer = load_tokenizer(path)
    params = _restore_params(path, config, mesh, replicate, name)
  except (FileNotFoundError, sharding.MeshError):
    raise
  except Exception as error:  # orbax, json and tokenizers raise many types.
    raise ValueError(
        f"the model at {path} is corrupt or incomplete ({type(error).__name__}:"
        f" {error}). Re-export or re-train it.") from error
  if mesh is not None:
    return sharding.place(config, params, mesh, replicate, name), tokenizer
  return Model(config, params), tokenizer
