"""EAGLE draft heads: one block that drafts from the target's own features.

EAGLE (Li et al. 2024, arXiv 2401.15077) drafts from the target's hidden
states instead of from tokens alone; EAGLE-3 (arXiv 2503.01840) fuses the
states of a low, a middle and a high layer and predicts over a reduced
vocabulary. The head here is EAGLE-3's; one feature layer, the last, is
EAGLE-1. At head position t, with f_t the target's fused features at t:

  in_t = proj([norm(embed(x_t)), norm(f_{t-1})])     f_{-1} = 0
  a_t  = Block(in, causal over the head's own KV cache)      [D]
  q_t  = softmax(output(norm(a_t)))      the law of x_{t+1}

where `output` is the target's own output layer, or the head's over the K
most frequent tokens, scattered into the full vocabulary with q = 0 outside
them (every token the head can draft has q > 0 where it was drawn, which is
all `resample` needs to stay exact). Drafting past the last token whose
features the target computed, the head feeds its own a_t as f_t: that is
how it drafts gamma tokens with no target pass.

The head keeps, per row, a KV cache (one layer) and the fused features by
position. Its pointer H counts the positions whose keys were computed from
the target's features. Each cycle:

  propose  runs positions H .. H + gamma in one call (the tokens emitted
           last cycle, with the features its verify computed), reads the
           first draft's law at the row's last position L - 1, then drafts
           gamma - 1 more on its own features; the pointer moves to L;
  update   writes the verify's features of positions L - 1 .. L - 1 + gamma
           (only those of accepted tokens are ever read).
"""

import dataclasses
import json
import pathlib

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafting import DraftLoop, Proposal, check_vocabulary
from spec_jax.io import files
from spec_jax.kv_cache import KVCache, init_cache
from spec_jax.model import (Block, Linear, Model, TransformerConfig, _norm,
                            visible_slots)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers: the inputs of blocks 2, L // 2
  and L - 3 (fewer in a shallow model where they coincide)."""
  picks = (2, num_layers // 2, num_layers - 3)
  return tuple(sorted({min(max(p, 0), num_layers) for p in picks}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """Static settings of a head.

  block: the head's one block, of the target's type; always rotary, since
    the target's learned position table is not part of the head.
  feature_layers: the target blocks whose inputs are fused (index
    num_layers is the last block's output, EAGLE-1's feature).
  reduced_vocab: K > 0 predicts over K tokens with its own output layer;
    0 uses the target's output layer over the full vocabulary.
  target_vocab_size: the vocabulary the head drafts in.
  """

  block: TransformerConfig
  feature_layers: tuple[int, ...]
  reduced_vocab: int = 0
  target_vocab_size: int

  def __post_init__(self):
    if isinstance(self.block, dict):
      object.__setattr__(self, "block", TransformerConfig(**self.block))
    object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
    if not self.feature_layers:
      raise ValueError("an EAGLE head needs at least one feature layer.")
    if not 0 <= self.reduced_vocab <= self.target_vocab_size:
      raise ValueError(f"reduced_vocab={self.reduced_vocab}: use 0 (the "
                       f"full vocabulary) up to {self.target_vocab_size}.")

  @classmethod
  def for_target(cls, target: TransformerConfig,
                 feature_layers: tuple[int, ...] | None = None,
                 reduced_vocab: int = 0) -> "EagleConfig":
    block = dataclasses.replace(
        target, num_layers=1, position="rope", rope_scaling=None,
        sliding_window=None, layer_types=None, qkv_head_major=False,
        weight_dtype=None)
    if feature_layers is None:
      feature_layers = default_feature_layers(target.num_layers)
    return cls(block=block, feature_layers=tuple(feature_layers),
               reduced_vocab=reduced_vocab,
               target_vocab_size=target.vocab_size)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2)


class EagleHead(nn.Module):
  """The head's parameters and its three computations (see the module
  docstring): `fuse`, `__call__` (one block over a run of positions) and
  `reduced_logits`."""

  config: EagleConfig

  def setup(self):
    block = self.config.block
    self.fuse_proj = Linear(block.d_model, block.dtype, use_bias=False)
    # Normed apart before they are joined (EAGLE-3's input and hidden norms):
    # the residual stream's scale is tens to hundreds of times a token
    # embedding's, which would otherwise drown the token.
    self.embed_norm = _norm(block, None)
    self.feature_norm = _norm(block, None)
    self.input_proj = Linear(block.d_model, block.dtype, use_bias=False)
    self.block = Block(block)
    self.norm = _norm(block, None)
    if self.config.reduced_vocab:
      self.output = Linear(self.config.reduced_vocab, block.dtype,
                           use_bias=False)

  def fuse(self, hidden: tuple[jax.Array, ...]) -> jax.Array:
    """[B, T, D] fused features from the feature layers' [B, T, D] each."""
    return self.fuse_proj(jnp.concatenate(hidden, axis=-1))

  def __call__(self, embedded, features, positions, slots, visible, keys,
               values):
    """embedded [B, T, D] (token x_t), features [B, T, D] (f_{t-1}),
    positions and slots [B, T], visible [B, T, S], keys and values of the
    head's cache [B, K, S, Dh]. Returns a [B, T, D], norm(a) and the
    keys and values with these positions written."""
    x = self.input_proj(jnp.concatenate(
        [self.embed_norm(embedded), self.feature_norm(features)], axis=-1))
    a, keys, values = self.block(x, positions, slots, visible, keys, values)
    return a, self.norm(a), keys, values

  def reduced_logits(self, normed: jax.Array) -> jax.Array:
    """[..., K] logits over the reduced vocabulary."""
    return self.output(normed).astype(jnp.float32)

  def init_all(self, hidden, embedded, positions, keys, values):
    """Touches every parameter (for `init`)."""
    features = self.fuse(hidden)
    visible = visible_slots(positions, keys.shape[2])
    _, normed, _, _ = self(embedded, features, positions, positions, visible,
                           keys, values)
    return self.reduced_logits(normed) if self.config.reduced_vocab else normed


