"""EAGLE-3 draft heads (Li et al. 2025, arXiv 2503.01840), as published.

The head is one decoder layer that drafts from the target's own features:
the hidden states entering three of its blocks (low, middle, high), fused.
Head position t holds the pair (f_t, x_{t+1}): the target's features at its
position t and the token the target emitted after it, as SpecForge trains
and vLLM runs it. With h_t the head's hidden input there:

  h_t   = fc([f_t^low, f_t^mid, f_t^high])   from the target, [H]
                                             (each f RMS-normed first
                                             if fc_norm)
        = a_{t-1}                            a draft step: the head's own
                                             pre-norm output at t - 1
  r     = h_t                   (hidden_norm(h_t) if norm_before_residual)
  x     = [input_layernorm(embed(x_{t+1})), hidden_norm(h_t)]       [2H]
  a     = r + o_proj(attention(q, k, v of x; the head's causal KV cache))
  a_t   = a + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(a)
  q_t+2 = softmax(lm_head(norm(a_t)))   over the draft vocabulary
                                      (lm_head(a_t) if not norm_output)

Attention uses the head's own rotary settings (theta 10,000 when its config
has none), not the target's. The draft vocabulary (K tokens, `vocab_ids`
ascending: the published d2t is vocab_ids - arange(K)) is scattered into the
target's with -inf elsewhere: q is 0 off it, every token the head can draft
has q > 0 where it was drawn, and that is all `resample` needs to stay
exact. The embedding is the head's own `embed_tokens` when it has one, else
the target's table, raw (without the scale a Gemma target applies).

The head keeps, per row, a one-layer KV cache and the fused features by
position; its pointer H counts the pairs whose keys came from the target's
features. A row of L tokens has target features for positions 0..L - 2, so
its last pair is r = L - 2, whose output is the first draft's law. Each
cycle:

  propose  runs pairs H .. H + gamma in one call (those the last verify
           completed), reads the first draft at r, then drafts on its own
           outputs at r + 1, r + 2, ... (a chain, or a tree's depths under
           the tree mask); the pointer moves to L - 1, so that everything
           from there on, guesses included, is rewritten next cycle;
  update   writes the verify's features of positions L - 1 .. (those of
           accepted tokens are the ones read next cycle).
A one-token row (L = 1) has no pair yet: its first drafts come from
(0, x_0) at position 0, which the first real pair overwrites.

`greedy_drafts` runs the same computation outside the loop, for checking a
ported head against a reference.
"""

import dataclasses
import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.draft_tree import TreeTemplate, draw_tree
from spec_jax.drafting import DraftLoop, Proposal, check_vocabulary
from spec_jax.kv_cache import KVCache, init_cache, write
from spec_jax.model import (Embed, Linear, Model, RMSNorm, RopeScaling,
                            TransformerConfig, _attend, _split_qkv,
                            apply_rope, rope_frequencies, visible_slots)
