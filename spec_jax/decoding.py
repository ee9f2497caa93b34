"""The decode loops: speculative (propose -> verify -> resample) and plain.

Each is one jitted program: a prefill, then a `lax.while_loop` that runs until
every row has emitted EOS or `max_new_tokens`. Rows advance by different
amounts per cycle; a finished row keeps its outputs while the others go on.

Every row's state obeys one invariant between iterations: `tokens[b, :L]` is
its sequence (L = lengths[b]) and both caches hold valid keys and values for
its first L - 1 tokens; the last token is fed by the next step. (Plain target
steps under a draft-length policy leave a catching-up drafter's cache behind,
and empty it for a row they refill; its next `propose` restores the
invariant before drafting.)

A tree drafter's cycle verifies the whole tree in one pass and accepts a
root-to-node path of it (`rules.resample_tree`); both caches then move that
path's keys and values next to the context (`KVCache.compact`), so that the
same invariant holds and rollback stays a pointer move.

`speculative_cycle` is the cycle itself (propose, then `verify_and_resample`:
verify and the rule, a tree's compaction, then `Cycle.advance`); the loop
around it only emits tokens and counts, and the harness times this same
function.
"""

import dataclasses
import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import draft_length, refill, rules, sharding
from spec_jax.draft_length import AdaptiveDraftLength, CycleCosts
from spec_jax.drafting import DraftState, Drafter, Proposal, VerifyOutput
from spec_jax.kv_cache import KVCache
from spec_jax.model import Model
from spec_jax.refill import Queue
from spec_jax.sampling import Sampling
from spec_jax.stats import DecodeStats
from spec_jax.verification import verify, verify_proposed, verify_widths

# Output slots past a row's end hold this value.
PAD_ID = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Static settings of one decode; changing one compiles a new program.

  gamma: drafts per cycle (ignored by the autoregressive loop, and by a tree
    drafter, whose template fixes its drafts).
  max_new_tokens: the most tokens a row emits after its prompt.
  sampling: temperature, top-k and top-p, applied to p and q alike.
  eos_id: a stop id, or several (chat models often have more than one); a
    row stops after emitting any of them. None never stops early.
  resample: the rejection rule, any function with `rules.resample`'s
    contract. The default is exact; tests pass a deliberately wrong one here
    as a negative control.
  resample_tree: the same for a tree drafter's proposals, any function with
    `rules.resample_tree`'s contract.
  verify_buckets: how many verify widths a chain cycle chooses from, by the
    longest proposal in the batch (`verification.verify_widths`): 1 always
    verifies gamma + 1 tokens; 2 adds a plain target step for cycles in which
    no row proposed anything; 3 adds gamma // 2 + 1, and more spread the
    widths evenly in between (gamma + 1 or more: every width). Each width is compiled into the
    loop; the output law does not depend on it. Only for drafters
    that can propose fewer than gamma drafts (`Drafter.proposes_fewer`), or
    under a draft-length policy.
  adaptive: a draft-length policy (`draft_length.AdaptiveDraftLength`):
    each cycle drafts the K in 0..gamma that maximises the expected tokens
    per unit cost, from the rows' acceptance so far and the `CycleCosts`
    given to `generate`. None drafts gamma every cycle.
  """

  gamma: int = 4
  max_new_tokens: int = 64
  sampling: Sampling = Sampling()
  eos_id: int | tuple[int, ...] | None = None
  resample: Callable = rules.resample
  resample_tree: Callable = rules.resample_tree
  verify_buckets: int = 2
  adaptive: AdaptiveDraftLength | None = None

  def __post_init__(self):
    if self.gamma < 1:
      raise ValueError(f"gamma={self.gamma}: need at least one draft token.")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
    if self.verify_buckets < 1:
      raise ValueError(f"verify_buckets={self.verify_buckets}: need at least "
                       "1 verify width.")
    if self.eos_id is not None and not isinstance(self.eos_id, int):
      object.__setattr__(self, "eos_id", tuple(int(i) for i in self.eos_id))

  @property
  def stop_ids(self) -> tuple[int, ...]:
    if self.eos_id is None:
      return ()
    return (self.eos_id,) if isinstance(self.eos_id, int) else self.eos_id


@flax.struct.dataclass
class DecodeResult:
  tokens: jax.Array  # [P, max_new_tokens] int32, PAD_ID past num_tokens.
  num_tokens: jax.Array  # [P] int32 tokens emitted per prompt.
  # Rows per prompt; None for autoregressive decoding.
  stats: DecodeStats | None = None


@flax.struct.dataclass
class DecodeState:
  """The while-loop carry."""

  tokens: jax.Array  # [B, S] prompt then output; slots >= lengths are scratch.
  lengths: jax.Array  # [B] sequence lengths.
  prompt_lengths: jax.Array  # [B] where each row's output starts.
  done: jax.Array  # [B] bool, the row has finished.
  target_cache: KVCache
  draft_state: DraftState
  key: jax.Array
  stats: DecodeStats | None
  # The prompts still to decode, when there are more than rows (refill.py).
  queue: Queue | None = None
  # The draft-length policy's plan for the next cycle (None without one),
  # made once per loop iteration, after its refill (`loop_cycle`).
  plan: draft_length.Plan | None = None


def _emit(
    state: DecodeState,
    new_tokens: jax.Array,
    num_new: jax.Array,
    config: DecodeConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Appends up to num_new [B] of new_tokens [B, T] to each unfinished row.

  A row stops at its first EOS (kept) or at max_new_tokens.
  Returns the new tokens, lengths and done.
  """
  slot = jnp.arange(new_tokens.shape[1])
  room = config.max_new_tokens - (state.lengths - state.prompt_lengths)
  count = jnp.minimum(num_new, room)
  hit_eos = jnp.zeros_like(state.done)
  if config.stop_ids:
    is_eos = (jnp.isin(new_tokens, jnp.array(config.stop_ids))
              & (slot < count[:, None]))
    hit_eos = is_eos.any(-1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, -1) + 1, count)
  count = jnp.where(state.done, 0, count)
  # Slots beyond count go to an out-of-range index and are dropped.
  index = jnp.where(slot < count[:, None], state.lengths[:, None] + slot,
                    state.tokens.shape[1])
  rows = jnp.arange(new_tokens.shape[0])[:, None]
  tokens = state.tokens.at[rows, index].set(new_tokens, mode="drop")
  lengths = state.lengths + count
  done = (state.done | hit_eos
          | (lengths - state.prompt_lengths >= config.max_new_tokens))
  return tokens, lengths, done


