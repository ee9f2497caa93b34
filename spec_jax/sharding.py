"""Draft and target params and KV caches sharded over a (data, model) mesh.

Megatron-style: the batch is split over `data`; attention heads, the MLP
hidden units and the vocabulary are split over `model`, column-parallel into a
block (qkv, mlp_in) and row-parallel out of it (attn_out, mlp_out), so each
block costs one all-reduce per half and no parameter ever moves.

Each parameter is described once, in PARAM_RULES, by the logical axes of its
dimensions; LOGICAL_TO_MESH maps logical axes to mesh axes. Changing how a
parameter is split is a one-line edit of either table.

Two exact rewrites make any head count fit the model axis (`plan_config`):
  * heads are zero-padded up to a multiple of the model axis. A head whose
    q, k, v rows are zero attends to zero values, and its attn_out columns are
    zero too, so it adds exactly nothing;
  * the fused qkv rows are reordered from [q of every head, k, v] to
    (kv_heads, group + 2, head_dim), each key/value head with its group of
    queries (group = 1 without GQA), so that a contiguous split of the rows is
    a split by head rather than across the q / k / v boundaries.

The same code runs on one process or many (`jax.distributed`): the mesh spans
every process's devices, and arrays are global.
"""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spec_jax.kv_cache import KVCache
from spec_jax.model import Model, TransformerConfig, abstract_params

_log = logging.getLogger(__name__)

DATA, MODEL = "data", "model"

# Logical axis -> mesh axis; a logical axis not listed is replicated.
LOGICAL_TO_MESH = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
}

# Parameter path pattern (re.search on e.g. "block_0/qkv/kernel") -> logical
# axes of its dimensions. The first match wins; a parameter that matches none
# (layer norms, biases of row-parallel layers, the position table) is
# replicated. Kernels are stored [out, in].
PARAM_RULES = (
    (r"embed/embedding$", ("vocab", None)),  # [V, D]
    (r"lm_head/kernel$", ("vocab", None)),  # [V, D], untied models
    # [K * (G + 2) * Dh, D], rows head-major (see the module docstring).
    (r"qkv/kernel$", ("kv_heads", None)),
    (r"qkv/bias$", ("kv_heads",)),
    (r"attn_out/kernel$", (None, "heads")),  # [D, H * Dh]
    # [F, D], or [2F, D] for SwiGLU (gate, then up): a split of the fused rows
    # is then not aligned with the gate/up pairs, which GSPMD keeps exact by
    # moving activations, not parameters.
    (r"mlp_in/kernel$", ("mlp", None)),
    (r"mlp_in/bias$", ("mlp",)),
    (r"mlp_out/kernel$", (None, "mlp")),  # [D, F]
)

# KVCache keys and values [B, K, S, Dh], and lengths [B].
CACHE_AXES = ("batch", "kv_heads", None, None)
LENGTHS_AXES = ("batch",)


class MeshError(ValueError):
  """A mesh that does not fit the devices, the model or the batch."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Mesh shape; -1 in one axis means all the devices the other leaves."""

  data: int = -1
  model: int = 1


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
  """A (data, model) mesh over `devices` (default: every process's devices).

  Raises MeshError, before anything compiles, when the shape does not
  match the device count.
  """
  devices = jax.devices() if devices is None else list(devices)
  count = len(devices)
  data, model = config.data, config.model
  if (data, model).count(-1) > 1 or any(
      size < 1 and size != -1 for size in (data, model)):
    raise MeshError(
        f"mesh data={data}, model={model}: each must be a positive size, and "
        "at most one may be -1 (fill).")
  if data == -1 and count % model == 0:
    data = count // model
  if model == -1 and count % data == 0:
    model = count // data
  if data * model != count:
    raise MeshError(
        f"mesh data={config.data} x model={config.model} does not match the "
        f"{count} devices; set --config.mesh.data and --config.mesh.model so "
        f"their product is {count} (-1 fills one of them).")
  # Auto axes: shardings propagate through the model as GSPMD decides.
  return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL),
              axis_types=(jax.sharding.AxisType.Auto,) * 2)