def init_params(config: EagleConfig, key: jax.Array,
                target: Model | None = None,
                vocab_ids: jax.Array | None = None) -> dict:
  """Random parameters; with `target`, the head's final norm and (reduced)
  output layer start as the target's own (its rows at vocab_ids), as
  EAGLE-3 does, so the head starts as "predict the target's last hidden
  state" instead of learning an output layer from scratch: with little
  data, that is most of what it can learn."""
  block = config.block
  hidden = tuple(jnp.zeros((1, 1, block.d_model), block.dtype)
                 for _ in config.feature_layers)
  cache = init_cache(block, 1, 1)
  params = EagleHead(config).init(
      key, hidden, hidden[0], jnp.zeros((1, 1), jnp.int32), cache.keys[0],
      cache.values[0], method=EagleHead.init_all)["params"]
  if target is None:
    return params
  params = {**params, "norm": jax.tree.map(
      lambda x: jnp.asarray(x, block.dtype), target.params["ln_final"])}
  if config.reduced_vocab:
    params["output"] = {"kernel": jnp.asarray(
        target.output_kernel[vocab_ids], block.dtype)}
  return params


@flax.struct.dataclass
class EagleState:
  """The head's per-row state between cycles.

  cache: its one layer's keys and values; `lengths` is the pointer H.
  features: [B, S, D] fused target features by position, valid below the
    target's own cache pointer.
  """

  cache: KVCache
  features: jax.Array