from spec_jax.sampling import Sampling


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers: the inputs of blocks 2, L // 2
  and L - 3 (fewer in a shallow model where they coincide)."""
  picks = (2, num_layers // 2, num_layers - 3)
  return tuple(sorted({min(max(p, 0), num_layers) for p in picks}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """Static settings of a head; the fields of a published config.json.

  feature_layers: the target blocks whose inputs are fused, in order (index
    L is the last block's output); config.json's
    eagle_aux_hidden_state_layer_ids are block outputs, each one less.
  vocab_size: the target's vocabulary; draft_vocab_size K <= it.
  target_hidden_size: the target's d_model (fc reads
    len(feature_layers) * target_hidden_size).
  norm_before_residual: the residual is hidden_norm(h) (speculators').
  fc_norm: each feature layer's features are RMS-normed before fc
    (SpecForge's option, for targets whose features differ in scale from
    layer to layer).
  norm_output: lm_head reads norm(a); False reads a itself (SpecForge's).
  own_embedding: the head has embed_tokens; else it reads the target's.
  """

  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  draft_vocab_size: int
  target_hidden_size: int
  feature_layers: tuple[int, ...]
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_before_residual: bool = False
  fc_norm: bool = False
  norm_output: bool = True
  own_embedding: bool = False
  dtype: str = "float32"

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
    if not self.feature_layers:
      raise ValueError("an EAGLE head needs at least one feature layer.")
    if not 1 <= self.draft_vocab_size <= self.vocab_size:
      raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: use 1 up "
                       f"to the vocabulary's {self.vocab_size} tokens.")
    if not self.own_embedding and self.hidden_size != self.target_hidden_size:
      raise ValueError(
          f"a head of hidden_size {self.hidden_size} cannot read the "
          f"target's {self.target_hidden_size}-wide embedding table; it "
          "needs its own embed_tokens.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
          f"{self.num_kv_heads}; each key/value head serves a whole group.")
    if self.head_dim % 2:
      raise ValueError(f"rotary positions need an even head_dim, got "
                       f"{self.head_dim}.")

  @property
  def attention(self) -> TransformerConfig:
    """The head's attention as a one-layer Llama config: its rotary
    frequencies, head split and cache shape."""
    return TransformerConfig(
        vocab_size=self.vocab_size, d_model=self.hidden_size, num_layers=1,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, d_ff=self.intermediate_size, dtype=self.dtype,
        norm="rms", norm_eps=self.rms_norm_eps, position="rope",
        rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
        mlp="swiglu", qkv_bias=False, bias=False)

  @classmethod
  def for_target(cls, target: TransformerConfig,
                 feature_layers: tuple[int, ...] | None = None,
                 draft_vocab_size: int | None = None,
                 fc_norm: bool = False) -> "EagleConfig":
    """A head of the target's width, heads and MLP size (SpecForge's
    default for a new head)."""
    if feature_layers is None:
      feature_layers = default_feature_layers(target.num_layers)
    return cls(hidden_size=target.d_model, intermediate_size=target.d_ff,
               num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
               head_dim=target.head_dim, vocab_size=target.vocab_size,
               draft_vocab_size=draft_vocab_size or target.vocab_size,
               target_hidden_size=target.d_model,
               feature_layers=tuple(feature_layers), fc_norm=fc_norm,
               dtype=target.dtype)


class EagleHead(nn.Module):
  """The head's parameters, named as the published tensors (q/k/v and
  gate/up fused, one matmul each), and its computations (module docstring):
  `fuse`, `embed`, `__call__` (the layer over a run of pairs) and
  `draft_logits`."""

  config: EagleConfig

  def setup(self):
    c = self.config
    rms = lambda: RMSNorm(c.rms_norm_eps, c.dtype)
    linear = lambda features: Linear(features, c.dtype, use_bias=False)
    if c.fc_norm:
      self.fc_norm = [rms() for _ in c.feature_layers]
    self.fc = linear(c.hidden_size)
    if c.own_embedding:
      self.embed_tokens = Embed(c.vocab_size, c.hidden_size, c.dtype)
    self.input_layernorm, self.hidden_norm = rms(), rms()
    self.qkv = linear((c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
    self.o_proj = linear(c.hidden_size)
    self.post_attention_layernorm = rms()
    self.mlp_in = linear(2 * c.intermediate_size)  # gate, then up
    self.down_proj = linear(c.hidden_size)
    self.norm = rms()
    self.lm_head = linear(c.draft_vocab_size)

  def fuse(self, features: tuple[jax.Array, ...]) -> jax.Array:
    """[B, T, H] hidden inputs from the feature layers' [B, T, H_t] each."""
    features = [f.astype(self.config.dtype) for f in features]
    if self.config.fc_norm:
      features = [norm(f) for norm, f in zip(self.fc_norm, features)]
    return self.fc(jnp.concatenate(features, axis=-1))

  def embed(self, tokens: jax.Array, target_table: jax.Array) -> jax.Array:
    """[B, T, H] rows of tokens [B, T]: the head's table, or the target's."""
    if self.config.own_embedding:
      return self.embed_tokens(tokens)
    return jnp.take(target_table, tokens, axis=0).astype(self.config.dtype)

  def __call__(self, embedded, hidden, positions, slots, visible, keys,
               values):
    """embedded, hidden [B, T, H] (the pair's token and hidden input);
    positions and slots [B, T]; visible [B, T, S]; keys and values of the
    head's cache [B, K, S, Dh]. Returns the pre-norm output a [B, T, H],
    what lm_head reads (norm(a), or a without norm_output), and the keys
    and values with these slots written."""
    c, attention = self.config, self.config.attention
    normed_hidden = self.hidden_norm(hidden)
    residual = normed_hidden if c.norm_before_residual else hidden
    x = jnp.concatenate([self.input_layernorm(embedded), normed_hidden], -1)
    q, k, v = _split_qkv(attention, self.qkv(x))
    inv_freq = rope_frequencies(attention)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions,
                                                          inv_freq)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, Dh]
    keys, values = write(keys, k, slots), write(values, v, slots)
    a = residual + self.o_proj(_attend(attention, q, keys, values, k, v, slots,
                                       visible, written=True))
    gate, up = jnp.split(self.mlp_in(self.post_attention_layernorm(a)), 2, -1)
    a = a + self.down_proj(nn.silu(gate) * up)
    return a, self.norm(a) if c.norm_output else a, keys, values

  def draft_logits(self, normed: jax.Array) -> jax.Array:
    """[..., K] float32 logits over the draft vocabulary."""
    return self.lm_head(normed).astype(jnp.float32)

  def init_all(self, features, tokens, table, keys, values):
    """Touches every parameter (for `init`)."""
    positions = jnp.zeros(tokens.shape, jnp.int32)
    _, normed, _, _ = self(self.embed(tokens, table), self.fuse(features),
                           positions, positions,
                           visible_slots(positions, keys.shape[2]), keys,
                           values)
    return self.draft_logits(normed)