def _outputs(state: DecodeState, config: DecodeConfig):
  """[B, max_new_tokens] each row's outputs so far, and their counts [B]."""
  slot = jnp.arange(config.max_new_tokens)
  index = state.prompt_lengths[:, None] + slot
  num_tokens = state.lengths - state.prompt_lengths
  tokens = jnp.take_along_axis(state.tokens, index, 1, mode="clip")
  return jnp.where(slot < num_tokens[:, None], tokens, PAD_ID), num_tokens


@flax.struct.dataclass
class Cycle:
  """One propose -> verify -> resample cycle of every row, before the loop
  emits its tokens and counts it (`speculative_cycle`)."""

  tokens: jax.Array  # [B, T] the accepted drafts, then the correction/bonus.
  num_accepted: jax.Array  # [B]
  # What was proposed (its probs and parents feed the statistics) and what
  # the target computed over it (its hidden states feed `drafter.update`).
  proposal: Proposal
  verified: VerifyOutput
  width: jax.Array  # [] int32, the index of the verify width that ran.
  path: jax.Array | None  # [B, D] a tree's accepted nodes, -1 past its end.
  target_cache: KVCache  # accepted drafts in place; the pointer not moved.
  draft_state: DraftState  # the same, before `drafter.update`.

  def advance(self, drafter: Drafter,
              lengths: jax.Array) -> tuple[KVCache, DraftState]:
    """Both caches once each row's sequence has lengths [B] tokens: every
    token but the last (see the module docstring)."""
    return (self.target_cache.rollback(lengths - 1),
            drafter.update(self.draft_state, lengths - 1, self.verified))