@flax.struct.dataclass
class EagleDrafter:
  """An EAGLE head drafting for `target`, whose embedding and (with the
  full vocabulary) output layer it shares.

  vocab_ids: [K] int32 the tokens of the reduced vocabulary, or None.
  """

  target: Model
  params: dict
  config: EagleConfig = flax.struct.field(pytree_node=False)
  vocab_ids: jax.Array | None = None

  proposes_fewer = False  # always gamma drafts

  @property
  def vocab_size(self) -> int:
    return self.config.target_vocab_size

  @property
  def target_layers(self) -> tuple[int, ...]:
    return self.config.feature_layers

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  def validate(self, target: Model, max_len: int) -> None:
    del max_len  # rotary positions: no table to outgrow
    check_vocabulary(self.vocab_size, target)
    if target.config != self.target.config:
      raise ValueError("the EAGLE head was built for another target model "
                       "(their configs differ); load the head with the "
                       "target it drafts for.")
    if max(self.target_layers) > target.config.num_layers:
      raise ValueError(f"feature layers {self.target_layers}: the target has "
                       f"{target.config.num_layers} blocks.")

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    return gamma, gamma  # a chain

  def describe(self) -> str:
    vocab = (f"{self.config.reduced_vocab} of {self.vocab_size} tokens"
             if self.config.reduced_vocab else "full vocabulary")
    return (f"EAGLE head, features of layers {self.target_layers}, {vocab}, "
            f"{self.num_params:,} params")

  def _apply(self, method, *args):
    return EagleHead(self.config).apply({"params": self.params}, *args,
                                        method=method)

  def logits(self, normed: jax.Array) -> jax.Array:
    """float32 logits [..., V] from the head's normed output: through the
    target's output layer, or the reduced one scattered into the full
    vocabulary with -inf (q = 0) elsewhere."""
    if not self.config.reduced_vocab:
      return self.target.unembed(normed)
    reduced = self._apply(EagleHead.reduced_logits, normed)
    full = jnp.full(reduced.shape[:-1] + (self.vocab_size,), -jnp.inf)
    return full.at[..., self.vocab_ids].set(reduced)

  def _run(self, tokens, features, positions, cache: KVCache):
    """The head over tokens [B, T] at positions [B, T] (chain slots) with
    features [B, T, D]: (a, logits [B, T, V], cache with them written)."""
    visible = visible_slots(positions, cache.keys[0].shape[2])
    a, normed, keys, values = self._apply(
        EagleHead.__call__, self.target.embed(tokens),
        features.astype(self.config.block.dtype), positions, positions,
        visible, cache.keys[0], cache.values[0])
    return a, self.logits(normed), cache.replace(keys=(keys,),
                                                 values=(values,))

  def prefill(self, prompts, prompt_lengths, max_len, hidden) -> EagleState:
    """Runs the prompts' positions; the pointer is left at P - 1, so the
    first propose runs the last prompt token (as the target's first verify
    does)."""
    features = self._apply(EagleHead.fuse, hidden)  # [B, P, D]
    batch, width = prompts.shape
    # Position t reads f_{t-1}; position 0 reads zeros.
    shifted = jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :width]
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    _, _, cache = self._run(prompts, shifted, positions,
                            init_cache(self.config.block, batch, max_len))
    stored = jnp.zeros((batch, max_len, features.shape[-1]), features.dtype)
    return EagleState(cache.rollback(prompt_lengths - 1),
                      stored.at[:, :width].set(features))

  def propose(self, state: EagleState, target_cache, tokens, lengths, key,
              gamma, sampling) -> Proposal:
    start = state.cache.lengths  # [B] H
    positions = start[:, None] + jnp.arange(gamma + 1)  # H .. H + gamma
    features = jnp.take_along_axis(
        state.features, jnp.maximum(positions - 1, 0)[..., None], axis=1)
    features = jnp.where(positions[..., None] >= 1, features, 0)
    run_tokens = jnp.take_along_axis(tokens, positions, 1, mode="clip")
    a, logits, cache = self._run(run_tokens, features, positions, state.cache)
    # The first draft follows the last token, at position L - 1.
    last = jnp.maximum(lengths - 1 - start, 0)[:, None]  # 0: a finished row
    first_a = jnp.take_along_axis(a, last[..., None], axis=1)[:, 0]
    first_logits = jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0]
    keys = jax.random.split(key, gamma)

    def draft_step(loop: DraftLoop) -> DraftLoop:
      loop = loop.draw(keys, sampling)
      cache, feature = loop.cache
      position = (lengths + loop.step)[:, None]
      a, logits, cache = self._run(loop.tokens[:, loop.step, None],
                                   feature[:, None], position, cache)
      return loop.replace(step=loop.step + 1, logits=logits[:, 0],
                          cache=(cache, a[:, 0]))

    loop = jax.lax.while_loop(
        lambda loop: loop.step < gamma - 1, draft_step,
        DraftLoop.start(first_logits, (cache, first_a), gamma))
    loop = loop.draw(keys, sampling)
    # Keys from the target's features reach L - 1 now; the drafts' are the
    # head's guesses, overwritten next cycle.
    state = EagleState(loop.cache[0].rollback(lengths), state.features)
    return Proposal(loop.tokens, loop.probs, state, target_cache)

  def update(self, state: EagleState, cache_lengths, verified) -> EagleState:
    # The pointer moved in propose (see the module docstring).
    del cache_lengths
    features = self._apply(EagleHead.fuse, verified.hidden)  # [B, G+1, D]
    # The verify ran the last token (position H - 1) and the drafts.
    positions = state.cache.lengths[:, None] - 1 + jnp.arange(
        features.shape[1])
    rows = jnp.arange(features.shape[0])[:, None]
    return state.replace(features=state.features.at[rows, positions].set(
        features, mode="drop"))


