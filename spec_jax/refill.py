"""More prompts than rows: a queue decoded through a fixed number of slots.

A decode of P prompts through B < P rows (continuous batching) starts with
the first B prompts. After every cycle the loop stores the outputs of the
rows that finished under their prompts' indices (`Queue.flush`) and prefills
the next queued prompt into each freed row (`refill`), inside the same
`lax.while_loop`: the row's tokens, lengths and both caches are replaced by
a one-row prefill's (during a draft-length policy's plain steps the draft
model's cache row is emptied instead, and the next cycle that drafts catches
it up: `decoding._next_prompts`). The loop ends when the queue is empty and
every row is done, so no row idles while prompts wait, and a fixed batch's
cost of running every row until the slowest is done is paid once, at the
end.

Why the output law is unchanged: a refilled row starts from the state a
fresh decode of its prompt starts from (the prefill is the same function of
the prompt; an emptied draft cache, once caught up, holds what the draft's
prefill would, to float rounding, and the rejection rule keeps the target's
law whatever q the drafts came from), rows never read each other, and each
cycle's randomness is fresh; so each prompt's tokens have the law a decode
of that prompt alone has. Greedy outputs are each prompt's own greedy
decode.
"""

import heapq
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.stats import DecodeStats


@flax.struct.dataclass
class Queue:
  """Every prompt of a decode, and what has come back for each."""

  prompts: jax.Array  # [P, W] int32, right-padded.
  prompt_lengths: jax.Array  # [P] int32
  next: jax.Array  # [] int32, the first prompt not yet given a row.
  # [B] int32, the prompt each row decodes; P once its output is stored.
  row_prompt: jax.Array
  tokens: jax.Array  # [P, max_new_tokens] int32 outputs, as DecodeResult's.
  num_tokens: jax.Array  # [P] int32
  stats: DecodeStats | None  # rows [P]; the loop counters are the loop's.

  @classmethod
  def start(cls, prompts, prompt_lengths, num_rows: int, max_new_tokens: int,
            stats: DecodeStats | None) -> "Queue":
    """The first num_rows prompts in rows 0..num_rows-1, the rest queued;
    stats: zero counters for P rows (None for a plain decode)."""
    num_prompts = prompts.shape[0]
    return cls(prompts=prompts, prompt_lengths=prompt_lengths,
               next=jnp.int32(num_rows),
               row_prompt=jnp.arange(num_rows, dtype=jnp.int32),
               tokens=jnp.zeros((num_prompts, max_new_tokens), jnp.int32),
               num_tokens=jnp.zeros((num_prompts,), jnp.int32), stats=stats)

  @property
  def size(self) -> int:
    return self.prompts.shape[0]

  def finished(self, done) -> jax.Array:
    """[B] bool: the rows done [B] that still hold a prompt."""
    return done & (self.row_prompt < self.size)

  def flush(self, done, tokens, num_tokens,
            stats: DecodeStats | None) -> tuple["Queue", DecodeStats | None]:
    """Stores the outputs (tokens [B, max_new_tokens], num_tokens [B]) and
    statistics rows of the rows done [B] that still hold a prompt; those
    rows then hold none, and their counters restart at 0 for the next."""
    finished = self.finished(done)
    index = jnp.where(finished, self.row_prompt, self.size)  # P is dropped
    queue = self.replace(
        tokens=self.tokens.at[index].set(tokens, mode="drop"),
        num_tokens=self.num_tokens.at[index].set(num_tokens, mode="drop"),
        row_prompt=jnp.where(finished, self.size, self.row_prompt))
    if stats is None:
      return queue, None
    return (queue.replace(stats=stats.put_rows(self.stats, index)),
            stats.clear_rows(finished))

  def result_stats(self, loop_stats: DecodeStats) -> DecodeStats:
    """Per-prompt counters, with the loop's own (cycles, widths, limits)."""
    return self.stats.replace(cycles=loop_stats.cycles,
                              width_cycles=loop_stats.width_cycles,
                              limit_cycles=loop_stats.limit_cycles)


def loop_iterations(iterations: Sequence[int], slots: int) -> int:
  """The iterations a refilled loop runs for prompts that take `iterations`
  [P] (each >= 1: cycles, or AR steps) through `slots` rows: the queue in
  prompt order, a freed row starting the next prompt at the next iteration.

  Beyond sum(iterations) / slots, what a queue costs is its end: once it is
  empty, rows that finish early idle while the last prompts finish.
  """
  finish = list(iterations[:slots])  # each row's last iteration so far
  heapq.heapify(finish)
  for count in iterations[slots:]:
    heapq.heappush(finish, heapq.heappop(finish) + count)
  return max(finish, default=0)


def put_row(batch, row: jax.Array, one):
  """`batch` (any pytree whose leaves have the batch as leading axis) with
  its row `row` replaced by the one-row pytree `one`'s."""
  return jax.tree.map(lambda b, o: b.at[row].set(o[0]), batch, one)


def refill(state, store: Callable, prefill_row: Callable):
  """Stores the outputs of the rows that finished this cycle, then gives
  each done row the next queued prompt, one row at a time, until the queue
  is empty or no row is free.

  store(state) -> state: the finished rows' outputs and statistics stored
  (`Queue.flush`). prefill_row(state, row, prompt [1, W], length [1]) ->
  state: the row reset to a fresh prefill of the prompt, not done.
  """
  def free(state):
    return jnp.any(state.done) & (state.queue.next < state.queue.size)

  def fill(state):
    queue = state.queue
    row = jnp.argmax(state.done)
    prompt = jax.lax.dynamic_slice_in_dim(queue.prompts, queue.next, 1)
    length = jax.lax.dynamic_slice_in_dim(queue.prompt_lengths, queue.next, 1)
    state = prefill_row(state, row, prompt, length)
    return state.replace(queue=queue.replace(
        next=queue.next + 1, row_prompt=queue.row_prompt.at[row].set(
            queue.next)))

  # A row is free only in the cycle it finishes (then it is refilled, or the
  # queue is empty), so most cycles skip both steps. They sit inside a cond
  # that passes the state through: its other branch updates nothing, so XLA
  # copies no cache (both branches updating one would copy it), and a cycle
  # that finishes no row pays neither the store nor the loop.
  return jax.lax.cond(jnp.any(state.queue.finished(state.done)),
                      lambda s: jax.lax.while_loop(free, fill, store(s)),
                      lambda s: s, state)
