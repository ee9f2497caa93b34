"""Timing: the fused loop against the sum of its parts, and SD against AR.

Every time is a median over repeats, after a warm-up call that compiles, so
no compilation is counted. Loop times are per cycle: two runs of different
lengths are subtracted, which removes the prefill and fixed launch costs.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import rejection
from spec_jax.decoding import (DecodeConfig, generate, generate_autoregressive,
                               verify)
from spec_jax.drafting import ModelDrafter
from spec_jax.model import Model


def median_seconds(fn, *args, repeats: int = 5) -> float:
  """Median wall time of fn(*args) after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def component_seconds(
    target: Model, draft: Model, batch_size: int, max_len: int,
    config: DecodeConfig, repeats: int = 20,
) -> dict:
  """Median time of one draft step, one verify and one resample, each jitted
  alone, on caches of the size the loop uses."""
  gamma, sampling = config.gamma, config.sampling
  position = max_len // 2  # A typical mid-sequence position.
  tokens = jnp.ones((batch_size, max_len), jnp.int32)
  lengths = jnp.full((batch_size,), position, jnp.int32)
  draft_cache = draft.init_cache(batch_size, max_len).rollback(lengths)
  target_cache = target.init_cache(batch_size, max_len).rollback(lengths - 1)

  @jax.jit
  def draft_step(cache):
    logits, _ = draft(tokens[:, :1], cache)
    return sampling.probs(logits)

  draft_tokens = jnp.ones((batch_size, gamma), jnp.int32)

  @jax.jit
  def verify_step(cache):
    return verify(target, cache, tokens, lengths, draft_tokens, sampling)[0]

  target_probs = verify_step(target_cache)
  draft_probs = target_probs[:, :gamma]
  resample_step = jax.jit(
      lambda key: rejection.resample(key, draft_tokens, draft_probs,
                                     target_probs, greedy=sampling.greedy))

  @jax.jit
  def target_step(cache):
    logits, _ = target(tokens[:, :1], cache)
    return sampling.probs(logits)

  return {
      "draft_step_s": median_seconds(draft_step, draft_cache, repeats=repeats),
      "verify_s": median_seconds(verify_step, target_cache, repeats=repeats),
      "resample_s": median_seconds(resample_step, jax.random.key(0),
                                   repeats=repeats),
      "target_step_s": median_seconds(target_step, target_cache,
                                      repeats=repeats),
  }


def _run_seconds(fn, repeats):
  """(median seconds, last result) of fn() after a warm-up."""
  result = jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), result


def loop_efficiency(
    key: jax.Array, target: Model, draft: Model, prompts, prompt_lengths,
    config: DecodeConfig, repeats: int = 3,
) -> dict:
  """Compares the fused loop's time per cycle with the sum of its parts.

  The ratio (gamma * draft step + verify + resample) / (time per fused cycle)
  is 1 when fusing adds nothing; below 1 the loop adds its own overhead.
  Also reports AR and SD tokens per second measured side by side.
  """
  drafter = ModelDrafter(draft)
  short = DecodeConfig(gamma=config.gamma, sampling=config.sampling,
                       max_new_tokens=max(1, config.max_new_tokens // 4),
                       eos_id=config.eos_id)
  runs = {}
  for name, cfg in (("short", short), ("full", config)):
    runs[name] = _run_seconds(
        lambda cfg=cfg: generate(key, target, drafter, prompts,
                                 prompt_lengths, cfg), repeats)
  (short_s, short_result), (full_s, full_result) = runs["short"], runs["full"]
  cycles = int(full_result.stats.cycles) - int(short_result.stats.cycles)
  cycle_s = (full_s - short_s) / max(cycles, 1)

  ar_s, ar_result = _run_seconds(
      lambda: generate_autoregressive(key, target, prompts, prompt_lengths,
                                      config), repeats)
  max_len = int(np.asarray(prompts).shape[1]) + config.max_new_tokens + \
      config.gamma + 1
  parts = component_seconds(target, draft, len(prompt_lengths), max_len,
                            config)
  parts_s = (config.gamma * parts["draft_step_s"] + parts["verify_s"]
             + parts["resample_s"])
  sd_tokens = int(full_result.num_tokens.sum())
  ar_tokens = int(ar_result.num_tokens.sum())
  return {
      "gamma": config.gamma,
      "batch_size": len(prompt_lengths),
      **parts,
      "fused_cycle_s": cycle_s,
      "sum_of_parts_s": parts_s,
      "loop_efficiency": parts_s / cycle_s,
      "draft_cost_ratio_c": parts["draft_step_s"] / parts["target_step_s"],
      "verify_cost_ratio": parts["verify_s"] / parts["target_step_s"],
      "sd_tokens_per_s": sd_tokens / full_s,
      "ar_tokens_per_s": ar_tokens / ar_s,
      "speedup": (sd_tokens / full_s) / (ar_tokens / ar_s),
      "stats": full_result.stats.summary(),
  }
