"""A decoder-only transformer whose KV cache is an explicit pytree.

The cache (`kv_cache.KVCache`) is passed in and returned, so one call writes
any number of tokens at each row's own positions; kv_cache.py says why stale
slots never leak.

Layers are separate parameter and cache arrays, unrolled in Python: on CPU this
was measurably faster than `lax.scan` over stacked layers.

One block covers the families of published checkpoints, chosen by config
switches whose defaults are GPT-2's (and the built-in pair's):

  GPT-2    LayerNorm, learned positions, GELU MLP, biases, tied embeddings;
  Llama    RMSNorm, rotary positions (with Llama-3 scaling), SwiGLU MLP,
           grouped-query attention, no biases, tied or untied embeddings;
  Qwen2    Llama with biases on the query, key and value projections;
  Qwen3    Llama with RMSNorm on each query and key head;
  Mistral  Llama with sliding-window attention;
  Gemma 2  (1 + w) RMSNorm, also after attention and after the MLP, GeGLU,
           embeddings scaled by sqrt(d_model), query_pre_attn_scalar,
           sliding and global layers alternating, logit soft-capping;
  Gemma 3  Gemma 2 with query/key norms instead of soft-capping, and local
           layers with their own rotary base.

Sliding-window layers keep the full-length cache and mask by distance: a query
at position t sees keys at positions t - window + 1 .. t. The mask is made once
per call, next to the causal one, and each block takes the one of its type.

Matmul weights (the Linear kernels, the embedding table and the output layer)
can be stored in another dtype than the activations: `weight_dtype` (see
`matmul` for the trade, and `Model.with_weight_dtype` to convert a loaded
model).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import attention, cpu_matmul
from spec_jax.kv_cache import KVCache, PendingWrite, init_cache, write

@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Rotary frequency scaling: Llama-3's (HF rope_type "llama3") or linear.

  llama3: wavelengths longer than original_max_len / low_freq_factor are
    stretched by `factor`, those shorter than original_max_len /
    high_freq_factor are kept, and the ones between are interpolated.
  linear: every frequency is divided by `factor` (Gemma 3's global layers).
  """

  factor: float
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  original_max_len: int | None = None
  kind: str = "llama3"

  def __post_init__(self):
    if self.kind not in ("llama3", "linear"):
      raise ValueError(f"RopeScaling kind={self.kind!r}; expected 'llama3' or "
                       "'linear'.")
    llama3 = (self.low_freq_factor, self.high_freq_factor,
              self.original_max_len)
    if self.kind == "llama3" and None in llama3:
      raise ValueError("llama3 rope scaling needs low_freq_factor, "
                       "high_freq_factor and original_max_len.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Static sizes and architecture switches of a decoder.

  The defaults of the switches give the GPT-2-like model of the built-in pair.
  """

  vocab_size: int
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  d_ff: int = 1024
  max_len: int = 1024  # Positions the model supports (learned table rows).
  dtype: str = "float32"  # Activation dtype, and parameter dtype by default.
  # Dtype the matmul weights are stored in (Linear kernels, the embedding
  # table and the output layer), e.g. "bfloat16" under float32 activations to
  # halve the bytes a step reads; None: dtype. Norms, biases, the position
  # table and the KV cache keep dtype. See `matmul`.
  weight_dtype: str | None = None
  # "layer" (LayerNorm), "rms" (RMSNorm), or "gemma_rms" (RMSNorm scaling by
  # 1 + w, computed in float32, as Gemma's).
  norm: str = "layer"
  norm_eps: float = 1e-6
  position: str = "learned"  # "learned" table or "rope" (rotary).
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  # "gelu" (tanh approximation), "swiglu" (SiLU-gated) or "geglu" (tanh
  # GELU-gated, Gemma's).
  mlp: str = "gelu"
  num_kv_heads: int | None = None  # Key/value heads (GQA); None: num_heads.
  qkv_bias: bool = True  # Biases on the query, key and value projections.
  bias: bool = True  # Biases on the attention output and MLP projections.
  tie_embeddings: bool = True  # Output projection = input embedding.
  # By default d_model // num_heads. Set when heads are padded for sharding
  # (see sharding.py), which makes num_heads * head_dim > d_model.
  head_dim: int | None = None
  # Row order of the fused qkv kernel: q of every head, then k, then v, as
  # trained; or head-major, (kv_heads, group + 2, head_dim): each key/value
  # head's group of queries, its key and its value together, so that a
  # contiguous split of the rows over a mesh axis splits by head (sharding.py
  # permutes the rows and sets this).
  qkv_head_major: bool = False
  # RMSNorm over each query and key head (Qwen3, Gemma 3).
  qk_norm: bool = False
  # Norms after the attention and after the MLP too, before each residual add
  # (Gemma 2 and 3: four norms per block).
  post_norms: bool = False
  embed_scale: bool = False  # Embeddings times sqrt(d_model) (Gemma).
  # Scores are q.k / sqrt(query_pre_attn_scalar); None: head_dim.
  query_pre_attn_scalar: float | None = None
  # Keys a sliding layer sees: positions > query position - sliding_window.
  sliding_window: int | None = None
  # "full" or "sliding" for each layer; None: every layer slides if
  # sliding_window is set (Mistral), else none does.
  layer_types: tuple[str, ...] | None = None
  # Rotary base of sliding layers; None: rope_theta.
  rope_local_theta: float | None = None
  attn_softcap: float | None = None  # Scores -> cap * tanh(scores / cap).
  final_softcap: float | None = None  # Logits -> cap * tanh(logits / cap).

  def __post_init__(self):
    # Normalised here so that equal models have equal (hashable) configs and
    # `TransformerConfig(**json.load(...))` restores a saved one.
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    if self.weight_dtype is not None:
      weight_dtype = jnp.dtype(self.weight_dtype)
      if not jnp.issubdtype(weight_dtype, jnp.floating):
        raise ValueError(f"weight_dtype={self.weight_dtype!r}; expected a "
                         "floating dtype such as 'bfloat16'.")
      # A name, so the config stays JSON; None when it is dtype, so that
      # equal models have equal configs.
      object.__setattr__(self, "weight_dtype", None if weight_dtype
                         == jnp.dtype(self.dtype) else weight_dtype.name)
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                         f"{self.num_layers} layers.")
      if set(self.layer_types) - {"full", "sliding"}:
        raise ValueError(f"layer_types={self.layer_types}; each must be "
                         "'full' or 'sliding'.")
      if "sliding" in self.layer_types and self.sliding_window is None:
        raise ValueError("layer_types has sliding layers but sliding_window "
                         "is None.")
    choices = {"norm": ("layer", "rms", "gemma_rms"),
               "position": ("learned", "rope"),
               "mlp": ("gelu", "swiglu", "geglu")}
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r}; expected one of "
                         f"{allowed}.")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(f"d_model={self.d_model} is not divisible by "
                         f"num_heads={self.num_heads}.")
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
          f"{self.num_kv_heads}; each key/value head serves a whole group.")
    if self.position == "rope" and self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head_dim, got "
                       f"{self.head_dim}.")
    if self.rope_scaling is not None and self.position != "rope":
      raise ValueError("rope_scaling is set but position is not 'rope'.")
    if self.qk_norm and self.norm == "layer":
      raise ValueError("qk_norm needs norm='rms' or 'gemma_rms'.")

  def is_sliding(self, layer: int) -> bool:
    """Whether block `layer` attends through the sliding window."""
    if self.layer_types is None:
      return self.sliding_window is not None
    return self.layer_types[layer] == "sliding"


def matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., D] times kernel [F, D] transposed: [..., F] in x's dtype.

  A kernel stored in x's dtype is a plain product. A kernel stored in another
  dtype (bfloat16 weights under float32 activations) multiplies x rounded to
  its dtype, and the products are summed in float32 (`preferred_element_type`),
  so XLA reads the stored kernel as it is, half the bytes of float32.

  The trade: such a model is not the float32 model. Its weights are rounded
  to bfloat16 and so are the inputs of each matmul; everything else (the
  residual stream, norms, attention scores, softmax and the logits) stays in
  the activation dtype. Speculative decoding then preserves exactly the law
  of this bfloat16-weight model, whose logits are close to the float32
  model's but not equal to them.

  On the CPU backend of one device, products of at most
  `cpu_matmul.MAX_ROWS` rows run the small-row kernel instead (cpu_matmul.py
  says why): the same product, with each row's sums in an order that does not
  depend on the rows beside it.
  """
  if cpu_matmul.applies(x, kernel):
    rows = x.reshape(-1, x.shape[-1]).astype(kernel.dtype)  # [M, D]
    y = cpu_matmul.small_row_matmul(rows, kernel)  # [M, F] float32
    return y.reshape(x.shape[:-1] + y.shape[-1:]).astype(x.dtype)
  return xla_matmul(x, kernel)


def xla_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """`matmul` as XLA's dot computes it, without the small-row kernel.

  On CPU a bfloat16-weight product of one row is computed as two (the row
  and a zero row): XLA:CPU reads a bfloat16 kernel directly only in products
  of 2 or more rows, and converts a float32 copy of the whole kernel for a
  single row. Measured over SmolLM2's matrices: 151 ms for one row, 12 ms for
  two (float32's one-row product: 13.5 ms).
  """
  if kernel.dtype == x.dtype:
    return jnp.einsum("...d,fd->...f", x, kernel)
  product = lambda x: jnp.einsum("...d,fd->...f", x.astype(kernel.dtype),
                                 kernel, preferred_element_type=jnp.float32)
  if math.prod(x.shape[:-1]) == 1 and jax.default_backend() == "cpu":
    y = product(jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0))))[:1]
    y = y.reshape(x.shape[:-1] + y.shape[-1:])
  else:
    y = product(x)
  return y.astype(x.dtype)


