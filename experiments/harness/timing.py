"""All the harness's timing: one wall-clock timer, the interleaved AR/SD
runner, component times measured the way the decode loop runs them, and the
cost ratios they give (`Costs`).

Each component (a draft step, a target step, a verify with its rejection step,
and a whole propose -> verify -> resample cycle) runs n times inside one jitted
`fori_loop`, as it does inside the decode loop: no dispatch per call, caches
updated in place. The verify and the cycle are the engine's own functions
(`decoding.verify_and_resample`, `decoding.speculative_cycle`), so a new rule
or drafter is timed as the loop runs it. A component's time is the slope
(t(n_long) - t(n_short)) / (n_long - n_short), which removes launch and
transfer costs; each t is the median of runs taken in rounds (`RoundTimer`)
after a warm-up call that compiles. The cache pointer is put back after every
iteration so all n calls attend over the same cache; attention reads every
slot regardless of the pointer, so this costs what a mid-sequence call costs.

A cycle is timed whole as well as by its parts because on a CPU the two differ:
here a cycle measured 4-20% more than gamma isolated draft steps plus an
isolated verify, most likely because the target's pass (44 MB of weights, more
than the 32 MB L3 cache) evicts the draft's weights between cycles. The cycle
time is what the decode loop pays; the parts give the paper's c and verify
cost.
"""

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import decoding, theory
from spec_jax.decoding import DecodeConfig
from spec_jax.draft_length import CycleCosts
from spec_jax.drafters import CATCH_UP_WIDTH
from spec_jax.kv_cache import KVCache
from spec_jax.model import Model
from spec_jax.sampling import Sampling
from spec_jax.stats import DecodeStats