def spec(logical_axes, replicate: bool = False) -> PartitionSpec:
  """PartitionSpec of an array whose dimensions have these logical axes."""
  if replicate:
    logical_axes = [a if a == "batch" else None for a in logical_axes]
  return PartitionSpec(*(LOGICAL_TO_MESH.get(a) for a in logical_axes))


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def param_axes(params):
  """The logical axes of every parameter, by PARAM_RULES."""
  def axes(path, leaf):
    name = _path_name(path)
    for pattern, logical in PARAM_RULES:
      if re.search(pattern, name):
        if len(logical) != leaf.ndim:
          raise ValueError(f"rule {pattern!r} gives {len(logical)} axes for "
                           f"{name} of shape {leaf.shape}.")
        return logical
    return (None,) * leaf.ndim
  return jax.tree_util.tree_map_with_path(axes, params)


def param_shardings(params, mesh: Mesh, replicate: bool = False):
  """NamedShardings of a parameter tree (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(
      lambda axes: NamedSharding(mesh, spec(axes, replicate)),
      param_axes(params), is_leaf=lambda x: isinstance(x, tuple))


def cache_sharding(config: TransformerConfig, mesh: Mesh,
                   replicate: bool = False) -> KVCache:
  """A KVCache of shardings: by batch, and by head unless replicated."""
  kv = NamedSharding(mesh, spec(CACHE_AXES, replicate))
  layers = (kv,) * config.num_layers
  return KVCache(keys=layers, values=layers,
                 lengths=NamedSharding(mesh, spec(LENGTHS_AXES)))


def check_model_axis(config: TransformerConfig, mesh: Mesh,
                     replicate: bool = False, name: str = "model") -> None:
  """Raises MeshError for MLP and vocabulary sizes the model axis does not
  divide."""
  shards = mesh.shape[MODEL]
  if replicate or shards == 1:
    return
  for field in ("d_ff", "vocab_size"):
    size = getattr(config, field)
    if size % shards:
      raise MeshError(
          f"the {name}'s {field}={size} is not divisible by the mesh model "
          f"axis ({shards}); choose --config.mesh.model among the divisors "
          f"of {size}" + (", or replicate the draft with "
                          "--config.mesh.replicate_draft=True"
                          if name == "draft" else "") + ".")


def plan_config(config: TransformerConfig, mesh: Mesh, replicate: bool = False,
                name: str = "model") -> TransformerConfig:
  """The config of `config`'s model laid out for this mesh's model axis.

  Pads heads (exact, see the module docstring) and orders qkv rows by head;
  refuses MLP and vocabulary sizes the model axis does not divide (raises
  MeshError) before anything compiles.
  """
  shards = mesh.shape[MODEL]
  if replicate or shards == 1:
    return config
  check_model_axis(config, mesh, replicate, name)
  # Key/value heads are what the cache and the qkv rows are split by; each
  # brings its group of query heads along.
  group = config.num_heads // config.num_kv_heads
  num_kv_heads = -(-config.num_kv_heads // shards) * shards
  if num_kv_heads != config.num_kv_heads:
    _log.warning("%s: %d key/value heads padded with zero heads to %d, a "
                 "multiple of the mesh model axis (%d); the outputs are "
                 "unchanged.", name, config.num_kv_heads, num_kv_heads,
                 shards)
  return dataclasses.replace(config, num_heads=num_kv_heads * group,
                             num_kv_heads=num_kv_heads,
                             head_dim=config.head_dim, qkv_head_major=True)


def to_layout(params, config: TransformerConfig, planned: TransformerConfig):
  """Pads heads and reorders qkv rows from `config`'s layout to `planned`'s."""
  if planned == config:
    return params
  if config.qkv_head_major:
    raise ValueError("these parameters are already laid out for a mesh; "
                     "load them without one.")
  heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
  group = heads // kv_heads

  def qkv(x):  # [(H + 2K) * Dh, ...] -> [K' * (G + 2) * Dh, ...]
    rest = x.shape[1:]
    q, k, v = jnp.split(x, [heads * dim, (heads + kv_heads) * dim])
    x = jnp.concatenate([q.reshape(kv_heads, group, dim, *rest),
                         k.reshape(kv_heads, 1, dim, *rest),
                         v.reshape(kv_heads, 1, dim, *rest)], axis=1)
    x = jnp.pad(x, [(0, planned.num_kv_heads - kv_heads)]
                + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, *rest)

  def attn_out(x):  # [D, H * Dh] -> [D, H' * Dh]; new heads come last
    return jnp.pad(x, [(0, 0), (0, (planned.num_heads - heads) * dim)])

  params = dict(params)
  for i in range(config.num_layers):
    block = dict(params[f"block_{i}"])
    block["qkv"] = jax.tree.map(qkv, block["qkv"])
    block["attn_out"] = dict(block["attn_out"],
                             kernel=attn_out(block["attn_out"]["kernel"]))
    params[f"block_{i}"] = block
  return params


def _sharded(config, planned, mesh, replicate, make_params, *args):
  """Runs make_params(*args) -> params in `config`'s layout under one jit
  whose outputs are `planned`'s layout in its shardings."""
  shardings = param_shardings(abstract_params(planned), mesh, replicate)
  params = jax.jit(lambda *a: to_layout(make_params(*a), config, planned),
                   out_shardings=shardings)(*args)
  return Model(planned, params,
               cache_sharding=cache_sharding(planned, mesh, replicate))