def loop_verify_widths(drafter: Drafter,
                       config: DecodeConfig) -> tuple[int, ...]:
  """The verify widths the loop chooses from: config.verify_buckets of them
  for a drafter that proposes fewer than gamma drafts in some cycles (or
  under a draft-length policy); for one that always proposes gamma, the
  full width only, so that no unused narrow pass (and its switch, measured
  at 3-8% of the loop) is compiled in."""
  fewer = drafter.proposes_fewer or config.adaptive is not None
  return verify_widths(config.gamma, config.verify_buckets if fewer else 1)


def _resample_chain(key, target, drafter, proposal, tokens, lengths, active,
                    config) -> Cycle:
  """Verifies a chain and accepts a prefix of it (`config.resample`)."""
  sampling = config.sampling
  with jax.named_scope("verify"):
    verified, width = verify_proposed(
        target, proposal.target_cache, tokens, lengths, proposal.tokens,
        proposal.probs, active, sampling, loop_verify_widths(drafter, config),
        hidden_layers=drafter.target_layers)
  with jax.named_scope("resample"):
    new_tokens, num_accepted = config.resample(
        key, proposal.tokens, proposal.probs, verified.probs,
        greedy=sampling.greedy)
  # Draft i sits at slot lengths - 1 + i already: nothing to move.
  return Cycle(new_tokens, num_accepted, proposal, verified, width, None,
               verified.cache, proposal.state)


def _resample_tree(key, target, drafter, proposal, tokens, lengths,
                   config) -> Cycle:
  """Verifies a tree in one pass, accepts a root-to-node path of it
  (`config.resample_tree`) and compacts both caches onto that path."""
  sampling = config.sampling
  with jax.named_scope("verify"):
    verified = verify(target, proposal.target_cache, tokens, lengths,
                      proposal.tokens, sampling, parents=proposal.parents,
                      hidden_layers=drafter.target_layers)
  with jax.named_scope("resample"):
    new_tokens, num_accepted, path = config.resample_tree(
        key, proposal.tokens, proposal.parents, proposal.probs,
        verified.probs, greedy=sampling.greedy,
        depth=drafter.cycle_shape(config.gamma)[1])
  # A tree is verified whole: counted as the widest pass.
  width = jnp.int32(len(loop_verify_widths(drafter, config)) - 1)
  # Node j sits at slot lengths + j in both caches (the last token at
  # lengths - 1); the path moves to lengths, lengths + 1, ... The hidden
  # states move with it, so `drafter.update` reads them as a chain's.
  with jax.named_scope("compact"):
    on_path = jnp.concatenate([jnp.zeros_like(path[:, :1]), path + 1],
                              1)  # [B, D+1]
    hidden = tuple(jnp.take_along_axis(h, on_path[..., None], 1)
                   for h in verified.hidden)
    return Cycle(new_tokens, num_accepted, proposal,
                 verified.replace(hidden=hidden), width, path,
                 verified.cache.compact(lengths, path),
                 drafter.compact(proposal.state, lengths, path))


def verify_and_resample(key, target: Model, drafter: Drafter,
                      proposal: Proposal, tokens, lengths, active,
                      config: DecodeConfig) -> Cycle:
  """The verify and rejection half of a cycle: the target scores a
  proposal (a chain, or a tree when it has parents) and the decode's rule
  keeps what the output law allows.

  Args:
    key: PRNG key of the rejection step.
    proposal: what `drafter.propose` returned this cycle.
    tokens: [B, S] every row's sequence; lengths: [B] their lengths.
    active: [B] bool, the rows still generating (a chain's verify width is
      chosen from theirs).
  """
  if proposal.parents is None:
    return _resample_chain(key, target, drafter, proposal, tokens, lengths,
                           active, config)
  return _resample_tree(key, target, drafter, proposal, tokens, lengths,
                        config)


