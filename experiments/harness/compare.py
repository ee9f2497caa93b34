"""AR and SD side by side on the same prompts: the main job's comparison,
which the drafter comparison, the sweeps and the notebooks build on."""
import logging

import jax
import ml_collections
import numpy as np

from experiments.harness import config as config_lib
from experiments.harness import loading, records, timing
from spec_jax import sharding
from spec_jax.decoding import (DecodeConfig, DecodeResult, generate,
                               generate_autoregressive, pad_prompts)
from spec_jax.stats import DecodeStats

_log = logging.getLogger(__name__)


def encode(prompts: loading.Prompts, tokenizer) -> list[list[int]]:
  return [tokenizer.encode(p, add_special_tokens=prompts.special_tokens).ids
          or [0] for p in prompts.texts]


def batch_rows(groups: list[list[int]], batch_size: int) -> list[list[int]]:
  """The prompt indices each batch holds: batches are drawn from one group of
  prompt indices (a category) at a time, so that a batch's time is its
  category's. The rows that only pad a batch are left out."""
  return [group[start:start + batch_size] for group in groups
          for start in range(0, len(group), batch_size)]


def batches(prompt_ids: list[list[int]], batch_size: int,
            groups: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
  """(prompts [B, P], lengths [B]) per batch of `batch_rows`. Every batch is
  full (the last of a group repeats its last prompt) and padded to the
  power-of-two width its longest prompt needs (`pad_prompts`), so a batch of
  short prompts does not pay a long one's prefill; each width compiles one
  program."""
  result = []
  for indices in batch_rows(groups, batch_size):
    batch = [prompt_ids[i] for i in indices]
    batch = batch + [batch[-1]] * (batch_size - len(batch))
    result.append(pad_prompts(batch))
  return result


def first_of_each_width(all_batches: list) -> list[int]:
  """The index of the first batch of each prompt width: the batches that
  compile every program the decode needs."""
  first = {}
  for index, (prompts, _) in enumerate(all_batches):
    first.setdefault(prompts.shape[1], index)
  return list(first.values())


def decoders(loaded: loading.Loaded, decode_config: DecodeConfig, key,
             mesh=None, costs=None, slots=None) -> dict:
  """{"ar": fn, "sd": fn}, each fn(prompts, lengths) -> host DecodeResult;
  costs: the adaptive draft length's (`timing.calibrate_cycle_costs`);
  slots: the rows the prompts go through (`generate`), None for all at
  once."""
  target, drafter = loaded.target.model, loaded.drafter
  return {
      "ar": lambda p, n: sharding.to_host(generate_autoregressive(
          key, target, p, n, decode_config, mesh, slots)),
      "sd": lambda p, n: sharding.to_host(generate(
          key, target, drafter, p, n, decode_config, mesh, slots, costs)),
  }


def rows(results: list[DecodeResult], batches_rows) -> dict[int, list[int]]:
  """{prompt index: its emitted tokens}, padding rows left out."""
  out = {}
  for result, indices in zip(results, batches_rows):
    for index, tokens, n in zip(indices, np.asarray(result.tokens),
                                np.asarray(result.num_tokens)):
      out[index] = tokens[:n].tolist()
  return out


def _totals(batches_rows, ar_rows: dict, sd_rows: dict, ar_seconds: float,
            sd_seconds: float, sd_results) -> dict:
  """AR and SD totals over some batches (their real rows only)."""
  indices = [i for batch in batches_rows for i in batch]
  ar_tokens = sum(len(ar_rows[i]) for i in indices)
  sd_tokens = sum(len(sd_rows[i]) for i in indices)
  # The AR loop runs until a batch's longest row ends.
  ar_steps = sum(max(len(ar_rows[i]) for i in batch) for batch in batches_rows)
  stats = DecodeStats.merge([result.stats.select_rows(np.arange(len(batch)))
                             for result, batch in zip(sd_results,
                                                      batches_rows)])
  return {
      "ar": {"tokens_per_s": ar_tokens / ar_seconds, "new_tokens": ar_tokens,
             "wall_s": ar_seconds, "steps": ar_steps},
      # Counts and ratios of spec_jax.stats; "cycles" counts loop
      # iterations, "row_cycles" the cycles of each row, summed.
      "sd": {"tokens_per_s": sd_tokens / sd_seconds, "new_tokens": sd_tokens,
             "wall_s": sd_seconds, **stats.summary()},
      "speedup": (sd_tokens / sd_seconds) / (ar_tokens / ar_seconds),
  }


def run_record(decode_config: DecodeConfig, batch_size: int,
               prompts: loading.Prompts, groups: list[list[int]],
               timed: dict) -> dict:
  """One RUN of the results file, from `timing.interleave`'s output; with
  categories, the same totals per category too. A category's seconds are the
  sums of its batches' median times, so with timing_repeats > 1 they need not
  add up to the run's (the median of whole repeats)."""
  (ar_results, ar_seconds, ar_batches) = timed["ar"]
  (sd_results, sd_seconds, sd_batches) = timed["sd"]
  per_batch = batch_rows(groups, batch_size)
  ar_rows = rows(ar_results, per_batch)
  sd_rows = rows(sd_results, per_batch)
  record = {
      "temperature": decode_config.sampling.temperature,
      "gamma": decode_config.gamma,
      "batch_size": batch_size,
      "num_batches": len(sd_results),
      **_totals(per_batch, ar_rows, sd_rows, ar_seconds, sd_seconds,
                sd_results),
  }
  if prompts.categories is not None:
    record["by_category"], first = {}, 0
    for group in groups:
      span = slice(first, first + -(-len(group) // batch_size))
      record["by_category"][prompts.categories[group[0]]] = _totals(
          per_batch[span], ar_rows, sd_rows, sum(ar_batches[span]),
          sum(sd_batches[span]), sd_results[span])
      first = span.stop
  record["samples"] = [
      {"prompt": p, "ar_tokens": ar_rows[i], "sd_tokens": sd_rows[i]}
      | ({"category": prompts.categories[i]} if prompts.categories else {})
      for i, p in enumerate(prompts.texts)]
  return record


def groups_of(prompts: loading.Prompts) -> list[list[int]]:
  """Prompt indices by category, in order of first appearance; one group
  without categories."""
  if prompts.categories is None:
    return [list(range(len(prompts.texts)))]
  groups = {}
  for index, category in enumerate(prompts.categories):
    groups.setdefault(category, []).append(index)
  return list(groups.values())


def adaptive_costs(loaded: loading.Loaded, decode_config: DecodeConfig,
                   batch_size: int, width: int):
  """The adaptive draft length's costs (`timing.calibrate_cycle_costs`) at
  batch_size rows and the cache of prompts padded to width; None for a
  fixed gamma."""
  if decode_config.adaptive is None:
    return None
  max_len = width + decode_config.max_new_tokens + decode_config.gamma + 1
  return timing.calibrate_cycle_costs(loaded.target.model, loaded.drafter,
                                      batch_size, max_len, decode_config)


def compare_at(config: ml_collections.ConfigDict, loaded: loading.Loaded,
               prompts, temperature: float, *, gamma=None,
               seed_offset: int = 0, mesh=None, timers=()) -> dict:
  """AR and SD at one temperature (and gamma), timed side by side.

  prompts: a `loading.Prompts`, or a list of prompt texts.
  Each decode is compiled and warmed up on the first batch of each prompt
  width before timing (the record's compile_s: those calls' time less the
  same batches' timed runs);
  `timers` time a round after every batch (see `timing.interleave`).
  """
  prompts = loading.Prompts.of(prompts)
  prompt_ids = encode(prompts, loaded.target.tokenizer)
  decode_config = config_lib.decode_config(
      config, temperature, gamma=gamma, eos_id=loaded.target.stop_ids)
  groups = groups_of(prompts)
  all_batches = batches(prompt_ids, config.batch_size, groups)
  width = max(padded.shape[1] for padded, _ in all_batches)
  run = decoders(loaded, decode_config,
                 jax.random.key(config.seed + seed_offset), mesh,
                 adaptive_costs(loaded, decode_config, config.batch_size,
                                width))
  compiling = first_of_each_width(all_batches)
  warmup = timing.interleave(run, [all_batches[i] for i in compiling])
  timed = timing.interleave(run, all_batches, config.timing_repeats, timers)
  record = run_record(decode_config, config.batch_size, prompts, groups,
                      timed)
  record["compile_s"] = {
      name: sum(warmup[name][2][j] - timed[name][2][i]
                for j, i in enumerate(compiling)) for name in run}
  return record


def compare(config: ml_collections.ConfigDict, loaded: loading.Loaded,
            prompts, mesh=None) -> list[dict]:
  """AR and SD on the same prompts and settings, one RUN per temperature.

  With a mesh (the one the pair was loaded on), batches are split over it.
  """
  if mesh is not None:
    sharding.check_batch(config.batch_size, mesh)
  return [compare_at(config, loaded, prompts, temperature, seed_offset=index,
                     mesh=mesh)
          for index, temperature in enumerate(config_lib.temperatures(config))]


def format_category_table(run: dict) -> str:
  lines = [f"T={run['temperature']:g}, gamma {run['gamma']}",
           f"{'category':<16} {'alpha':>6} {'accept':>6} {'tau':>5} "
           f"{'AR tok/s':>9} {'SD tok/s':>9} {'speedup':>7}"]
  for category, totals in run["by_category"].items():
    sd = totals["sd"]
    lines.append(
        f"{category:<16} {sd['mean_overlap']:>6.3f} "
        f"{sd['acceptance_rate']:>6.3f} {sd['tokens_per_cycle']:>5.2f} "
        f"{totals['ar']['tokens_per_s']:>9.1f} {sd['tokens_per_s']:>9.1f} "
        f"{totals['speedup']:>6.2f}x")
  return "\n".join(lines)


def format_table(runs: list[dict]) -> str:
  """alpha = E[sum_x min(p, q)]; accept = accepted / proposed drafts."""
  rows = [{**run, **{f"sd_{k}": v for k, v in run["sd"].items()},
           "ar_tokens_per_s": run["ar"]["tokens_per_s"]} for run in runs]
  return records.text_table(rows, [
      ("T", "{temperature:g}"), ("gamma", "{gamma:d}"),
      ("alpha", "{sd_mean_overlap:.3f}"),
      ("accept", "{sd_acceptance_rate:.3f}"),
      ("tau", "{sd_tokens_per_cycle:.2f}"),
      ("AR tok/s", "{ar_tokens_per_s:.1f}"),
      ("SD tok/s", "{sd_tokens_per_s:.1f}"), ("speedup", "{speedup:.2f}x")])