def save_head(path, drafter: EagleDrafter, metadata: dict | None = None,
              storage_dtype: str | None = None):
  """Writes a head directory atomically: config.json, params/ (orbax),
  vocab.npy (the reduced vocabulary's token ids) and metadata.json.

  storage_dtype: e.g. "bfloat16" to halve the files; loading casts back.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  params = drafter.params
  if storage_dtype:
    params = jax.tree.map(lambda x: x.astype(storage_dtype), params)
  with files.atomic_directory(path) as staging:
    (staging / "config.json").write_text(drafter.config.to_json())
    if drafter.vocab_ids is not None:
      np.save(staging / "vocab.npy", np.asarray(drafter.vocab_ids, np.int32))
    (staging / "metadata.json").write_text(json.dumps(metadata or {},
                                                      indent=2))
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(staging / "params", params)


def load_head(path, target: Model) -> EagleDrafter:
  """Reads a head directory written by `save_head`, for `target`.

  Raises:
    FileNotFoundError: no head at path.
    ValueError: the head is corrupt, or was built for another target.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(path).absolute()
  if not (path / "config.json").exists() or not (path / "params").exists():
    raise FileNotFoundError(
        f"no EAGLE head at {path}: expected config.json and params/ there. "
        "Train one with `python -m experiments.train_eagle`.")
  try:
    config = EagleConfig(**json.loads((path / "config.json").read_text()))
    expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(path / "params")
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    if shapes(params) != shapes(expected):
      raise ValueError("the stored parameters do not match config.json")
    vocab_ids = (jnp.asarray(np.load(path / "vocab.npy"), jnp.int32)
                 if config.reduced_vocab else None)
  except Exception as error:  # orbax, json and numpy raise many types.
    raise ValueError(f"the EAGLE head at {path} is corrupt or incomplete "
                     f"({type(error).__name__}: {error}).") from error
  if (config.block.d_model, config.target_vocab_size) != (
      target.config.d_model, target.vocab_size):
    raise ValueError(
        f"the EAGLE head at {path} was trained for another target model "
        f"(d_model {config.block.d_model}, vocabulary "
        f"{config.target_vocab_size}; this target has "
        f"{target.config.d_model} and {target.vocab_size}).")
  params = jax.tree.map(lambda x: jnp.asarray(x, config.block.dtype), params)
  return EagleDrafter(target, params, config, vocab_ids)