def init_params(config: EagleConfig, key: jax.Array,
                target: Model | None = None,
                vocab_ids: jax.Array | None = None) -> dict:
  """Random parameters. With `target`, lm_head starts as the target's
  output rows of the draft vocabulary (`vocab_ids`, None for all), so that
  the head starts as "predict the target's last hidden state" instead of
  learning an output layer from scratch: with little data, that is most of
  what it can learn."""
  features = tuple(jnp.zeros((1, 1, config.target_hidden_size), config.dtype)
                   for _ in config.feature_layers)
  cache = init_cache(config.attention, 1, 1)
  table = jnp.zeros((config.vocab_size, config.hidden_size), config.dtype)
  params = EagleHead(config).init(
      key, features, jnp.zeros((1, 1), jnp.int32), table, cache.keys[0],
      cache.values[0], method=EagleHead.init_all)["params"]
  if target is None:
    return params
  rows = target.output_kernel if vocab_ids is None else (
      target.output_kernel[vocab_ids])
  return {**params, "lm_head": {"kernel": jnp.asarray(rows, config.dtype)}}


@flax.struct.dataclass
class EagleState:
  """The head's per-row state between cycles.

  cache: its one layer's keys and values; `lengths` is the pointer H.
  features: [B, S, H] fused target features by position (fc applied),
    valid below the target's own cache pointer.
  """

  cache: KVCache
  features: jax.Array


def _tree_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """x [B, N, ...] gathered at index [B, M] along axis 1."""
  index = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=1)


