"""Component times measured the way the decode loop runs them.

Each component (a draft step, a target step, a verify with its rejection step)
runs n times inside one jitted `fori_loop`, as it does inside the decode loop:
no dispatch per call, caches updated in place. Its time is the slope
(t(n_long) - t(n_short)) / (n_long - n_short), which removes launch and
transfer costs; each t is the fastest of several runs after a warm-up call
that compiles. The cache pointer is put back after every iteration so all n calls
attend over the same cache; attention reads every slot regardless of the
pointer, so this costs what a mid-sequence call costs.
"""

import functools
import time

import jax
import jax.numpy as jnp

from spec_jax import rejection
from spec_jax.decoding import DecodeConfig, verify
from spec_jax.model import Model
from spec_jax.sampling import Sampling


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


@functools.partial(jax.jit, static_argnames=("gamma", "sampling"))
def _propose_steps(drafter, state, target_cache, tokens, lengths, key,
                   num_steps, gamma: int, sampling: Sampling):
  """num_steps calls of drafter.propose, each drafting gamma tokens."""

  def step(i, carry):
    state, target_cache, checksum = carry
    draft_tokens, draft_probs, new_state, new_target_cache = drafter.propose(
        state, target_cache, tokens, lengths, jax.random.fold_in(key, i),
        gamma, sampling)
    # The checksum uses every output, so nothing is optimised away.
    checksum += draft_tokens.sum() + draft_probs.sum()
    return (drafter.rollback(new_state, lengths),
            new_target_cache.rollback(target_cache.lengths), checksum)

  return jax.lax.fori_loop(0, num_steps, step,
                           (state, target_cache, jnp.zeros(())))


@functools.partial(jax.jit, static_argnames="sampling")
def _verify_steps(target: Model, cache, tokens, lengths, draft_tokens,
                  draft_probs, key, num_steps, sampling: Sampling):
  """num_steps verify passes over gamma + 1 tokens, each with `resample`."""

  def step(i, carry):
    draft_tokens, cache = carry
    target_probs, new_cache = verify(target, cache, tokens, lengths,
                                     draft_tokens, sampling)
    new_tokens, _ = rejection.resample(
        jax.random.fold_in(key, i), draft_tokens, draft_probs, target_probs,
        greedy=sampling.greedy)
    # Feeding the output back keeps the compiler from hoisting the pass.
    return new_tokens[:, :-1], new_cache.rollback(cache.lengths)

  return jax.lax.fori_loop(0, num_steps, step, (draft_tokens, cache))


def _seconds(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def seconds_per_step(fns: dict, short: int = 4, long: int = 24,
                     repeats: int = 3) -> dict:
  """{name: slope of the time of fn(num_steps) between short and long steps}.

  The functions take turns, so a slow spell of the machine hits them alike,
  and each keeps its fastest run of each length.
  """
  for fn in fns.values():
    jax.block_until_ready(fn(short))  # compiles; num_steps is traced
  # Lengthen the long run until it takes 20 ms or more, so that the slope of
  # a very cheap step (a tiny model) is not lost in launch-time noise.
  longs = {}
  for name, fn in fns.items():
    longs[name] = long
    while _seconds(fn, longs[name]) < 0.02 and longs[name] < 100_000:
      longs[name] *= 4
  fastest = {}
  for _ in range(repeats):
    for name, fn in fns.items():
      for steps in (short, longs[name]):
        elapsed = _seconds(fn, steps)
        fastest[name, steps] = min(fastest.get((name, steps), elapsed), elapsed)
  return {name: (fastest[name, longs[name]] - fastest[name, short])
          / (longs[name] - short) for name in fns}


def fastest_call_seconds(fn, repeats: int = 3) -> float:
  """The fastest of `repeats` calls of fn(), after one that compiles."""
  jax.block_until_ready(fn())
  return min(_seconds(fn) for _ in range(repeats))


def component_seconds(target: Model, drafter, batch_size: int,
                      prompt_width: int, max_len: int,
                      config: DecodeConfig) -> dict:
  """Seconds per draft step, per target step and per verify (+ resample), and
  of the target's and the drafter's prefill of a prompt batch.

  Args:
    target: the target model.
    drafter: any drafter; a draft step is one propose call over gamma.
    batch_size: rows decoded together.
    prompt_width: padded prompt width.
    max_len: cache length, as in the decode loop (prompt width +
      max_new_tokens + gamma + 1).
    config: gamma and sampling as in the decode loop.
  """
  gamma, sampling = config.gamma, config.sampling
  key = jax.random.key(0)
  lengths = jnp.full((batch_size,), max_len // 2, jnp.int32)
  # A repetitive context, so that prompt lookup finds matches as it would
  # in the inputs it is good for.
  tokens = jnp.broadcast_to(jnp.arange(max_len) % 7, (batch_size, max_len))
  target_cache = target.init_cache(batch_size, max_len).rollback(lengths - 1)
  draft_state = drafter.rollback(
      drafter.prefill(tokens, lengths, max_len), lengths)
  propose_steps = lambda n: _propose_steps(
      drafter, draft_state, target_cache, tokens, lengths, key, n, gamma,
      sampling)
  target_steps = lambda n: _decode_steps(target, target_cache, tokens[:, 0],
                                         key, n, sampling)
  draft_tokens = tokens[:, :gamma]
  draft_probs = jnp.full((batch_size, gamma, target.vocab_size),
                         1.0 / target.vocab_size)
  verify_steps = lambda n: _verify_steps(
      target, target_cache, tokens, lengths, draft_tokens, draft_probs, key, n,
      sampling)
  steps = seconds_per_step({"propose": propose_steps, "target": target_steps,
                            "verify": verify_steps})
  prompts = tokens[:, :prompt_width]
  prompt_lengths = jnp.full((batch_size,), prompt_width, jnp.int32)
  return {
      "draft_step_s": steps["propose"] / gamma,
      "target_step_s": steps["target"],
      "verify_s": steps["verify"],
      "target_prefill_s": fastest_call_seconds(
          lambda: target.prefill(prompts, prompt_lengths, max_len)),
      "draft_prefill_s": fastest_call_seconds(
          lambda: drafter.prefill(prompts, prompt_lengths, max_len)),
  }
