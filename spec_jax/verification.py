"""verify: the target scores every proposed token in one pass.

It gives the target's laws p at every draft position (a chain's, or a tree's
nodes under an ancestor mask); the rules in spec_jax/rules/ (`resample`,
`resample_block`, `resample_tree`) then decide from p and q what the cycle
emits. `decoding.verify_and_resample` runs the two together.
"""

import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax.drafting import VerifyOutput
from spec_jax.kv_cache import KVCache
from spec_jax.model import Model
from spec_jax.sampling import Sampling


def tree_depths(parents: jax.Array) -> jax.Array:
  """[B, N] depth of each node below the context's last token (1 for a node
  that hangs from it), from parents [B, N] (see `Proposal`)."""
  depth = jnp.zeros(parents.shape, jnp.int32)
  # Nodes are in topological order, so one pass in node order suffices.
  for node in range(parents.shape[1]):
    parent_depth = jnp.take_along_axis(
        depth, jnp.maximum(parents[:, node:node + 1], 0), 1)[:, 0]
    depth = depth.at[:, node].set(
        jnp.where(parents[:, node] >= 0, parent_depth, 0) + 1)
  return depth


def verify(
    target: Model,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    draft_tokens: jax.Array,
    sampling: Sampling,
    parents: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    write: bool = True,
) -> VerifyOutput:
  """Scores [last, d_1..d_N] in one target pass.

  Args:
    target: the target model.
    cache: valid for each row's first lengths - 1 positions.
    tokens: [B, S] sequences, whose last tokens are at lengths - 1.
    lengths: [B] sequence lengths.
    draft_tokens: [B, N] drafts: a chain, or a tree's nodes when parents is
      given.
    sampling: the transform that turns target logits into p.
    parents: None for a chain; for a tree, [B, N] int32 parent of each node
      (-1: the context's last token). Each node is then scored under an
      ancestor-or-self mask at position lengths - 1 + its depth, so p at node
      i is the target's law given the context and i's own path.
    hidden_layers: the target blocks whose inputs to return (see
      `Transformer.__call__`), for drafters that read the target's features.
    write: False leaves the N+1 tokens' keys and values unwritten: the
      output's cache is then their `PendingWrite`.

  Returns:
    p_1..p_{N+1} [B, N+1, V] float32 (p at the last token, then at each
    draft), the cache written for the N+1 tokens, and the hidden states.
  """
  last = jnp.take_along_axis(tokens, lengths[:, None] - 1, 1)  # [B, 1]
  inputs = jnp.concatenate([last, draft_tokens], axis=1)  # [B, N+1]
  if parents is None:
    offsets = jnp.arange(inputs.shape[1])
    call_parents = None
  else:
    offsets = jnp.pad(tree_depths(parents), ((0, 0), (1, 0)))
    # Among the call's tokens the last token is 0, node j is j + 1; the last
    # token itself hangs from the cached context (-1).
    call_parents = jnp.pad(jnp.where(parents >= -1, parents + 1, -1),
                           ((0, 0), (1, 0)), constant_values=-1)
  positions = lengths[:, None] - 1 + offsets
  logits, cache, hidden = target.forward(inputs, cache, positions,
                                         parents=call_parents,
                                         hidden_layers=hidden_layers,
                                         write=write)
  return VerifyOutput(sampling.probs(logits), cache, hidden)


def verify_widths(gamma: int, buckets: int) -> tuple[int, ...]:
  """The verify passes a chain cycle may run, in tokens (the last token and
  the drafts): gamma + 1 alone for 1 bucket; otherwise `buckets` widths
  spread evenly from 1 (a plain target step) to gamma + 1, so 3 buckets
  add gamma // 2 + 1, and gamma + 1 buckets or more give every width."""
  if buckets == 1:
    return (gamma + 1,)
  buckets = min(buckets, gamma + 1)
  return tuple(1 + j * gamma // (buckets - 1) for j in range(buckets))


def verify_proposed(
    target: Model,
    cache: KVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    active: jax.Array,
    sampling: Sampling,
    widths: tuple[int, ...],
    hidden_layers: tuple[int, ...] = (),
) -> tuple[VerifyOutput, jax.Array]:
  """`verify` over the narrowest of `widths` that holds every active row's
  proposal, so that a cycle in which nothing was proposed (prompt lookup
  without a match, dynamic gamma stopped at once) costs a target step, not
  a gamma + 1 verify.

  A row proposes its leading drafts with q > 0 (see rules/token.py); past them
  it is rejected, so only p up to its first unproposed position is read.
  Positions past the pass's width, which no active row reaches, repeat the
  last law computed. The output law is unchanged.

  With several widths, each branch of the switch leaves its keys and values
  unwritten and one write after the switch commits them, padded to G + 1:
  XLA copies every cache array a branch writes, on every cycle (at batch 8
  a cycle of prompt lookup that proposed nothing cost 1.58 AR steps with the
  copies, 1.09 without). A single width is one pass that writes before it
  attends. Where the small-row kernel serves, both give the steps' logits
  bit for bit (attention.py).

  Args:
    draft_tokens, draft_probs: [B, G], [B, G, V], the chain's proposal.
    active: [B] bool, rows still generating.
    widths: increasing pass widths ending with G + 1 (`verify_widths`).

  Returns:
    The VerifyOutput, with probs [B, G+1, V] and hidden [B, G+1, D], and the
    index of the width that ran, [] int32.
  """
  gamma = draft_tokens.shape[1]
  proposed = (sampling_lib.probs_at(draft_probs, draft_tokens) > 0) & active[
      :, None]
  longest = jnp.cumprod(proposed, axis=1).sum(1).max()  # leading drafts
  index = jnp.searchsorted(jnp.array(widths), longest + 1).astype(jnp.int32)

  write = len(widths) == 1

  def pass_of(width):
    def run(draft_tokens):
      verified = verify(target, cache, tokens, lengths,
                        draft_tokens[:, :width - 1], sampling,
                        hidden_layers=hidden_layers, write=write)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, gamma + 1 - width), (0, 0)),
                              mode="edge")
      return VerifyOutput(
          pad(verified.probs),
          verified.cache if write else verified.cache.pad(gamma + 1),
          tuple(map(pad, verified.hidden)))
    return run

  verified = jax.lax.switch(index, [pass_of(w) for w in widths], draft_tokens)
  if not write:
    verified = verified.replace(cache=target.commit(cache, verified.cache))
  return verified, index