class Linear(nn.Module):
  """y = x W^T + b with the kernel stored [out, in], as torch.nn.Linear does.

  The same layout as PyTorch and Hugging Face checkpoints, and on CPU a
  one-token step measured faster with it than with flax's [in, out]. The
  kernel is stored in weight_dtype (None: dtype), the bias in dtype; see
  `matmul`.
  """

  features: int
  dtype: str
  use_bias: bool = True
  weight_dtype: str | None = None

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (self.features, x.shape[-1]),
                        self.weight_dtype or self.dtype)
    y = matmul(x, kernel)
    if self.use_bias:
      y += self.param("bias", nn.initializers.zeros, (self.features,),
                      self.dtype)
    return y


class Embed(nn.Module):
  """The token table [V, D]: rows for tokens in, and (tied) logits out.

  flax's nn.Embed promotes its whole table to the activation dtype on every
  call; this one converts only the rows it looks up, and `attend` multiplies
  by the table as stored (`matmul`). The same parameter path
  ("embed/embedding") and initialiser.
  """

  num_embeddings: int
  features: int
  dtype: str
  weight_dtype: str | None = None

  def setup(self):
    self.embedding = self.param(
        "embedding", nn.initializers.normal(0.02),
        (self.num_embeddings, self.features), self.weight_dtype or self.dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """[..., D] rows of tokens [...]."""
    if self.embedding.dtype != jnp.bfloat16:
      return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)
    # XLA:CPU takes bfloat16 rows by converting the whole table to float32
    # first, and hoists that out of a decode loop: 35 ms per loop with
    # SmolLM2's table. Its bits taken as 16-bit integers are not converted.
    bits = jax.lax.bitcast_convert_type(self.embedding, jnp.uint16)
    rows = jnp.take(bits, tokens, axis=0)
    return jax.lax.bitcast_convert_type(rows, jnp.bfloat16).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [..., D] -> [..., V]: the product with every token's row."""
    return matmul(x, self.embedding)


