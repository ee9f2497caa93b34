"""A decoder-only transformer whose KV cache is an explicit pytree.

The cache is passed in and returned, never kept in a mutable collection, so one
call can write any number of tokens at each row's own positions:

  * prefill writes a whole right-padded prompt batch at positions 0..P-1;
  * `verify` writes gamma+1 tokens per row in one pass;
  * rollback after a rejection only moves `KVCache.lengths`.

Why stale slots never leak: a query at position t attends to key slots j <= t
only, and every call writes a contiguous run of positions starting at the
row's pointer before it attends. So every visible slot was written by this call
or an earlier one for the token that really sits at that position. Example for
one row, after prefill of "a b c" padded to 5 and a rejected draft "x y":

  slot      0 1 2 3 4
  written   a b c _ _     prefill (slots 3, 4 hold padding junk); pointer = 2
  written   a b c x y     verify writes [c, x, y] at slots 2..4
  rollback  pointer = 3   the correction z goes to slot 3 next call; slot 4
                          holds junk that no query at position <= 3 can see.

Layers are separate parameter and cache arrays, unrolled in Python: on CPU this
was measurably faster than `lax.scan` over stacked layers (see README).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

# Masked attention scores. Finite rather than -inf so that a query that sees no
# key at all (never used, but possible in padding rows) gives no NaN.
_MASKED = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Static sizes of a GPT-2-like decoder."""

  vocab_size: int
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  d_ff: int = 1024
  max_len: int = 1024  # Number of learned positions.
  dtype: str = "float32"  # Parameter and activation dtype.
  # By default d_model // num_heads. Set when heads are padded for sharding
  # (see sharding.py), which makes num_heads * head_dim > d_model.
  head_dim: int | None = None
  # Row order of the fused qkv kernel: (3, heads, head_dim) as trained, or
  # (heads, 3, head_dim) so that a contiguous split of its rows over a mesh
  # axis splits by head (sharding.py permutes the rows and sets this).
  qkv_head_major: bool = False

  def __post_init__(self):
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(f"d_model={self.d_model} is not divisible by "
                         f"num_heads={self.num_heads}.")
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values, with a length pointer per row.

  keys[i], values[i]: [B, H, S, D_head] for layer i.
  lengths: [B] int32, number of valid slots in each row. Slots at and beyond it
    hold stale values that the attention mask hides.
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.keys[0].shape[2]

  def rollback(self, lengths: jax.Array) -> "KVCache":
    """Keeps the first `lengths[b]` slots of each row; nothing is copied."""
    return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(
    config: TransformerConfig, batch_size: int, max_len: int
) -> KVCache:
  shape = (batch_size, config.num_heads, max_len, config.head_dim)
  zeros = lambda: tuple(
      jnp.zeros(shape, config.dtype) for _ in range(config.num_layers)
  )
  return KVCache(
      keys=zeros(), values=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32)
  )


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """cache [B, H, S, D] <- new [B, H, T, D] at positions [B, T].

  Written per (row, head) under vmap: the scatter then has batch and head as
  batching dimensions, so on a mesh each device writes its own rows and heads
  with no communication.
  """
  write = lambda c, n, p: c.at[p].set(n, mode="drop")  # [S, D] <- [T, D] at [T]
  return jax.vmap(jax.vmap(write, (0, 0, None)))(cache, new, positions)


class Linear(nn.Module):
  """y = x W^T + b with the kernel stored [out, in], as torch.nn.Linear does.

  The same layout as PyTorch and Hugging Face checkpoints, and on CPU a
  one-token step measured faster with it than with flax's [in, out].
  """

  features: int
  dtype: str

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (self.features, x.shape[-1]), self.dtype)
    bias = self.param("bias", nn.initializers.zeros, (self.features,),
                      self.dtype)
    return jnp.einsum("...d,fd->...f", x, kernel) + bias