def speculative_cycle(propose_key, resample_key, target: Model,
                      drafter: Drafter, draft_state: DraftState,
                      target_cache: KVCache, tokens, lengths, active,
                      config: DecodeConfig, max_drafts=None) -> Cycle:
  """One propose -> verify -> resample cycle of every row, as the decode
  loop runs it; `Cycle.advance` then moves both caches past what the row
  kept. The loop adds only emitting the tokens and counting the cycle, and
  the harness's timer runs this same function.

  Args:
    propose_key, resample_key: PRNG keys of the draft and of the rule.
    draft_state, target_cache: both caches, holding every token of each
      row's sequence but the last.
    tokens: [B, S] every row's sequence; lengths: [B] their lengths.
    active: [B] bool, the rows still generating.
    max_drafts: [] int32, this cycle's draft limit under a draft-length
      policy; None drafts gamma (and is all a tree drafter takes).
  """
  limit = {} if max_drafts is None else {"max_drafts": max_drafts}
  with jax.named_scope("propose"):
    proposal = drafter.propose(draft_state, target_cache, tokens, lengths,
                               propose_key, config.gamma, config.sampling,
                               **limit)
  return verify_and_resample(resample_key, target, drafter, proposal, tokens,
                           lengths, active, config)


def _count(stats: DecodeStats, cycle: Cycle, active, limit) -> DecodeStats:
  """The cycle's counts added to the run's."""
  proposal = cycle.proposal
  overlap = rules.overlap(proposal.probs, cycle.verified.probs)
  point_mass = rules.point_mass_acceptance(proposal.probs,
                                           cycle.verified.probs)
  if cycle.path is None:
    stats = stats.record_cycle(
        active=active,
        proposed=rules.draft_token_probs(proposal.tokens, proposal.probs) > 0,
        num_accepted=cycle.num_accepted, overlap=overlap,
        point_mass=point_mass)
  else:
    # Contexts on the accepted path: the root (0) and node path[i] (i + 1).
    context = jnp.arange(proposal.probs.shape[1])
    on_path = (context == 0) | jnp.any(
        cycle.path[..., None] + 1 == context, axis=1)  # [B, N+1]
    stats = stats.record(
        active=active, drafted=proposal.parents != rules.UNUSED,
        verified=on_path & (proposal.probs.sum(-1) > 0),
        num_accepted=cycle.num_accepted, overlap=overlap,
        point_mass=point_mass,
        tried=jnp.arange(cycle.path.shape[1]) <= cycle.num_accepted[:, None])
  return stats.count_width(cycle.width, limit)


def speculative_step(state: DecodeState, target: Model, drafter: Drafter,
                     config: DecodeConfig) -> DecodeState:
  """The decode loop's cycle for every row, with the draft length the
  state's plan gives (under a policy), its tokens emitted and counted."""
  key, propose_key, resample_key = jax.random.split(state.key, 3)
  active = ~state.done
  # The draft limit counted: gamma (a tree's depth) unless a policy chose.
  max_drafts, limit = None, drafter.cycle_shape(config.gamma)[1]
  if config.adaptive is not None:
    max_drafts = limit = _drafts(state, config)
  cycle = speculative_cycle(propose_key, resample_key, target, drafter,
                            state.draft_state, state.target_cache,
                            state.tokens, state.lengths, active, config,
                            max_drafts)
  tokens, lengths, done = _emit(state, cycle.tokens, cycle.num_accepted + 1,
                                config)
  target_cache, draft_state = cycle.advance(drafter, lengths)
  return state.replace(tokens=tokens, lengths=lengths, done=done,
                       target_cache=target_cache, draft_state=draft_state,
                       key=key, stats=_count(state.stats, cycle, active,
                                             limit))


def with_plan(state: DecodeState, drafter: Drafter | None,
              config: DecodeConfig, costs: CycleCosts | None) -> DecodeState:
  """The state with the draft-length policy's plan from its counts (as it
  is without a policy)."""
  if drafter is None or config.adaptive is None:
    return state
  decoded = None if state.queue is None else state.queue.stats
  return state.replace(plan=draft_length.plan(
      config.adaptive, state.stats, decoded, ~state.done, costs,
      loop_verify_widths(drafter, config), config.gamma,
      _runs_plain_steps(drafter, config)))


def _drafts(state: DecodeState, config: DecodeConfig) -> jax.Array:
  """The draft-length policy's K for the next cycle, [] int32."""
  return state.plan.drafts_at(config.adaptive, state.stats.cycles + 1,
                              config.gamma)