def rope_frequencies(config: TransformerConfig,
                     sliding: bool = False) -> np.ndarray:
  """[head_dim / 2] float32 rotary inverse frequencies, as HF computes them.

  sliding: for a sliding layer, whose base is rope_local_theta (if set) and
    which is never scaled (Gemma 3's local layers).
  """
  dim = config.head_dim
  theta, scaling = config.rope_theta, config.rope_scaling
  if sliding and config.rope_local_theta is not None:
    theta, scaling = config.rope_local_theta, None
  inv_freq = 1.0 / (np.float32(theta)
                    ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  if scaling is not None and scaling.kind == "linear":
    inv_freq = inv_freq / np.float32(scaling.factor)
  elif scaling is not None:
    wavelength = 2 * np.pi / inv_freq
    low = scaling.original_max_len / scaling.low_freq_factor
    high = scaling.original_max_len / scaling.high_freq_factor
    smooth = ((scaling.original_max_len / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    inv_freq = np.where(wavelength > low, inv_freq / scaling.factor,
                        np.where(wavelength < high, inv_freq, interpolated))
  return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array,
               inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [B, T, ..., Dh] by positions [B, T] (`cpu_matmul.rotate_by_xla`
  says how). Where the small-row kernel serves the pass (`cpu_matmul.serves`),
  the CPU kernel rotates, so that a token's rotated query and key come out
  bitwise the same in a step and in a verify, however XLA would fuse the
  rotation into its neighbours.
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  rows = math.prod(positions.shape)
  if x.dtype == jnp.float32 and cpu_matmul.serves(rows):
    return cpu_matmul.rotate(x.reshape(rows, -1, x.shape[-1]),
                             cos.reshape(rows, -1),
                             sin.reshape(rows, -1)).reshape(x.shape)
  heads = (1,) * (x.ndim - 3)  # x's axes between T and Dh
  cos, sin = (a.reshape(a.shape[:2] + heads + a.shape[2:]) for a in (cos, sin))
  return cpu_matmul.rotate_by_xla(x, cos, sin).astype(x.dtype)


def row_mean(x: jax.Array) -> jax.Array:
  """[B, T, ..., 1] float32: the mean of x [B, T, ..., D] over its last axis.

  Summed by halving: zero-padded to a power of two, then the two halves added
  until one column is left, so every row's sum is the same tree of additions
  whatever the number of rows. XLA's reduction is not: a norm over [9, 576]
  differs from nine over [1, 576] in the last bit of about 30% of its
  outputs, and with bfloat16 weights, whose products round the normed input
  to 8 bits, that made a verify's logits differ from the steps' on SmolLM2
  (greedy SD != AR).
  """
  width = x.shape[-1]
  padding = (1 << (width - 1).bit_length()) - width
  total = jnp.pad(x.astype(jnp.float32),
                  [(0, 0)] * (x.ndim - 1) + [(0, padding)])
  while total.shape[-1] > 1:
    half = total.shape[-1] // 2
    total = total[..., :half] + total[..., half:]
  return total / width


class RMSNorm(nn.Module):
  """x / rms(x) * w, Llama's (flax's `nn.RMSNorm`, with `row_mean`).

  gemma: Gemma's, x / rms(x) * (1 + w), in float32 then cast back; its
  scale is stored as w (initialised to 0), Hugging Face's layout.
  """

  epsilon: float
  dtype: str
  gemma: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.gemma else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), self.dtype)
    x32 = x.astype(jnp.float32)
    inverse = jax.lax.rsqrt(row_mean(jnp.square(x32)) + self.epsilon)
    if self.gemma:
      return (x32 * inverse * (1.0 + scale.astype(jnp.float32))).astype(
          x.dtype)
    return (x32 * (inverse * scale.astype(jnp.float32))).astype(self.dtype)


class LayerNorm(nn.Module):
  """(x - mean) / std * w + b, GPT-2's: the mean, then the variance as the
  mean of (x - mean)^2 (flax's `nn.LayerNorm` takes E[x^2] - mean^2), both
  by `row_mean`."""

  epsilon: float
  dtype: str

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],),
                       self.dtype)
    bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],),
                      self.dtype)
    centred = x.astype(jnp.float32) - row_mean(x)
    inverse = jax.lax.rsqrt(row_mean(jnp.square(centred)) + self.epsilon)
    return (centred * (inverse * scale.astype(jnp.float32))
            + bias.astype(jnp.float32)).astype(self.dtype)