@flax.struct.dataclass
class EagleDrafter:
  """An EAGLE-3 head drafting for `target`, in chains of gamma or, with a
  `template`, in trees of its shape (children drawn from q without
  replacement, the head's cache under the tree mask).

  vocab_ids: [K] int32 ascending, the target ids of the draft vocabulary;
    None when it is the whole vocabulary.
  """

  target: Model
  params: dict
  config: EagleConfig = flax.struct.field(pytree_node=False)
  vocab_ids: jax.Array | None = None
  template: TreeTemplate | None = flax.struct.field(pytree_node=False,
                                                    default=None)

  proposes_fewer = False  # always gamma drafts, or the template's tree

  def __post_init__(self):
    if self.template is not None and not isinstance(self.template,
                                                    TreeTemplate):
      object.__setattr__(self, "template", TreeTemplate(self.template))

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def target_layers(self) -> tuple[int, ...]:
    return self.config.feature_layers

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  def with_tree(self, template) -> "EagleDrafter":
    """The same head, proposing trees of `template`'s shape (None: chains)."""
    return self.replace(template=template)

  def validate(self, target: Model, max_len: int) -> None:
    del max_len  # rotary positions: no table to outgrow
    check_vocabulary(self.vocab_size, target)
    if self.config.target_hidden_size != target.config.d_model:
      raise ValueError(
          f"the EAGLE head reads features {self.config.target_hidden_size} "
          f"wide, but the target's d_model is {target.config.d_model}: load "
          "the head with the target it was trained for.")
    if (min(self.target_layers) < 0
        or max(self.target_layers) > target.config.num_layers):
      raise ValueError(f"feature layers {self.target_layers}: the target has "
                       f"blocks 0..{target.config.num_layers - 1} (and "
                       f"{target.config.num_layers}, the last one's output).")
    if self.template and (max(self.template.branching)
                          > self.config.draft_vocab_size):
      raise ValueError(
          f"branching={self.template.branching}: a node cannot have more "
          f"distinct children than the head's {self.config.draft_vocab_size} "
          "draft tokens.")

  def cycle_shape(self, gamma: int) -> tuple[int, int]:
    if self.template is None:
      return gamma, gamma  # a chain
    return self.template.num_nodes, self.template.depth

  def describe(self) -> str:
    c = self.config
    shape = ("" if self.template is None else
             f", tree {self.template.branching} "
             f"({self.template.num_nodes} nodes)")
    return (f"EAGLE-3 head, features of layers {self.target_layers}, "
            f"{c.draft_vocab_size} of {c.vocab_size} tokens{shape}, "
            f"{self.num_params:,} params")

  def _apply(self, method, *args):
    return EagleHead(self.config).apply({"params": self.params}, *args,
                                        method=method)

  def logits(self, normed: jax.Array) -> jax.Array:
    """float32 logits [..., V] from the head's normed output: the draft
    vocabulary's scattered into the full one, -inf (q = 0) elsewhere."""
    logits = self._apply(EagleHead.draft_logits, normed)
    if self.vocab_ids is None:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.vocab_size,), -jnp.inf)
    return full.at[..., self.vocab_ids].set(logits)

  def _run(self, tokens, hidden, positions, cache: KVCache, parents=None):
    """The layer over pairs (hidden [B, T, H], tokens [B, T]) at positions
    [B, T]: a chain written at its positions, or with parents a tree
    written one node after another from the first's slot. Returns (a,
    logits [B, T, V], cache with them written)."""
    num_slots = cache.keys[0].shape[2]
    slots = (positions if parents is None
             else positions[:, :1] + jnp.arange(positions.shape[1]))
    a, normed, keys, values = self._apply(
        EagleHead.__call__,
        self._apply(EagleHead.embed, tokens,
                    self.target.params["embed"]["embedding"]),
        hidden, positions, slots, visible_slots(slots, num_slots, parents),
        cache.keys[0], cache.values[0])
    return a, self.logits(normed), cache.replace(keys=(keys,),
                                                 values=(values,))

  def _pairs(self, features, tokens, lengths, positions):
    """The pairs (f_p, x_{p+1}) at positions [B, T]: hidden [B, T, H] and
    tokens [B, T]; (0, x_0) at position 0 of a one-token row."""
    hidden = _tree_rows(features, jnp.clip(positions, 0,
                                           features.shape[1] - 1))
    next_tokens = jnp.take_along_axis(tokens, positions + 1, 1, mode="clip")
    alone = (lengths[:, None] == 1) & (positions == 0)
    return (jnp.where(alone[..., None], 0, hidden).astype(self.config.dtype),
            jnp.where(alone, tokens[:, :1], next_tokens))

  def prefill(self, prompts, prompt_lengths, max_len, hidden) -> EagleState:
    """Fuses the prompts' features and runs their pairs; the pointer is
    left at the last pair, P - 2, so the first propose reruns it and reads
    the first draft there."""
    features = self._apply(EagleHead.fuse, hidden)  # [B, P, H]
    batch, width = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    pair_hidden, pair_tokens = self._pairs(features, prompts, prompt_lengths,
                                           positions)
    _, _, cache = self._run(pair_tokens, pair_hidden, positions,
                            init_cache(self.config.attention, batch, max_len))
    stored = jnp.zeros((batch, max_len, features.shape[-1]), features.dtype)
    return EagleState(cache.rollback(jnp.maximum(prompt_lengths - 2, 0)),
                      stored.at[:, :width].set(features))

  def _first(self, state: EagleState, tokens, lengths, width: int):
    """Runs pairs H .. H + width - 1 and returns the last pair's output
    (a [B, H], logits [B, V]: the first draft's law), r [B] its position,
    and the cache."""
    start = state.cache.lengths  # [B] H
    positions = start[:, None] + jnp.arange(width)
    hidden, pair_tokens = self._pairs(state.features, tokens, lengths,
                                      positions)
    a, logits, cache = self._run(pair_tokens, hidden, positions, state.cache)
    last = jnp.maximum(lengths - 2, 0)  # r
    index = jnp.maximum(last - start, 0)[:, None]  # 0 for a finished row
    return (_tree_rows(a, index)[:, 0], _tree_rows(logits, index)[:, 0], last,
            cache)

  def _done(self, cache: KVCache, lengths) -> EagleState:
    """The state after drafting: pointer L - 1 (see the module docstring)."""
    return cache.rollback(jnp.maximum(lengths - 1, 0))

  def propose(self, state: EagleState, target_cache, tokens, lengths, key,
              gamma, sampling, max_drafts=None) -> Proposal:
    if self.template is not None:
      return self._propose_tree(state, target_cache, tokens, lengths, key,
                                sampling)
    first_a, first_logits, last, cache = self._first(state, tokens, lengths,
                                                     gamma + 1)
    keys = jax.random.split(key, gamma)

    def draft_step(loop: DraftLoop) -> DraftLoop:
      loop = loop.draw(keys, sampling)
      cache, a = loop.cache
      position = (last + 1 + loop.step)[:, None]
      a, logits, cache = self._run(loop.tokens[:, loop.step, None],
                                   a[:, None], position, cache)
      return loop.replace(step=loop.step + 1, logits=logits[:, 0],
                          cache=(cache, a[:, 0]))

    # As `drafting.propose`: the steps past max_drafts are not run.
    limit = gamma if max_drafts is None else jnp.minimum(gamma, max_drafts)
    start = DraftLoop.start(first_logits, (cache, first_a), gamma)
    loop = jax.lax.while_loop(
        lambda loop: loop.step < limit - 1, draft_step,
        start.replace(drafting=start.drafting & (limit > 0)))
    loop = loop.draw(keys, sampling)
    return Proposal(loop.tokens, loop.probs,
                    EagleState(self._done(loop.cache[0], lengths),
                               state.features), target_cache)

  def _propose_tree(self, state, target_cache, tokens, lengths, key,
                    sampling: Sampling) -> Proposal:
    """A tree of the template's shape, drawn as `draft_tree.draw_tree`
    draws a draft model's: the pass at depth d runs every node of depths
    1..d (each with its parent's output as hidden input) at slots
    r + 1 + node under the tree mask, and its outputs at depth d give their
    children's q."""
    template = self.template
    root_a, root_logits, last, cache = self._first(state, tokens, lengths,
                                                   template.depth + 1)
    node_a = jnp.zeros((lengths.shape[0], template.num_nodes)
                       + root_a.shape[1:], root_a.dtype)

    def expand(carry, nodes, parents):
      cache, node_a = carry
      hidden = jnp.where((parents >= 0)[..., None],
                         _tree_rows(node_a, jnp.maximum(parents, 0)),
                         root_a[:, None])
      depths = template.depths[:nodes.shape[1]]
      a, logits, cache = self._run(nodes, hidden, last[:, None] + depths,
                                   cache, parents=parents)
      return logits, (cache, node_a.at[:, :nodes.shape[1]].set(a))

    tree_tokens, draft_probs, parents, (cache, _) = draw_tree(
        root_logits, expand, (cache, node_a), key, template, sampling)
    return Proposal(tree_tokens, draft_probs,
                    EagleState(self._done(cache, lengths), state.features),
                    target_cache, parents)

  def compact(self, state: EagleState, start, path) -> EagleState:
    """Nothing to move: the head's slots from L - 1 on, where the tree's
    nodes sit, are rewritten from the target's features next cycle; the
    accepted path's features reach `update` in path order (decoding.py)."""
    del start, path
    return state

  def update(self, state: EagleState, cache_lengths, verified) -> EagleState:
    # The pointer moved in propose (see the module docstring).
    del cache_lengths
    features = self._apply(EagleHead.fuse, verified.hidden)  # [B, G+1, H]
    # The verify ran the last token, at the pointer L - 1, then the drafts.
    positions = state.cache.lengths[:, None] + jnp.arange(features.shape[1])
    rows = jnp.arange(features.shape[0])[:, None]
    return state.replace(features=state.features.at[rows, positions].set(
        features, mode="drop"))