def _runs_plain_steps(drafter: Drafter | None, config: DecodeConfig) -> bool:
  """Whether the loop runs a cycle of no drafts as a plain target step,
  without the drafter: under a draft-length policy, for a drafter that
  catches up on what it missed (drafting.py's `catches_up`)."""
  return (drafter is not None and config.adaptive is not None
          and getattr(drafter, "catches_up", False))


def _plain_step(state: DecodeState, target: Model,
                config: DecodeConfig) -> DecodeState:
  """A cycle of no drafts run without the drafter: one target step, counted
  as a cycle that verified one token. The drafter's state stays behind until
  its next `propose` catches up (`Drafter.catches_up`)."""
  stats = state.stats.record_plain_step(~state.done)
  return _autoregressive_step(state, target, config).replace(stats=stats)


def _plain_steps(state: DecodeState, target: Model,
                 config: DecodeConfig) -> DecodeState:
  """Plain steps from a state whose plan drafts nothing, until a row
  finishes or an explore cycle falls due. A plain step moves no acceptance
  count and no row in or out, so K* stays 0 in between; choosing again
  each step (some fifty small ops) made the loop 4-7% slower than AR's at
  batch 8."""
  running = ~state.done
  more = lambda s: ~jnp.any(s.done & running) & ~state.plan.explores(
      config.adaptive, s.stats.cycles + 1)
  step = lambda s: _plain_step(s, target, config)
  return jax.lax.while_loop(more, step, step(state))


def _autoregressive_step(state: DecodeState, target: Model,
                         config: DecodeConfig) -> DecodeState:
  key, sample_key = jax.random.split(state.key)
  positions = state.lengths[:, None] - 1
  last = jnp.take_along_axis(state.tokens, positions, 1)  # [B, 1]
  logits, cache = target(last, state.target_cache, positions)
  token = config.sampling.sample(sample_key, config.sampling.probs(logits))
  tokens, lengths, done = _emit(state, token, jnp.ones_like(state.lengths),
                                config)
  return state.replace(tokens=tokens, lengths=lengths, done=done, key=key,
                       target_cache=cache.rollback(lengths - 1))


def _prefill(target: Model, drafter: Drafter | None, prompts, prompt_lengths,
             max_len: int) -> tuple[jax.Array, KVCache, DraftState]:
  """Fresh rows for prompts [B, W]: the token buffer [B, max_len] holding
  them, the target's cache and the drafter's state (None without one)."""
  tokens = jnp.pad(prompts, ((0, 0), (0, max_len - prompts.shape[1])))
  if drafter is None:
    return tokens, target.prefill(prompts, prompt_lengths, max_len), None
  target_cache, hidden = target.prefill_with_hidden(
      prompts, prompt_lengths, max_len, drafter.target_layers)
  return tokens, target_cache, drafter.prefill(prompts, prompt_lengths,
                                               max_len, hidden)


def _initial_state(key, target, drafter, prompts, prompt_lengths, config,
                   slots: int) -> DecodeState:
  """The first `slots` prompts prefilled into the rows, the others queued;
  the buffer's scratch tail holds a cycle's whole verify pass (N + 1 slots
  past any row's last output; 1 for a plain decode)."""
  num_prompts = prompts.shape[0]
  if drafter is None:
    scratch, stats = 1, lambda rows: None
  else:
    num_nodes, depth = drafter.cycle_shape(config.gamma)
    num_widths = len(loop_verify_widths(drafter, config))
    scratch = num_nodes + 1
    stats = lambda rows: DecodeStats.zeros(rows, depth, num_widths)
  max_len = prompts.shape[1] + config.max_new_tokens + scratch
  queue = None
  if slots < num_prompts:
    queue = Queue.start(prompts, prompt_lengths, slots,
                        config.max_new_tokens, stats(num_prompts))
    prompts, prompt_lengths = prompts[:slots], prompt_lengths[:slots]
  tokens, target_cache, draft_state = _prefill(target, drafter, prompts,
                                               prompt_lengths, max_len)
  return DecodeState(
      tokens=tokens, lengths=prompt_lengths, prompt_lengths=prompt_lengths,
      done=jnp.zeros(prompt_lengths.shape, bool), target_cache=target_cache,
      draft_state=draft_state, key=key, stats=stats(prompts.shape[0]),
      queue=queue)