def _norm(config: TransformerConfig, name: str) -> nn.Module:
  if config.norm == "layer":
    return LayerNorm(config.norm_eps, config.dtype, name=name)
  return RMSNorm(config.norm_eps, config.dtype,
                 gemma=config.norm == "gemma_rms", name=name)


class Block(nn.Module):
  """Pre-norm attention and MLP: GPT-2's, or Llama's and Gemma's with their
  switches. `sliding`: this block's rotary base is the sliding layers' (the
  caller passes it the sliding-window mask)."""

  config: TransformerConfig
  sliding: bool = False

  @nn.compact
  def __call__(self, x, positions, slots, visible, keys, values,
               write_keys=True):
    """x [B, T, D]; positions, slots [B, T] (rotary position and cache slot
    of each token); visible [B, T, S] bool, the key slots each token attends
    to once written; keys, values [B, K, S, Dh].

    write_keys: True writes the T tokens' keys and values into keys and
    values and returns those. False attends to them unwritten and returns
    them instead, [B, K, T, Dh] (a `PendingWrite`'s)."""
    cfg = self.config
    h = _norm(cfg, "ln_attn")(x)
    # One projection for q, k and v: one matmul per step.
    qkv = Linear((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                 cfg.dtype, cfg.qkv_bias, cfg.weight_dtype, name="qkv")(h)
    q, k, v = _split_qkv(cfg, qkv)
    if cfg.qk_norm:  # Per head, before the rotation.
      q, k = _norm(cfg, "q_norm")(q), _norm(cfg, "k_norm")(k)
    if cfg.position == "rope":
      inv_freq = rope_frequencies(cfg, self.sliding)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions,
                                                            inv_freq)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, Dh]
    if write_keys:
      keys, values = write(keys, k, slots), write(values, v, slots)
    attended = _attend(cfg, q, keys, values, k, v, slots, visible,
                       written=write_keys)
    if not write_keys:
      keys, values = k, v
    h = Linear(cfg.d_model, cfg.dtype, cfg.bias, cfg.weight_dtype,
               name="attn_out")(attended)
    if cfg.post_norms:
      h = _norm(cfg, "post_attn")(h)
    x = x + h

    h = _norm(cfg, "ln_mlp")(x)
    if cfg.mlp in ("swiglu", "geglu"):
      # Gate and up projections in one matmul, gate first.
      gate, up = jnp.split(
          Linear(2 * cfg.d_ff, cfg.dtype, cfg.bias, cfg.weight_dtype,
                 name="mlp_in")(h), 2, -1)
      activation = nn.silu if cfg.mlp == "swiglu" else nn.gelu
      h = activation(gate) * up
    else:
      h = nn.gelu(Linear(cfg.d_ff, cfg.dtype, cfg.bias, cfg.weight_dtype,
                         name="mlp_in")(h))
    h = Linear(cfg.d_model, cfg.dtype, cfg.bias, cfg.weight_dtype,
               name="mlp_out")(h)
    if cfg.post_norms:
      h = _norm(cfg, "post_mlp")(h)
    return x + h, keys, values