class Block(nn.Module):
  """Pre-LayerNorm attention + GELU MLP, as in GPT-2."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, positions, keys, values):
    """x [B, T, D]; positions [B, T]; keys, values [B, H, S, Dh]."""
    cfg = self.config
    batch, length, _ = x.shape
    layer_norm = lambda name: nn.LayerNorm(dtype=cfg.dtype,
                                           param_dtype=cfg.dtype, name=name)
    h = layer_norm("ln_attn")(x)
    qkv = Linear(3 * cfg.num_heads * cfg.head_dim, cfg.dtype, name="qkv")(h)
    if cfg.qkv_head_major:
      qkv = jnp.swapaxes(
          qkv.reshape(batch, length, cfg.num_heads, 3, cfg.head_dim), 2, 3)
    else:
      qkv = qkv.reshape(batch, length, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = (jnp.swapaxes(qkv[:, :, i], 1, 2) for i in range(3))  # [B,H,T,Dh]
    keys = _write(keys, k, positions)
    values = _write(values, v, positions)

    scores = jnp.einsum("bhtd,bhsd->bhts", q, keys) / math.sqrt(cfg.head_dim)
    slots = jnp.arange(keys.shape[2])
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None], scores.astype(jnp.float32), _MASKED)
    weights = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
    attended = jnp.einsum("bhts,bhsd->bthd", weights, values)
    attended = attended.reshape(batch, length, cfg.num_heads * cfg.head_dim)
    x = x + Linear(cfg.d_model, cfg.dtype, name="attn_out")(attended)

    h = layer_norm("ln_mlp")(x)
    h = nn.gelu(Linear(cfg.d_ff, cfg.dtype, name="mlp_in")(h))
    x = x + Linear(cfg.d_model, cfg.dtype, name="mlp_out")(h)
    return x, keys, values


class Transformer(nn.Module):
  """GPT-2-like decoder: learned positions, tied input/output embeddings."""

  config: TransformerConfig

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      cache: KVCache,
      positions: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Runs tokens [B, T] and writes their keys and values into the cache.

    Args:
      tokens: [B, T] int32.
      cache: the cache to extend.
      positions: [B, T] int32 position of each token; by default the row's
        pointer onwards, `cache.lengths[:, None] + arange(T)`.

    Returns:
      float32 logits [B, T, V], and the cache with `lengths` set to one past
      each row's last written position.
    """
    cfg = self.config
    if positions is None:
      positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    positions = positions.astype(jnp.int32)
    embed = nn.Embed(
        cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype,
        embedding_init=nn.initializers.normal(0.02), name="embed",
    )
    position_table = self.param(
        "positions", nn.initializers.normal(0.01), (cfg.max_len, cfg.d_model),
        cfg.dtype,
    )
    # Positions past max_len only occur in the scratch tail of rows whose
    # output is already complete, so clipping them changes no emitted token.
    x = embed(tokens) + position_table[jnp.clip(positions, 0, cfg.max_len - 1)]

    keys, values = [], []
    for i in range(cfg.num_layers):
      x, k, v = Block(cfg, name=f"block_{i}")(
          x, positions, cache.keys[i], cache.values[i]
      )
      keys.append(k)
      values.append(v)
    x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_final")(x)
    logits = embed.attend(x).astype(jnp.float32)
    cache = KVCache(
        keys=tuple(keys), values=tuple(values), lengths=positions[:, -1] + 1
    )
    return logits, cache


@flax.struct.dataclass
class Model:
  """A transformer's static config and its parameters, as one pytree.

  The config is static metadata, so a `Model` can be passed straight through
  `jax.jit`: a new config compiles anew, new parameters do not.
  """

  config: TransformerConfig = flax.struct.field(pytree_node=False)
  params: dict
  # A KVCache whose leaves are the shardings its arrays must keep, set by
  # sharding.py when the model lives on a mesh; None on one device.
  cache_sharding: KVCache | None = flax.struct.field(pytree_node=False,
                                                     default=None)

  @classmethod
  @functools.partial(jax.jit, static_argnums=(0, 1))
  def init(cls, config: TransformerConfig, key: jax.Array) -> "Model":
    """Random initial parameters."""
    cache = init_cache(config, batch_size=1, max_len=1)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return cls(config, Transformer(config).init(key, tokens, cache)["params"])

  # Jitted so that calls from eager code compile once; inside an outer jit
  # (the decode loops) this is inlined.
  @jax.jit
  def __call__(
      self, tokens: jax.Array, cache: KVCache, positions: jax.Array | None = None
  ) -> tuple[jax.Array, KVCache]:
    """`Transformer.__call__` with these parameters."""
    logits, cache = Transformer(self.config).apply(
        {"params": self.params}, tokens, cache, positions
    )
    return logits, self._constrain(cache)

  def _constrain(self, cache: KVCache) -> KVCache:
    """Pins the cache to its shardings, so the decode loop never moves it."""
    if self.cache_sharding is None:
      return cache
    return jax.lax.with_sharding_constraint(cache, self.cache_sharding)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    return self._constrain(init_cache(self.config, batch_size, max_len))

  @functools.partial(jax.jit, static_argnames="max_len")
  def prefill(
      self, prompts: jax.Array, prompt_lengths: jax.Array, max_len: int
  ) -> KVCache:
    """Caches right-padded prompts [B, P] of lengths [B] in one pass.

    The pointer is left at `prompt_lengths - 1`: the cache holds every prompt
    token but the last, which the first decode step feeds (and rewrites).
    """
    cache = self.init_cache(prompts.shape[0], max_len)
    _, cache = self(prompts, cache)
    return cache.rollback(prompt_lengths - 1)


@jax.jit
def score(model: Model, tokens: jax.Array) -> jax.Array:
  """float32 logits [B, T, V] for full sequences tokens [B, T], no cache kept."""
  logits, _ = model(tokens, model.init_cache(tokens.shape[0], tokens.shape[1]))
  return logits