def _next_prompts(state: DecodeState, target: Model, drafter: Drafter | None,
                  config: DecodeConfig, plain: bool = False) -> DecodeState:
  """Finished rows' outputs stored, and freed rows refilled from the queue.

  plain: the loop is running plain steps (`_plain_steps`), which leave a
  drafter that catches up behind. A row refilled then gets an empty draft
  state instead of a draft prefill; the next cycle that drafts feeds it the
  prompt with the tokens since, in the catch-up passes it runs for every
  row together (up to prompt length / 7 more of them). The one-row draft
  prefill per refill (0.6 ms against a batch-16 step of about 4 ms for the
  built-in pair, about 1% of a refilled plain decode) bought a cache that
  a decode drafting nothing more never reads.
  """
  def store(state):
    queue, stats = state.queue.flush(state.done, *_outputs(state, config),
                                     state.stats)
    return state.replace(queue=queue, stats=stats)

  def prefill_row(state, row, prompt, length):
    tokens, target_cache, draft_state = _prefill(
        target, None if plain else drafter, prompt, length,
        state.tokens.shape[1])
    put = lambda batch, one: refill.put_row(batch, row, one)
    draft_state = (_emptied(state.draft_state, row) if plain
                   else put(state.draft_state, draft_state))
    return state.replace(
        tokens=put(state.tokens, tokens), lengths=put(state.lengths, length),
        prompt_lengths=put(state.prompt_lengths, length),
        done=state.done.at[row].set(False),
        target_cache=put(state.target_cache, target_cache),
        draft_state=draft_state)

  return refill.refill(state, store, prefill_row)


def _emptied(draft_state: KVCache | None, row: jax.Array) -> KVCache | None:
  """A catching-up drafter's state (its own cache, or None) with row `row`
  holding nothing, so that its next `propose` feeds the row's whole
  sequence."""
  if draft_state is None:
    return None
  return draft_state.rollback(draft_state.lengths.at[row].set(0))


def loop_cycle(state: DecodeState, target: Model, drafter: Drafter | None,
               config: DecodeConfig, costs: CycleCosts | None,
               plain: bool = False) -> DecodeState:
  """One iteration of the decode loop's work: a speculative cycle for every
  row (plain: plain target steps, while the plan drafts nothing; without a
  drafter an AR step), the finished rows refilled from the queue, then the
  policy's plan for the next cycle. Made here, once, the plan serves both
  the next cycle's draft length and the loop's test for plain steps. The
  harness times this function."""
  if drafter is None:
    state = _autoregressive_step(state, target, config)
  elif plain:
    state = _plain_steps(state, target, config)
  else:
    state = speculative_step(state, target, drafter, config)
  if state.queue is not None:
    state = _next_prompts(state, target, drafter, config, plain)
  return with_plan(state, drafter, config, costs)


def _decode(key, target, drafter, prompts, prompt_lengths, config, slots,
            costs=None) -> DecodeResult:
  """The decode loop: speculative with a drafter, plain without one."""

  def body(state):
    state = loop_cycle(state, target, drafter, config, costs)
    if _runs_plain_steps(drafter, config):
      # While the policy drafts nothing, plain target steps as AR's, in a
      # loop of their own: no draft pass, no rule, and no conditional
      # (whose branches XLA would copy the caches for, every cycle). Rows
      # finish only in the last of `_plain_steps`' steps, so refilling
      # after it loses nothing.
      state = jax.lax.while_loop(
          lambda s: ~jnp.all(s.done) & (_drafts(s, config) == 0),
          lambda s: loop_cycle(s, target, drafter, config, costs, plain=True),
          state)
    return state

  state = jax.lax.while_loop(
      lambda s: ~jnp.all(s.done), body,
      with_plan(_initial_state(key, target, drafter, prompts, prompt_lengths,
                               config, slots), drafter, config, costs))
  if state.queue is None:
    tokens, num_tokens = _outputs(state, config)
    return DecodeResult(tokens=tokens, num_tokens=num_tokens,
                        stats=state.stats)
  queue = state.queue
  return DecodeResult(
      tokens=queue.tokens, num_tokens=queue.num_tokens,
      stats=None if drafter is None else queue.result_stats(state.stats))