def _split_qkv(cfg: TransformerConfig, qkv: jax.Array):
  """q [B, T, K, G, Dh], k and v [B, T, K, Dh] from the fused projection.

  Query head h reads key/value head h // G, as HF's repeat_kv does.
  """
  batch, length, _ = qkv.shape
  heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  group = heads // kv_heads  # Query heads per key/value head.
  if cfg.qkv_head_major:
    qkv = qkv.reshape(batch, length, kv_heads, group + 2, head_dim)
    return qkv[..., :group, :], qkv[..., group, :], qkv[..., group + 1, :]
  q, k, v = jnp.split(
      qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
  return (q.reshape(batch, length, kv_heads, group, head_dim),
          k.reshape(batch, length, kv_heads, head_dim),
          v.reshape(batch, length, kv_heads, head_dim))


def _attend(cfg: TransformerConfig, q, keys, values, own_keys, own_values,
            slots, visible, written: bool) -> jax.Array:
  """[B, T, H * Dh]: `attention.attend` with the config's scale and soft cap,
  q [B, T, K, G, Dh] as `_split_qkv` gives it."""
  batch, length = q.shape[:2]
  attended = attention.attend(
      q, keys, values, own_keys, own_values, slots, visible, written=written,
      scale=math.sqrt(cfg.query_pre_attn_scalar or cfg.head_dim),
      cap=cfg.attn_softcap)
  return attended.reshape(batch, length, cfg.num_heads * cfg.head_dim)


def ancestor_mask(parents: jax.Array) -> jax.Array:
  """[B, T, T] bool: token j is token t itself or one of its ancestors.

  parents [B, T] int32 gives each token's parent among the T, or a negative
  value for a token that hangs from the cached context alone; parents[b, t] <
  t. A chain (parents = t - 1) gives the lower-triangular causal mask. The
  closure doubles the path length per step: log2(T) boolean matmuls.
  """
  length = parents.shape[-1]
  index = jnp.arange(length)
  reach = (index[:, None] == index) | (parents[..., :, None] == index)
  for _ in range(max(1, (length - 1).bit_length())):
    reach = jnp.einsum("btj,bjk->btk", reach.astype(jnp.int32),
                       reach.astype(jnp.int32)) > 0
  return reach


def visible_slots(slots: jax.Array, num_slots: int,
                  parents: jax.Array | None = None) -> jax.Array:
  """[B, T, S] bool: the cache slots each of T new tokens attends to.

  The new tokens sit at slots [B, T], consecutive from each row's first one.
  Without parents they form a chain: token t sees every slot up to its own.
  With parents [B, T] (see `ancestor_mask`) they form a tree: token t sees
  the context before the first new slot, then itself and its ancestors only,
  so siblings scored in one pass never see each other.
  """
  slot = jnp.arange(num_slots)
  if parents is None:
    return slot[None, None, :] <= slots[:, :, None]
  first = slots[:, :1, None]  # [B, 1, 1]
  offset = slot[None, None, :] - first  # [B, 1, S] index among the new tokens
  is_new = (offset >= 0) & (offset < slots.shape[1])
  among_new = jnp.take_along_axis(
      ancestor_mask(parents),
      jnp.broadcast_to(jnp.clip(offset, 0, slots.shape[1] - 1),
                       (slots.shape[0], slots.shape[1], num_slots)), axis=2)
  return jnp.where(is_new, among_new, offset < 0)


def within_window(positions: jax.Array, slots: jax.Array, num_slots: int,
                  window: int) -> jax.Array:
  """[B, T, S] bool: the key slots within a sliding window of each query.

  A key is within the window of a query at position t if its position is
  greater than t - window. A cached slot holds the token at its own position,
  except the T new tokens, which sit at `slots` but have `positions` (their
  depth, when they form a tree). Combined with `visible_slots` by the caller.
  """
  slot = jnp.arange(num_slots)
  offset = slot[None, :] - slots[:, :1]  # [B, S] index among the new tokens
  is_new = (offset >= 0) & (offset < slots.shape[1])
  new_position = jnp.take_along_axis(
      positions, jnp.clip(offset, 0, slots.shape[1] - 1), axis=1)
  key_position = jnp.where(is_new, new_position, slot[None, :])  # [B, S]
  return key_position[:, None, :] > positions[:, :, None] - window


def _masks(cfg: TransformerConfig, positions: jax.Array, num_slots: int,
           parents: jax.Array | None):
  """(slots [B, T] the new tokens are written at, the [B, T, S] slots each
  token sees in a full-attention layer, and in a sliding one: None when no
  layer slides). A chain is written at its positions, a tree's nodes one
  after another from its first token's slot."""
  slots = (positions if parents is None
           else positions[:, :1] + jnp.arange(positions.shape[1]))
  visible = visible_slots(slots, num_slots, parents)
  if not any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
    return slots, visible, None
  return slots, visible, visible & within_window(positions, slots, num_slots,
                                                 cfg.sliding_window)


class Transformer(nn.Module):
  """Decoder: embeddings, `num_layers` blocks, final norm, output projection."""

  config: TransformerConfig

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      cache: KVCache,
      positions: jax.Array | None = None,
      num_layers: int | None = None,
      parents: jax.Array | None = None,
      hidden_layers: tuple[int, ...] = (),
      write: bool = True,
  ) -> tuple[jax.Array, KVCache | PendingWrite, tuple[jax.Array, ...]]:
    """Runs tokens [B, T] and writes their keys and values into the cache
    (or, write=False, returns them unwritten).

    Args:
      tokens: [B, T] int32.
      cache: the cache to extend.
      positions: [B, T] int32 position of each token; by default the row's
        pointer onwards, `cache.lengths[:, None] + arange(T)`.
      num_layers: run only the first num_layers blocks, then the final norm
        and the head (a self-speculative draft); the other layers' caches are
        returned untouched.
      parents: [B, T] int32, set when the tokens form a tree rather than a
        chain (see `visible_slots`). Token t is written at slot
        `positions[:, 0] + t` and attends to the context and its ancestors;
        its position (its depth below the context) comes from `positions`.
      hidden_layers: return the input of each of these blocks, [B, T, D];
        index num_layers is the last block's output, before the final norm.
      write: False leaves the cache unwritten: the tokens attend to their own
        keys and values directly, and those come back as a `PendingWrite`
        for `KVCache.commit` (kv_cache.py says why); every layer runs.

    Returns:
      float32 logits [B, T, V], the cache with `lengths` set to one past
      each row's last written slot (or, write=False, the PendingWrite), and
      the requested hidden states.
    """
    cfg = self.config
    if not write and num_layers is not None:
      raise ValueError("write=False runs every layer: num_layers must be "
                       f"None, not {num_layers}.")
    if positions is None:
      positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    positions = positions.astype(jnp.int32)
    slots, visible, local = _masks(cfg, positions, cache.keys[0].shape[2],
                                   parents)
    embed = Embed(cfg.vocab_size, cfg.d_model, cfg.dtype, cfg.weight_dtype,
                  name="embed")
    x = embed(tokens)
    if cfg.embed_scale:
      # Rounded to the activation dtype first, as HF's Gemma does.
      x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.dtype)
    if cfg.position == "learned":
      position_table = self.param(
          "positions", nn.initializers.normal(0.01), (cfg.max_len, cfg.d_model),
          cfg.dtype,
      )
      # Positions past max_len only occur in the scratch tail of rows whose
      # output is already complete, so clipping them changes no emitted token.
      x = x + position_table[jnp.clip(positions, 0, cfg.max_len - 1)]

    keys, values = list(cache.keys), list(cache.values)
    hidden = {}
    for i in range(cfg.num_layers if num_layers is None else num_layers):
      hidden[i] = x
      sliding = cfg.is_sliding(i)
      x, keys[i], values[i] = Block(cfg, sliding, name=f"block_{i}")(
          x, positions, slots, local if sliding else visible, keys[i],
          values[i], write)
    hidden[len(hidden)] = x
    x = _norm(cfg, "ln_final")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = Linear(cfg.vocab_size, cfg.dtype, use_bias=False,
                      weight_dtype=cfg.weight_dtype, name="lm_head")(x)
    logits = attention.softcap(logits.astype(jnp.float32),
                               cfg.final_softcap)
    if write:
      cache = KVCache(keys=tuple(keys), values=tuple(values),
                      lengths=slots[:, -1] + 1)
    else:
      cache = PendingWrite(tuple(keys), tuple(values), slots)
    return logits, cache, tuple(hidden[i] for i in hidden_layers)


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

  def __call__(
      self, tokens: jax.Array, cache: KVCache,
      positions: jax.Array | None = None, num_layers: int | None = None,
      parents: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """Logits [B, T, V] and the cache: `Transformer.__call__` with these
    parameters."""
    logits, cache, _ = self.forward(tokens, cache, positions, num_layers,
                                    parents)
    return logits, cache

  # Jitted so that calls from eager code compile once; inside an outer jit
  # (the decode loops) this is inlined.
  @functools.partial(jax.jit, static_argnames=("num_layers", "hidden_layers",
                                                "write"))
  def forward(
      self, tokens: jax.Array, cache: KVCache,
      positions: jax.Array | None = None, num_layers: int | None = None,
      parents: jax.Array | None = None, hidden_layers: tuple[int, ...] = (),
      write: bool = True,
  ) -> tuple[jax.Array, KVCache | PendingWrite, tuple[jax.Array, ...]]:
    """`Transformer.__call__` with these parameters: logits, the cache (or
    the PendingWrite, write=False) and the hidden states of
    `hidden_layers`."""
    logits, cache, hidden = Transformer(self.config).apply(
        {"params": self.params}, tokens, cache, positions, num_layers,
        parents, hidden_layers, write)
    return logits, (self._constrain(cache) if write else cache), hidden

  def commit(self, cache: KVCache, pending: PendingWrite) -> KVCache:
    """`KVCache.commit`, the result kept on the cache's shardings."""
    return self._constrain(cache.commit(pending))

  def _constrain(self, cache: KVCache) -> KVCache:
    """Pins the cache to its shardings, so the decode loop never moves it."""
    if self.cache_sharding is None:
      return cache
    return jax.lax.with_sharding_constraint(cache, self.cache_sharding)

  def with_weight_dtype(self, weight_dtype: str | None) -> "Model":
    """This model with its matmul weights stored in weight_dtype (None: the
    activation dtype), e.g. a float32 checkpoint run with bfloat16 weights:
    `load_hf(path).model.with_weight_dtype("bfloat16")`.

    Only the matmul weights are cast (see `matmul` for what changes and
    what speculative decoding then preserves); a sharded model keeps its
    shardings. Casting to a narrower dtype loses precision that casting
    back does not restore.
    """
    config = dataclasses.replace(self.config, weight_dtype=weight_dtype)
    params = jax.tree.map(lambda x, wanted: x.astype(wanted.dtype),
                          self.params, abstract_params(config))
    return self.replace(config=config, params=params)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    return self._constrain(init_cache(self.config, batch_size, max_len))

  def prefill(
      self, prompts: jax.Array, prompt_lengths: jax.Array, max_len: int
  ) -> KVCache:
    """Caches right-padded prompts [B, P] of lengths [B] in one pass.

    The pointer is left at `prompt_lengths - 1`: the cache holds every prompt
    token but the last, which the first decode step feeds (and rewrites).
    """
    return self.prefill_with_hidden(prompts, prompt_lengths, max_len)[0]

  @functools.partial(jax.jit, static_argnames=("max_len", "hidden_layers"))
  def prefill_with_hidden(
      self, prompts: jax.Array, prompt_lengths: jax.Array, max_len: int,
      hidden_layers: tuple[int, ...] = (),
  ) -> tuple[KVCache, tuple[jax.Array, ...]]:
    """`prefill`, also returning the prompts' hidden states [B, P, D] of
    `hidden_layers` (for a drafter that reads the target's features).

    Where the small-row CPU kernels serve B rows, the prompts pass in chunks
    of `MAX_ROWS // B` tokens, each a pass the kernels serve: over SmolLM2's
    weights they prefill 64 tokens 1.5x (float32) and 1.8x (bfloat16) faster
    than XLA's ops in one pass (docs/step_benchmark.md).
    """
    batch, length = prompts.shape

    def prefill_chunk(cache, tokens):  # tokens [B, C]
      _, cache, hidden = self.forward(tokens, cache,
                                      hidden_layers=hidden_layers)
      return cache, hidden

    cache = self.init_cache(batch, max_len)
    chunk = cpu_matmul.MAX_ROWS // batch
    if not cpu_matmul.serves(batch) or chunk >= length:
      cache, hidden = prefill_chunk(cache, prompts)
      return cache.rollback(prompt_lengths - 1), hidden
    whole = length // chunk * chunk
    chunks = prompts[:, :whole].reshape(batch, -1, chunk).swapaxes(0, 1)
    cache, hidden = jax.lax.scan(prefill_chunk, cache, chunks)
    # Each [chunks, B, C, D] back to [B, P, D].
    hidden = [h.swapaxes(0, 1).reshape(batch, whole, -1) for h in hidden]
    if whole < length:
      cache, rest = prefill_chunk(cache, prompts[:, whole:])
      hidden = [jnp.concatenate(parts, 1) for parts in zip(hidden, rest)]
    return cache.rollback(prompt_lengths - 1), tuple(hidden)

  @property
  def output_kernel(self) -> jax.Array:
    """[V, D] the output layer's weights: the embedding table when tied."""
    if self.config.tie_embeddings:
      return self.params["embed"]["embedding"]
    return self.params["lm_head"]["kernel"]

  def unembed(self, x: jax.Array) -> jax.Array:
    """float32 logits [..., V] of final-normed states x [..., D]: the output
    layer alone (tied or not, soft-capped as the model's)."""
    logits = matmul(x, self.output_kernel)
    return attention.softcap(logits.astype(jnp.float32),
                             self.config.final_softcap)


def abstract_params(config: TransformerConfig):
  """The parameters of `config`'s model as ShapeDtypeStructs: the shape and
  dtype each one has, without computing any."""
  return jax.eval_shape(lambda: Model.init(config, jax.random.key(0))).params


@jax.jit
def score(model: Model, tokens: jax.Array) -> jax.Array:
  """float32 logits [B, T, V] for full sequences tokens [B, T], no cache kept."""
  logits, _ = model(tokens, model.init_cache(tokens.shape[0], tokens.shape[1]))
  return logits