def timed(fn, *args):
  """(fn(*args), wall seconds), waiting for every device result."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return result, time.perf_counter() - start


def interleave(decoders: dict, batches: list, repeats: int = 1,
               timers=()) -> dict:
  """Runs each decoder over every batch, `repeats` times, taking turns.

  Batch by batch the decoders take turns (in reverse order every other
  repeat), and before the first batch and after each batch every timer in
  `timers` (objects with `time_round()`, such as `CycleTimer`) times a
  round, so that a slow spell of the machine, which on a shared machine
  lasts seconds, hits all of them alike. A decoder's time is the median
  over repeats of its time for all the batches: component times are
  medians too, so measured and predicted speedups compare like with like.
  Compile first (run each decoder once on a batch of the same shape), so
  that no compilation falls inside the timing.

  Args:
    decoders: {name: fn(*batch) -> result}.
    batches: argument tuples, one per batch.

  Returns:
    {name: (results of the first repeat, median seconds for all batches,
    [median seconds of each batch])}.
  """
  results = {name: [] for name in decoders}
  seconds = {name: np.zeros((repeats, len(batches))) for name in decoders}
  # A round before the first batch too; it also waits for a timer still
  # compiling (`Deferred`), so that no compilation overlaps the timing.
  for timer in timers:
    timer.time_round()
  for repeat in range(repeats):
    # Every other repeat in reverse order: a machine that speeds up or slows
    # down over a repeat favours neither the first decoder nor the last.
    order = list(decoders.items())[::-1 if repeat % 2 else 1]
    for index, batch in enumerate(batches):
      for name, decode in order:
        result, seconds[name][repeat, index] = timed(decode, *batch)
        if repeat == 0:
          results[name].append(result)
      for timer in timers:
        timer.time_round()
  return {name: (results[name], float(np.median(seconds[name].sum(1))),
                 np.median(seconds[name], 0).tolist())
          for name in decoders}


@functools.partial(jax.jit, static_argnames="sampling")
def _decode_steps(model: Model, cache, token, key, num_steps, sampling: Sampling):
  """num_steps one-token steps: model call, probs, sample; token [B]."""

  def step(i, carry):
    token, cache = carry
    logits, new_cache = model(token[:, None], cache)
    token = sampling.sample(jax.random.fold_in(key, i),
                            sampling.probs(logits[:, 0]))
    return token, new_cache.rollback(cache.lengths)

  return jax.lax.fori_loop(0, num_steps, step, (token, cache))


@functools.partial(jax.jit, static_argnames=("config", "behind"))
def _propose_steps(drafter, state, target_cache, tokens, lengths, verified,
                   key, num_steps, config: DecodeConfig, behind: int = 0):
  """num_steps calls of drafter.propose, each drafting config.gamma tokens,
  and the drafter's update that follows it in a cycle (`verified` is one
  verify pass's output, the same each time). behind: the update leaves the
  drafter's state that many tokens short, as that many plain target steps
  would, so that each proposal catches up on them first."""
  rows = jnp.arange(tokens.shape[0])

  def step(i, carry):
    state, target_cache, tokens, checksum = carry
    proposal = drafter.propose(state, target_cache, tokens, lengths,
                               jax.random.fold_in(key, i), config.gamma,
                               config.sampling)
    # The draft becomes the context's last token: each call then depends on
    # the one before, so none is hoisted out of the loop (a drafter with no
    # state, such as prompt lookup, reads only the tokens).
    tokens = tokens.at[rows, lengths - 1].set(proposal.tokens[:, 0])
    checksum += proposal.probs.sum()
    return (drafter.update(proposal.state, lengths - 1 - behind, verified),
            proposal.target_cache.rollback(target_cache.lengths), tokens,
            checksum)

  return jax.lax.fori_loop(0, num_steps, step,
                           (state, target_cache, tokens, jnp.zeros(())))


@functools.partial(jax.jit, static_argnames="config")
def _verify_steps(target: Model, drafter, proposal, tokens, lengths, key,
                  num_steps, config: DecodeConfig):
  """num_steps verify passes over a proposal's N + 1 tokens, each with its
  rejection step (`decoding.verify_and_resample`, as the loop runs them)."""
  active = jnp.ones(lengths.shape, bool)

  def step(i, carry):
    draft_tokens, cache = carry
    cycle = decoding.verify_and_resample(
        jax.random.fold_in(key, i), target, drafter,
        proposal.replace(tokens=draft_tokens, target_cache=cache), tokens,
        lengths, active, config)
    # Feeding the output back keeps the compiler from hoisting the pass.
    return (draft_tokens.at[:, 0].set(cycle.tokens[:, 0]),
            cycle.target_cache.rollback(cache.lengths))

  return jax.lax.fori_loop(0, num_steps, step,
                           (proposal.tokens, proposal.target_cache))


@functools.partial(jax.jit, static_argnames="config")
def _cycle_steps(target: Model, drafter, state, target_cache, tokens, lengths,
                 key, num_steps, config: DecodeConfig):
  """num_steps cycles of `decoding.speculative_cycle`: the decode loop's
  body without its bookkeeping (emitting tokens, counting statistics)."""
  active = jnp.ones(lengths.shape, bool)

  def step(i, carry):
    state, target_cache, checksum = carry
    propose_key, resample_key = jax.random.split(jax.random.fold_in(key, i))
    cycle = decoding.speculative_cycle(propose_key, resample_key, target,
                                       drafter, state, target_cache, tokens,
                                       lengths, active, config)
    checksum += cycle.tokens.sum() + cycle.num_accepted.sum()
    # Back to the same context: every call attends over the same cache.
    target_cache, state = cycle.advance(drafter, lengths)
    return state, target_cache, checksum

  return jax.lax.fori_loop(0, num_steps, step,
                           (state, target_cache, jnp.zeros((), jnp.int32)))


@functools.partial(jax.jit, static_argnames="config")
def _loop_cycles(target: Model, drafter, state: decoding.DecodeState,
                 num_steps, config: DecodeConfig, costs):
  """num_steps of the decode loop's own cycle (`decoding.loop_cycle`: the
  passes, emitting and counting, and the policy's plan), each from the same
  context: the rows' lengths, the caches and the counters set back after it
  (so every cycle is the first, never an explore cycle)."""
  lengths, stats = state.lengths, state.stats

  def step(i, carry):
    state, checksum = carry
    state = decoding.loop_cycle(
        state.replace(key=jax.random.fold_in(state.key, i)), target, drafter,
        config, costs)
    # The counters and flags feed the output, so that XLA keeps the work
    # that computes them (the statistics read p and q over the vocabulary).
    checksum += sum(jnp.sum(x.astype(jnp.float32))
                    for x in jax.tree.leaves((state.stats, state.done)))
    # A draft model's cache moves back by its pointer; a head re-points its
    # state from the lengths in propose, and the other drafters keep none.
    draft_state = state.draft_state
    if isinstance(draft_state, KVCache):
      draft_state = draft_state.rollback(lengths - 1)
    return state.replace(
        lengths=lengths, done=jnp.zeros_like(state.done), stats=stats,
        target_cache=state.target_cache.rollback(lengths - 1),
        draft_state=draft_state), checksum

  state = decoding.with_plan(state, drafter, config, costs)
  return jax.lax.fori_loop(0, num_steps, step, (state, jnp.zeros(())))


class RoundTimer:
  """Times functions in rounds; each keeps the median of its runs.

  steps: {name: fn(num_steps)}, timed at a short and a long length; what
    counts is the slope, seconds per step, which removes launch and transfer
    costs. `long` is one length for all or {name: length}; a long run is
    lengthened until it takes 100 ms or more, as a decode loop does, so that
    the slope of a cheap step (a draft step, a tiny model) is not lost in
    launch-time noise.
  calls: {name: fn()}, timed whole.

  The functions take turns within a round, and rounds can be interleaved with
  other timed work (the decode loops, in `interleave`), so that a
  slow spell of the machine, which on a shared machine lasts seconds, hits
  them all alike. A median, not a minimum: the decode loops are timed by
  medians too, and the minimum of a few runs undercuts the typical run by an
  amount that grows with the run's length.
  """

  def __init__(self, steps: dict, calls: dict | None = None, short: int = 4,
               long: int | dict = 24):
    self.steps, self.calls, self.short = steps, calls or {}, short
    for fn in steps.values():
      jax.block_until_ready(fn(short))  # compiles; num_steps is traced
    for fn in self.calls.values():
      jax.block_until_ready(fn())
    self.longs = {}
    for name, fn in steps.items():
      self.longs[name] = long[name] if isinstance(long, dict) else long
      while (timed(fn, self.longs[name])[1] < 0.1
             and self.longs[name] < 100_000):
        self.longs[name] *= 4
    self.runs = collections.defaultdict(list)

  def time_round(self) -> None:
    for name, fn in self.steps.items():
      for steps in (self.short, self.longs[name]):
        self.runs[name, steps].append(timed(fn, steps)[1])
    for name, fn in self.calls.items():
      self.runs[name].append(timed(fn)[1])

  def seconds(self) -> dict:
    """{name: seconds per step (steps) or per call (calls)}, so far."""
    median = {key: float(np.median(times)) for key, times in self.runs.items()}
    per_step = {name: self._slope(name, median[name, self.short],
                                  median[name, self.longs[name]])
                for name in self.steps}
    return {**per_step, **{name: median[name] for name in self.calls}}

  def _slope(self, name: str, short, long):
    """Seconds per step of `name` from its short and long runs' seconds
    (scalars, or [rounds] arrays)."""
    return (long - short) / (self.longs[name] - self.short)

  def ratios(self, reference: str) -> dict:
    """{name: seconds per step over the reference's}, each the median over
    rounds of the two slopes' ratio within a round: a round's functions run
    within seconds of each other, so a slow spell of the machine that spans
    a round scales a ratio's two sides alike. A ratio of medians taken
    across rounds keeps it where a spell covers the reference's median
    round and not the other's: medians of 3 rounds priced every verify of
    the built-in target at batch 16 a quarter low once, the one-token verify
    at 0.95 target steps, where paired ratios over 7 rounds give 1.11-1.21.
    """
    return {name: float(np.median(self.per_round(name)
                                  / self.per_round(reference)))
            for name in self.steps}

  def per_round(self, name: str) -> np.ndarray:
    """[rounds] seconds per step of `name` (a step) or per call (a call),
    one value per round, for ratios paired within a round."""
    if name in self.calls:
      return np.array(self.runs[name])
    return self._slope(name, np.array(self.runs[name, self.short]),
                       np.array(self.runs[name, self.longs[name]]))


def _context(target: Model, batch_size: int, max_len: int,
             hidden_layers: tuple[int, ...] = ()):
  """Tokens [B, max_len], lengths [B] at mid-cache, the full lengths [B],
  the target's cache, filled with the keys and values of the whole context,
  and the context's hidden states at `hidden_layers` (for a drafter that
  reads the target's features).

  The context repeats, so that prompt lookup finds matches as it would in
  the inputs it is good for. The cache holds real keys and values, as in the
  middle of a decode: on a CPU, attention over an all-zero cache ran 5-10%
  faster than over a filled one, which priced the loop's parts too low.
  """
  lengths = jnp.full((batch_size,), max_len // 2, jnp.int32)
  full = jnp.full((batch_size,), max_len, jnp.int32)
  tokens = jnp.broadcast_to(jnp.arange(max_len) % 7, (batch_size, max_len))
  cache, hidden = target.prefill_with_hidden(tokens, full, max_len,
                                             hidden_layers)
  return tokens, lengths, full, cache.rollback(lengths - 1), hidden


class TargetTimer:
  """Seconds per target step (model call and sampling) and of the target's
  prefill of a prompt batch: what autoregressive decoding costs. Measured in
  rounds (`time_round`, then `seconds`).

  Args:
    target: the target model.
    batch_size: rows decoded together.
    prompt_width: padded prompt width.
    max_len: cache length, as in the decode loop.
    sampling: as in the decode loop.
    steps: the long run's length. Give the AR loop's own (max_new_tokens),
      so the step is timed over runs as long as the loop's.
  """

  def __init__(self, target: Model, batch_size: int, prompt_width: int,
               max_len: int, sampling: Sampling, steps: int = 24):
    key = jax.random.key(0)
    tokens, lengths, _, cache, _ = _context(target, batch_size, max_len)
    prompts = tokens[:, :prompt_width]
    prompt_lengths = jnp.full((batch_size,), prompt_width, jnp.int32)
    self.timer = RoundTimer(
        {"target": lambda n: _decode_steps(target, cache, tokens[:, 0], key,
                                           n, sampling)},
        {"prefill": lambda: target.prefill(prompts, prompt_lengths, max_len)},
        long=max(steps, 8))

  def time_round(self) -> None:
    self.timer.time_round()

  def seconds(self) -> dict:
    times = self.timer.seconds()
    return {"target_step_s": times["target"],
            "target_prefill_s": times["prefill"]}


class CycleTimer:
  """Seconds per draft step, per verify (+ resample) and per whole cycle, and
  of the drafter's prefill of a prompt batch: what a speculative cycle costs
  beyond the target's own step. Measured in rounds (`time_round`, then
  `seconds`); the cycle, which prices the decode loop, twice per round.

  Args:
    target: the target model.
    drafter: any drafter; a draft step is one propose call over gamma, or
      over a tree drafter's depth (one draft pass per depth).
    batch_size: rows decoded together.
    prompt_width: padded prompt width.
    max_len: cache length, as in the decode loop (prompt width +
      max_new_tokens + N + 1, N = gamma or a tree's node count).
    config: gamma and sampling as in the decode loop.
    cycles: the long run's length for a cycle.
  """

  def __init__(self, target: Model, drafter, batch_size: int,
               prompt_width: int, max_len: int, config: DecodeConfig,
               cycles: int = 32):
    self.depth = drafter.cycle_shape(config.gamma)[1]
    key = jax.random.key(0)
    layers = drafter.target_layers
    tokens, lengths, _, target_cache, hidden = _context(
        target, batch_size, max_len, layers)
    # Prefilled over the whole context with the pointer at mid-cache, as the
    # target's: a drafter that reads the target's features gets them.
    draft_state = drafter.prefill(tokens, lengths, max_len, hidden)
    # A real proposal (a tree's shape included) with uniform q: every draft
    # counts as proposed, so the verify is the full width.
    proposal = drafter.propose(draft_state, target_cache, tokens, lengths,
                               key, config.gamma, config.sampling)
    proposal = proposal.replace(
        probs=jnp.full_like(proposal.probs, 1.0 / target.vocab_size))
    verified = decoding.verify_and_resample(
        key, target, drafter, proposal, tokens, lengths,
        jnp.ones(lengths.shape, bool), config).verified
    prompts = tokens[:, :prompt_width]
    prompt_lengths = jnp.full((batch_size,), prompt_width, jnp.int32)
    prompt_hidden = target.prefill_with_hidden(prompts, prompt_lengths,
                                               max_len, layers)[1]
    self.parts = RoundTimer(
        {"propose": lambda n: _propose_steps(
            drafter, draft_state, target_cache, tokens, lengths, verified,
            key, n, config),
         "verify": lambda n: _verify_steps(
             target, drafter, proposal, tokens, lengths, key, n, config)},
        {"draft_prefill": lambda: drafter.prefill(prompts, prompt_lengths,
                                                  max_len, prompt_hidden)})
    self.cycle = RoundTimer(
        {"cycle": lambda n: _cycle_steps(
            target, drafter, draft_state, target_cache, tokens, lengths, key,
            n, config)}, long=cycles)

  def time_round(self) -> None:
    self.parts.time_round()
    self.cycle.time_round()
    self.cycle.time_round()

  def seconds(self) -> dict:
    times = {**self.parts.seconds(), **self.cycle.seconds()}
    return {
        # One draft step per depth: gamma for a chain, D passes for a tree.
        "draft_step_s": times["propose"] / self.depth,
        "verify_s": times["verify"],
        "cycle_s": times["cycle"],
        "draft_prefill_s": times["draft_prefill"],
    }


def calibrate_cycle_costs(target: Model, drafter, batch_size: int,
                          max_len: int, config: DecodeConfig,
                          rounds: int = 7) -> CycleCosts:
  """What the adaptive draft length optimises (`draft_length.CycleCosts`),
  measured at this batch size on a filled cache, as `CycleTimer` measures a
  cycle's parts: a draft step, a verify with its rejection step at each
  width the loop compiles (`decoding.loop_verify_widths`), a draft model's
  catch-up per plain step it missed, and the loop's overhead (its cycle at
  the narrowest width that holds a draft less that cycle's passes), each
  over a target step in the same round (`RoundTimer.ratios`). Seconds to a
  minute (the built-in pair at batch 16: 35-60 s, compilation included);
  run it once per program, before the decode.

  rounds: 7, because the policy's choice turns on these ratios where
  drafting is near break-even: at batch 16 on a 2-core machine, four
  calibrations of 7 rounds priced the 2-token verify at 1.68-1.84 target
  steps, where the ratio of 3 rounds' medians gave 1.46-2.02.
  """
  key = jax.random.key(0)
  tokens, lengths, _, target_cache, hidden = _context(
      target, batch_size, max_len, drafter.target_layers)
  draft_state = drafter.prefill(tokens, lengths, max_len, hidden)
  proposal = drafter.propose(draft_state, target_cache, tokens, lengths, key,
                             config.gamma, config.sampling)
  verified = decoding.verify_and_resample(
      key, target, drafter, proposal, tokens, lengths,
      jnp.ones(lengths.shape, bool), config).verified
  uniform = jnp.full_like(proposal.probs, 1.0 / target.vocab_size)
  widths = decoding.loop_verify_widths(drafter, config)
  # A proposal of w - 1 drafts per row runs the verify of width w.
  verify = {
      f"verify_{w}": functools.partial(
          lambda n, p: _verify_steps(target, drafter, p, tokens, lengths, key,
                                     n, config),
          p=proposal.replace(probs=uniform.at[:, w - 1:].set(0.0)))
      for w in widths}
  propose = lambda behind: lambda n: _propose_steps(
      drafter, draft_state, target_cache, tokens, lengths, verified, key, n,
      config, behind)
  # Only a drafter with a state of its own (a draft model's cache) falls
  # behind on plain target steps; prompt lookup and layer skip read the
  # tokens and the target's cache. Four catch-up passes of 7 new tokens
  # where the context (max_len / 2) holds them.
  behind = (min(4 * (CATCH_UP_WIDTH - 1), max_len // 2 - 2)
            if draft_state is not None
            and getattr(drafter, "catches_up", False) else 0)
  # The loop's cycle at the narrowest width that holds a draft (w - 1
  # drafts, which costs that make only the widths up to w free choose):
  # what it takes beyond its passes is the overhead o. Not gamma's: o is the
  # difference of two timings, and beside a 9-token verify of 8 steps
  # (batch 8 and up) their noise swamped it (0 to 0.5 steps from one
  # calibration to the next); the work it prices (emitting, counting,
  # choosing) has fixed shapes, the same at every K.
  narrowest = next(w for w in widths if w >= 2)
  state = decoding.DecodeState(
      tokens=tokens, lengths=lengths, prompt_lengths=lengths,
      done=jnp.zeros(lengths.shape, bool), target_cache=target_cache,
      draft_state=draft_state, key=key,
      stats=DecodeStats.zeros(batch_size, drafter.cycle_shape(config.gamma)[1],
                              len(widths)))
  narrowest_free = CycleCosts.of(
      0.0, [1.0 if w <= narrowest else 1e3 for w in widths])
  timer = RoundTimer({
      "target": lambda n: _decode_steps(target, target_cache, tokens[:, 0],
                                        key, n, config.sampling),
      "propose": propose(0),
      **({"propose_behind": propose(behind)} if behind else {}),
      **verify,
      "cycle": lambda n: _loop_cycles(target, drafter, state, n, config,
                                      narrowest_free)})
  for _ in range(rounds):
    timer.time_round()
  steps = timer.ratios("target")  # in target steps
  catch_up = (max(steps["propose_behind"] - steps["propose"], 0.0) / behind
              if behind else 0.0)
  draft_step = steps["propose"] / config.gamma
  overhead = (steps["cycle"] - (narrowest - 1) * draft_step
              - steps[f"verify_{narrowest}"])
  return CycleCosts.of(draft_step,
                       [steps[f"verify_{w}"] for w in widths], catch_up,
                       max(overhead, 0.0))


class EveryNth:
  """A timer that times a round on every nth call of `time_round` only: for
  a component pooled over many runs, which needs fewer rounds per run."""

  def __init__(self, timer, n: int):
    self.timer, self.n, self.calls = timer, n, 0

  def time_round(self) -> None:
    if self.calls % self.n == 0:
      self.timer.time_round()
    self.calls += 1


class Deferred:
  """A timer still being built in a thread (a `concurrent.futures.Future`):
  its first round waits for it, so that it compiles while other work does."""

  def __init__(self, future):
    self.future = future

  def time_round(self) -> None:
    self.future.result().time_round()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
  """What the loop's parts cost, in seconds, and in target steps.

  The one place where the cost ratios are computed: c (`draft_cost_ratio`),
  v (`verify_cost_ratio`) and a whole cycle's (`cycle_cost_ratio`). Built from
  the timers, `Costs(**cycle_timer.seconds(), **target_timer.seconds())`; a
  measurement of a step and a verify alone (bench_step) leaves the other
  parts None.
  """
  draft_step_s: float | None = None
  verify_s: float
  cycle_s: float | None = None
  draft_prefill_s: float | None = None
  target_step_s: float
  target_prefill_s: float | None = None

  @property
  def draft_cost_ratio(self) -> float:
    """c: a draft step (a tree's: one draft pass) over a target step."""
    return self.draft_step_s / self.target_step_s

  @property
  def verify_cost_ratio(self) -> float:
    """v: a verify with its rejection step over a target step."""
    return self.verify_s / self.target_step_s

  @property
  def cycle_cost_ratio(self) -> float:
    """A whole propose -> verify -> resample cycle over a target step."""
    return self.cycle_s / self.target_step_s

  def parts_cycle_s(self, draft_steps: int) -> float:
    """A cycle priced from its parts: draft_steps draft steps and a verify."""
    return draft_steps * self.draft_step_s + self.verify_s

  def speedup_from_depth_acceptance(self, depth_acceptance,
                                    verify_cost_ratio: float | None = None):
    """`theory.speedup_from_depth_acceptance` at these costs: a cycle of one
    draft step per depth (len(depth_acceptance)) and a verify of v, or of
    verify_cost_ratio target steps instead (1.0: the papers' flat verify)."""
    return float(theory.speedup_from_depth_acceptance(
        depth_acceptance, len(depth_acceptance) * self.draft_cost_ratio,
        self.verify_cost_ratio if verify_cost_ratio is None
        else verify_cost_ratio))

  def as_row(self) -> dict:
    """The ratios and the seconds measured, under the keys every results row
    uses."""
    ratios = {"draft_cost_ratio": self.draft_step_s,
              "verify_cost_ratio": self.verify_s,
              "cycle_cost_ratio": self.cycle_s}
    seconds = {k: v for k, v in dataclasses.asdict(self).items()
               if v is not None}
    return {**{name: getattr(self, name) for name, part in ratios.items()
               if part is not None}, **seconds}


def speedup_over_ar(run: dict, ar_seconds: float) -> dict:
  """{"ar_tokens_per_s", "speedup"} of a `compare.compare_at` RUN's SD
  against AR decoding of the run's prompts in ar_seconds: the run's own AR
  time, or the median over a sweep's rows (all decode the same prompts, and
  AR does not depend on the drafter)."""
  ar_tokens_per_s = run["ar"]["new_tokens"] / ar_seconds
  return {"ar_tokens_per_s": ar_tokens_per_s,
          "speedup": run["sd"]["tokens_per_s"] / ar_tokens_per_s}