generate_jit = jax.jit(_decode, static_argnames=("config", "slots"))


@functools.partial(jax.jit, static_argnames=("config", "slots"))
def generate_autoregressive_jit(key, target, prompts, prompt_lengths, config,
                                slots):
  return _decode(key, target, None, prompts, prompt_lengths, config, slots)


def check_inputs(
    target: Model,
    prompts,
    prompt_lengths,
    config: DecodeConfig,
    drafter: Drafter | None = None,
) -> None:
  """Raises ValueError, before anything compiles, on inputs that cannot work."""
  prompts = np.asarray(prompts)
  prompt_lengths = np.asarray(prompt_lengths)
  if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
    raise ValueError(
        f"prompts must be [batch, length] with prompt_lengths [batch]; got "
        f"{prompts.shape} and {prompt_lengths.shape}. `pad_prompts` builds both.")
  if prompt_lengths.min() < 1:
    raise ValueError(
        f"row {int(prompt_lengths.argmin())} has an empty prompt; every row "
        "needs at least one token (e.g. a BOS token).")
  if prompt_lengths.max() > prompts.shape[1]:
    raise ValueError(
        f"prompt_lengths up to {prompt_lengths.max()} exceed the padded prompt "
        f"width {prompts.shape[1]}.")
  _check_token_ids(prompts, prompt_lengths, target.vocab_size)
  needed = int(prompt_lengths.max()) + config.max_new_tokens
  if needed > target.config.max_len:
    raise ValueError(
        f"a prompt of {prompt_lengths.max()} tokens plus max_new_tokens="
        f"{config.max_new_tokens} needs {needed} positions, but the target "
        f"model has max_len={target.config.max_len}; shorten the prompt or "
        "lower max_new_tokens.")
  if drafter is not None:
    drafter.validate(target, needed)


def _check_policy(drafter: Drafter, config: DecodeConfig,
                  costs: CycleCosts | None) -> None:
  """Raises ValueError, before compiling, on a draft-length policy that
  cannot run: a tree drafter, or costs missing or not one per width."""
  if config.adaptive is None:
    if costs is not None:
      raise ValueError("costs were given, but only the adaptive draft length "
                       "reads them; set DecodeConfig(adaptive=...).")
    return
  if getattr(drafter, "template", None) is not None:
    raise ValueError(
        f"the adaptive draft length needs a chain drafter; {drafter.describe()}"
        " drafts a tree, whose template fixes its drafts.")
  widths = loop_verify_widths(drafter, config)
  if costs is None or np.shape(costs.verify) != (len(widths),):
    got = None if costs is None else np.shape(costs.verify)
    raise ValueError(
        f"the adaptive draft length needs CycleCosts with one verify cost per "
        f"compiled width {widths}, in target steps; got {got}. "
        "`timing.calibrate_cycle_costs` in the harness measures them.")


def _check_token_ids(prompts: np.ndarray, prompt_lengths: np.ndarray,
                     vocab_size: int) -> None:
  """Raises on a prompt token outside [0, vocab_size): a gather on device
  would clamp it to a valid id and decode silently."""
  in_prompt = np.arange(prompts.shape[1]) < prompt_lengths[:, None]
  bad = in_prompt & ((prompts < 0) | (prompts >= vocab_size))
  if bad.any():
    row, position = (int(i[0]) for i in np.nonzero(bad))
    raise ValueError(
        f"row {row} holds token id {int(prompts[row, position])} at position "
        f"{position}, outside the target's vocabulary [0, {vocab_size}); "
        "encode prompts with the target's tokenizer.")