@functools.partial(jax.jit, static_argnames="steps")
def greedy_drafts(target: Model, drafter: EagleDrafter, tokens: jax.Array,
                  steps: int) -> tuple[jax.Array, jax.Array]:
  """The head's greedy drafts after a prompt, as the decode loop makes them.

  Args:
    target: the target model.
    drafter: the head (chains; a tree template is ignored).
    tokens: [B, n + 1] int32, rows of equal length: a prompt of n tokens,
      then the token the target emitted after it.
    steps: drafts per row.

  Returns:
    drafts [B, steps] int32 target ids, and logits [B, steps, V] float32,
    the full-vocabulary draft logits (-inf outside the draft vocabulary).
    The head is filled from the target's features over the prompt as a
    decode's prefill and first propose fill it; rows do not affect each
    other.
  """
  batch_size, width = tokens.shape
  prompt_lengths = jnp.full((batch_size,), width - 1, jnp.int32)
  max_len = width + steps
  _, hidden = target.prefill_with_hidden(tokens[:, :-1], prompt_lengths,
                                         max_len, drafter.target_layers)
  state = drafter.prefill(tokens[:, :-1], prompt_lengths, max_len, hidden)
  a, logits, last, cache = drafter._first(  # pylint: disable=protected-access
      state, tokens, prompt_lengths + 1, 2)
  drafts, all_logits = [], []
  for step in range(steps):
    drafts.append(jnp.argmax(logits, -1).astype(jnp.int32))
    all_logits.append(logits)
    if step + 1 < steps:
      a, step_logits, cache = drafter._run(  # pylint: disable=protected-access
          drafts[-1][:, None], a[:, None], (last + 1 + step)[:, None], cache)
      a, logits = a[:, 0], step_logits[:, 0]
  return jnp.stack(drafts, 1), jnp.stack(all_logits, 1)