def init_model(config: TransformerConfig, key: jax.Array, mesh: Mesh,
               replicate: bool = False) -> Model:
  """Random parameters created directly in their shardings."""
  planned = plan_config(config, mesh, replicate)
  return _sharded(config, planned, mesh, replicate,
                  lambda k: Model.init(config, k).params, key)


def _stored_shardings(config: TransformerConfig, mesh: Mesh, replicate: bool):
  """Shardings of params in `config`'s own (unpadded) layout: the planned
  rules, with a dimension the mesh does not divide replicated."""
  stored = abstract_params(config)

  def read_sharding(leaf, sharding):
    axes = [a if a is not None and size % mesh.shape[a] == 0 else None
            for a, size in zip(sharding.spec + (None,) * leaf.ndim, leaf.shape)]
    return NamedSharding(mesh, PartitionSpec(*axes))

  return stored, jax.tree.map(read_sharding, stored,
                              param_shardings(stored, mesh, replicate))


def restore_targets(config: TransformerConfig, mesh: Mesh,
                    replicate: bool = False, name: str = "model"):
  """Abstract params (ShapeDtypeStructs with shardings) for a checkpoint
  reader to restore `config`'s stored params into, each device reading only
  its shards. `place` then lays them out for the mesh.

  Raises MeshError, before anything is read, for a mesh the model cannot use.
  """
  check_model_axis(config, mesh, replicate, name)
  stored, shardings = _stored_shardings(config, mesh, replicate)
  return jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                  sharding=sharding),
      stored, shardings)


def place(config: TransformerConfig, params, mesh: Mesh,
          replicate: bool = False, name: str = "model") -> Model:
  """A model from params in `config`'s layout already on the mesh (read
  into `restore_targets`' shardings): one jit pads heads and reorders qkv
  rows into the planned layout's shardings."""
  planned = plan_config(config, mesh, replicate, name)
  return _sharded(config, planned, mesh, replicate, lambda p: p, params)


def shard_model(model: Model, mesh: Mesh, replicate: bool = False,
                name: str = "model") -> Model:
  """A model whose params are in host memory (e.g. read from safetensors)
  moved into its shardings: each device receives only its shards."""
  _, shardings = _stored_shardings(model.config, mesh, replicate)
  return place(model.config, jax.device_put(model.params, shardings), mesh,
               replicate, name)


def check_batch(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.shape[DATA]:
    raise MeshError(
        f"batch size {batch_size} is not divisible by the mesh data axis "
        f"({mesh.shape[DATA]}); make --config.batch_size a multiple of it or "
        "lower --config.mesh.data.")


def put_batch(array, mesh: Mesh) -> jax.Array:
  """A global array split by rows over `data`, from host data that every
  process holds in full."""
  array = np.asarray(array)
  sharding = NamedSharding(mesh, spec(("batch",) + (None,) * (array.ndim - 1)))
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def put_key(key: jax.Array, mesh: Mesh) -> jax.Array:
  """A PRNG key replicated on every device of the mesh, in every process."""
  data = np.asarray(jax.random.key_data(key))
  data = jax.make_array_from_callback(
      data.shape, NamedSharding(mesh, PartitionSpec()), lambda index: data[index])
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def to_host(tree):
  """numpy copies of global arrays, gathered from every process if needed."""
  if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def param_bytes(params) -> tuple[int, int]:
  """(total bytes, the most any one device holds) of a parameter tree.

  The per-device count reads this process's shards; with many processes it
  is the largest among this process's devices.
  """
  total, per_device = 0, {}
  for leaf in jax.tree.leaves(params):
    total += leaf.size * leaf.dtype.itemsize
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + (
          shard.data.size * shard.data.dtype.itemsize)
  return total, max(per_device.values())