def _place(key, prompts, prompt_lengths, mesh, slots: int | None) -> tuple:
  """Device arrays and the number of rows: on one device, or split by rows
  over the mesh's data axis with the key replicated, so the sampled tokens
  do not depend on the mesh."""
  num_prompts = len(prompts)
  if slots is not None and slots < 1:
    raise ValueError(f"slots={slots}: decode at least one row at a time.")
  slots = num_prompts if slots is None else min(slots, num_prompts)
  if mesh is None:
    return (key, jnp.asarray(prompts, jnp.int32),
            jnp.asarray(prompt_lengths, jnp.int32), slots)
  if slots < num_prompts:
    raise ValueError(
        f"slots={slots} < {num_prompts} prompts on a mesh: refilling rows is "
        "not sharded yet; decode the prompts in batches of the mesh's rows, "
        "or leave slots unset.")
  sharding.check_batch(num_prompts, mesh)
  return (sharding.put_key(key, mesh),
          sharding.put_batch(np.asarray(prompts, np.int32), mesh),
          sharding.put_batch(np.asarray(prompt_lengths, np.int32), mesh),
          slots)


def generate(
    key: jax.Array,
    target: Model,
    drafter: Drafter,
    prompts,
    prompt_lengths,
    config: DecodeConfig,
    mesh: jax.sharding.Mesh | None = None,
    slots: int | None = None,
    costs: CycleCosts | None = None,
) -> DecodeResult:
  """Speculative decoding whose output law is exactly the target's.

  Args:
    key: PRNG key; the same key and inputs give the same tokens.
    target: the target model.
    drafter: the source of drafts: `ModelDrafter(draft_model)`,
      `LayerSkipDrafter(target, num_layers)`, `NgramDrafter(vocab_size)`,
      `TreeDrafter(draft_model, branching)`, or any class that meets the
      contract of drafting.py.
    prompts: [P, W] int32 right-padded prompts (see `pad_prompts`).
    prompt_lengths: [P] int32 true prompt lengths, >= 1.
    config: gamma, max_new_tokens, sampling and EOS.
    mesh: the mesh the models were sharded over (see sharding.py), if any;
      the batch is split over its data axis.
    slots: the rows decoded at once, B. With B < P the first B prompts
      start, and each row that finishes takes the next prompt inside the
      loop (refill.py). None decodes all P at once.
    costs: a draft pass and each compiled verify width, in target steps at
      this batch size, measured beforehand; what config.adaptive optimises.

  Returns:
    The emitted tokens [P, max_new_tokens], their counts [P] and the
    statistics of the run (rows per prompt), from a single compiled program.
  """
  check_inputs(target, prompts, prompt_lengths, config, drafter)
  _check_policy(drafter, config, costs)
  key, prompts, prompt_lengths, slots = _place(key, prompts, prompt_lengths,
                                               mesh, slots)
  return generate_jit(key, target, drafter, prompts, prompt_lengths, config,
                      slots, costs)


def generate_autoregressive(
    key: jax.Array, target: Model, prompts, prompt_lengths, config: DecodeConfig,
    mesh: jax.sharding.Mesh | None = None, slots: int | None = None,
) -> DecodeResult:
  """The baseline: one target step per token, in its own while_loop; slots
  as in `generate`."""
  check_inputs(target, prompts, prompt_lengths, config)
  # gamma and the rejection rules play no part here; fixing them lets a
  # sweep over gamma compile the baseline once.
  key, prompts, prompt_lengths, slots = _place(key, prompts, prompt_lengths,
                                               mesh, slots)
  return generate_autoregressive_jit(key, target, prompts, prompt_lengths,
                                     dataclasses.replace(
                                         config, gamma=1,
                                         resample=rules.resample,
                                         resample_tree=rules.resample_tree,
                                         verify_buckets=1, adaptive=None),
                                     slots)


def pad_prompts(prompts, min_width: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to [B, P], P a power of two (at least 16).

  Widths fall into a few buckets, so prompts of similar length share one
  compiled program (each new width compiles the decode loop anew); min_width
  gives several batches one width, hence one program.
  Returns int32 prompts [B, P] and lengths [B].
  """
  lengths = np.array([len(p) for p in prompts], np.int32)
  width = max(min_width, int(lengths.max(initial=0)), 16)
  width = 1 << (width - 1).bit_length()
  padded = np.zeros((len(prompts), width), np.int32)
  for row, prompt in zip(padded, prompts):
    row[:len(prompt)] = prompt
  return padded, lengths
