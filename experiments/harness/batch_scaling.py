"""The batch-scaling ablation: where speculative decoding stops paying as the
batch grows, and why.

For every (temperature, batch size) the ablation runs AR and SD side by side
on the same prompts and times the loop's parts at that batch between their
batches (`gamma_sweep.measure_row`, as the gamma sweep does): a target step,
a draft step (c = draft step / target step) and a verify of gamma + 1 tokens
with its rejection step (v = verify / target step; both `timing.Costs`).
Beside the measured speedup it sets

  predicted        tau_iid(alpha) / (gamma c + v), the i.i.d. model at the
                   measured alpha, c and v (`theory`);
  priced work      the AR steps and SD loop cycles the runs took, priced at
                   the component times (`theory.predicted_speedup`);
  flat verify      the i.i.d. model with v = 1, what a verify priced like one
                   step would give;
  break-even v     (AR steps per SD loop cycle) - gamma c: SD pays while v
                   stays below it (prefills aside).

Why it stops paying: at batch 1 a step is memory-bound (it reads every
weight for one token per row), so a verify of gamma + 1 tokens reads the same
weights and costs little more than a step. As the batch grows a step does
more arithmetic per weight read, until it is compute-bound; a verify then
does gamma + 1 times a step's arithmetic and v climbs toward gamma + 1
(`verify_over_gamma_plus_1` = v / (gamma + 1) climbs toward 1, and the step
time per row stops falling). Meanwhile tau, which is per row, does not grow
with the batch, and the loop runs every row until the slowest is done, so
the AR steps an SD loop cycle replaces fall below tau as rows diverge. SD
stops paying where v crosses the break-even. (On a CPU whose one-row matmul
is a fast GEMV and whose 2-row one is not, v can also drop from batch 1 to 2:
the step leaves the fast path first.)

Each (temperature, batch size) runs three ways. `refill: false, policy:
fixed` decodes the prompts in fixed batches, each until its slowest row is
done (the rows above). With `refill: true` the whole prompt queue goes
through batch_size rows (`generate(..., slots=B)`), a finished row taking
the next prompt inside the loop, for AR and SD alike, AR with refill being
the baseline of both refill rows: `policy: fixed` drafts gamma every cycle,
`policy: adaptive` the goodput-optimal K of `spec_jax.draft_length`, from
costs calibrated at this batch size before the runs (`cycle_costs` in the
row). The refill rows reuse the fixed batches' component costs (the same
target, drafter and batch size) for their predictions, which the adaptive
rows leave null (`GAMMA_PREDICTIONS`: they model cycles of gamma drafts);
their AR steps are the refilled AR loop's iterations
(`refill.loop_iterations`). Each refill row also gives its prompts' cycles
(`prompt_cycles`), the share of its row-cycles that decoded a prompt
(`busy_share`; ar_steps_per_sd_cycle / tokens_per_cycle is the same share
when AR's prompts all run max_new_tokens) and the share the same prompts
would give queued longest first (`busy_share_longest_first`), an order
that needs every prompt's cycles in advance: what is left between the two
is the queue order's, and what is left above the latter, the queue's end.
"""

import dataclasses
import logging
import time

import jax
import ml_collections
import numpy as np

from experiments.harness import compare, gamma_sweep, loading, records, timing
from experiments.harness import config as config_lib
from spec_jax import refill, theory
from spec_jax.decoding import loop_verify_widths, pad_prompts
from spec_jax.draft_length import AdaptiveDraftLength

_log = logging.getLogger(__name__)


# A row's fields that model cycles of gamma drafts each.
GAMMA_PREDICTIONS = (
    "predicted_tokens_per_cycle_iid", "predicted_speedup",
    "predicted_speedup_from_parts", "measured_over_predicted",
    "predicted_speedup_iid", "predicted_speedup_flat_verify",
    "break_even_verify_cost")


def row_of(batch_size: int, run: dict, costs: timing.Costs) -> dict:
  """One ablation row: the sweep's measured-vs-predicted row
  (`gamma_sweep.row_of`, AR time from this row's own runs) and the
  batch-scaling columns."""
  row = gamma_sweep.row_of(run, costs, run["ar"]["wall_s"])
  gamma, c = row["gamma"], costs.draft_cost_ratio
  # What one loop cycle replaces: at batch 1 about tau; below it when rows
  # accept different numbers of drafts and the loop waits for the slowest.
  ar_steps_per_cycle = run["ar"]["steps"] / max(run["sd"]["cycles"], 1)
  return {
      "batch_size": batch_size,
      **row,
      # 1 when a verify of gamma + 1 tokens costs gamma + 1 steps: the step
      # is compute-bound and verifying in one pass saves nothing.
      "verify_over_gamma_plus_1": costs.verify_cost_ratio / (gamma + 1),
      # Falls with the batch while a step is memory-bound, flat once it is
      # compute-bound.
      "target_step_s_per_row": costs.target_step_s / batch_size,
      "predicted_speedup_flat_verify": float(
          theory.expected_speedup_with_verify_cost(row["alpha_min_pq"], gamma,
                                                   c, 1.0)),
      "ar_steps_per_sd_cycle": ar_steps_per_cycle,
      # speedup ~ (AR steps / SD cycles) / (gamma c + v) is 1 at this v.
      "break_even_verify_cost": ar_steps_per_cycle - gamma * c,
  }


def busy_shares(prompt_cycles: list[int], slots: int, cycles: int) -> dict:
  """The share of a refilled loop's row-cycles (slots x cycles) that decoded
  a prompt, and the share the same prompts give queued longest first."""
  total = sum(prompt_cycles)
  longest_first = refill.loop_iterations(sorted(prompt_cycles, reverse=True),
                                         slots)
  return {"busy_share": total / (slots * max(cycles, 1)),
          "busy_share_longest_first": total / (slots * max(longest_first, 1))}


def refill_rows(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                prompts: loading.Prompts, batch_size: int,
                temperature: float, width: int, max_len: int,
                costs: timing.Costs) -> list[dict]:
  """The refill rows at one (temperature, batch size): the prompt queue
  through batch_size rows, AR, SD at gamma and SD with the adaptive draft
  length timed side by side (AR the baseline of both)."""
  target, drafter = loaded.target.model, loaded.drafter
  padded, lengths = pad_prompts(compare.encode(prompts,
                                               loaded.target.tokenizer),
                                min_width=width)
  fixed = config_lib.decode_config(config, temperature,
                                   eos_id=loaded.target.stop_ids)
  adaptive = dataclasses.replace(
      fixed, verify_buckets=config.adaptive_verify_buckets,
      adaptive=AdaptiveDraftLength())
  cycle_costs = timing.calibrate_cycle_costs(target, drafter, batch_size,
                                             max_len, adaptive)
  key = jax.random.key(config.seed)
  fixed_decoders = compare.decoders(loaded, fixed, key, slots=batch_size)
  decoders = {
      "ar": fixed_decoders["ar"], "fixed": fixed_decoders["sd"],
      "adaptive": compare.decoders(loaded, adaptive, key, costs=cycle_costs,
                                   slots=batch_size)["sd"],
  }
  for decode in decoders.values():  # compiles
    jax.block_until_ready(decode(padded, lengths))
  timed = timing.interleave(decoders, [(padded, lengths)],
                            config.timing_repeats)
  ar_tokens = np.asarray(timed["ar"][0][0].num_tokens)
  ar = {"new_tokens": int(ar_tokens.sum()), "wall_s": timed["ar"][1],
        "tokens_per_s": int(ar_tokens.sum()) / timed["ar"][1],
        "steps": refill.loop_iterations(ar_tokens.tolist(), batch_size)}
  rows = []
  for policy in ("fixed", "adaptive"):
    (result,), seconds, _ = timed[policy]
    new_tokens = int(np.asarray(result.num_tokens).sum())
    run = {"gamma": config.gamma, "temperature": temperature,
           # Prefills priced as the fixed batches' would be.
           "num_batches": -(-len(padded) // batch_size), "ar": ar,
           "sd": {"new_tokens": new_tokens, "wall_s": seconds,
                  "tokens_per_s": new_tokens / seconds,
                  **result.stats.summary()}}
    row = row_of(batch_size, run, costs)
    prompt_cycles = np.asarray(result.stats.row_cycles).tolist()
    row.update(policy=policy, refill=True, cycles=run["sd"]["cycles"],
               limit_cycles=run["sd"]["limit_cycles"],
               prompt_cycles=prompt_cycles,
               **busy_shares(prompt_cycles, batch_size, run["sd"]["cycles"]))
    if policy == "adaptive":
      # Its cycles draft 0..gamma tokens: the predictions for cycles of
      # gamma drafts do not apply to it.
      row.update(dict.fromkeys(GAMMA_PREDICTIONS))
      row["cycle_costs"] = {
          "draft_step": float(cycle_costs.draft_step),
          "catch_up": float(cycle_costs.catch_up),
          "overhead": float(cycle_costs.overhead),
          "verify_widths": list(loop_verify_widths(drafter, adaptive)),
          "verify": np.asarray(cycle_costs.verify).tolist()}
    rows.append(row)
  return rows


def crossover(rows: list[dict], key: str) -> dict:
  """{temperature: the smallest batch size at which `key` (a speedup) is
  below 1, or None if it never is}; rows without `key` (None) are left
  out."""
  result = {}
  for row in sorted(rows, key=lambda r: r["batch_size"]):
    if row[key] is None:
      continue
    name = f"{row['temperature']:g}"
    if "policy" in row and (row["policy"], row["refill"]) != ("fixed", False):
      name += f" {row['policy']}{' refill' if row['refill'] else ''}"
    result.setdefault(name, None)
    if result[name] is None and row[key] < 1:
      result[name] = row["batch_size"]
  return result


def batch_scaling(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                  prompts) -> dict:
  """Runs every (temperature, batch size) of config on the same prompts.

  Returns {"rows", "crossover"}: three rows per (temperature, batch size)
  (fixed batches; refill with gamma; refill with the adaptive draft
  length), and per temperature (and policy) the smallest batch size at
  which SD is slower than AR, measured and predicted. Logs a progress line
  per (temperature, batch size).
  """
  if config.policy != "fixed":
    raise ValueError("batch_scaling runs both draft-length policies side by "
                     "side; leave --config.policy unset.")
  sizes = config_lib.batch_sizes(config)
  temperatures = config_lib.temperatures(config)
  prompts = loading.Prompts.of(prompts)
  if len(prompts.texts) < 4 * max(sizes):
    _log.warning("%d prompts are fewer than 4 per row at batch %d: refill "
                 "has little to reuse; raise --config.num_prompts.",
                 len(prompts.texts), max(sizes))
  width = pad_prompts(compare.encode(prompts, loaded.target.tokenizer))[
      0].shape[1]
  max_len = width + config.max_new_tokens + config.gamma + 1
  rows, total, start = [], len(sizes) * len(temperatures), time.perf_counter()
  for temperature in temperatures:
    for batch_size in sizes:
      at_batch = ml_collections.ConfigDict(config.to_dict())
      at_batch.batch_size = batch_size
      # The target's step at this batch, timed between this row's batches
      # only (AR at one batch size is not pooled with another's).
      target_timer = timing.TargetTimer(
          loaded.target.model, batch_size, width, max_len,
          config_lib.sampling(config, temperature),
          steps=config.max_new_tokens)
      run, parts = gamma_sweep.measure_row(
          at_batch, config.gamma, temperature, loaded, prompts, width,
          max_len, target_timer, target_every=1, min_rounds=config.rounds)
      costs = timing.Costs(**parts, **target_timer.seconds())
      at_size = [{**row_of(batch_size, run, costs), "policy": "fixed",
                  "refill": False}]
      at_size += refill_rows(config, loaded, prompts, batch_size,
                             temperature, width, max_len, costs)
      rows.extend(at_size)
      # Each cell compiles a dozen programs (both decodes at this batch in
      # fixed batches and refilled, the timers) that no other cell reuses;
      # kept, their code exhausted memory late in a full run.
      jax.clear_caches()
      done, elapsed = len(rows) // 3, time.perf_counter() - start
      _log.info(
          "[%d/%d] T=%g batch=%2d: tau %.2f, c %.3f, verify/step %.2f; "
          "SD/AR %.2fx batched, %.2fx refilled, %.2fx adaptive | %.0f s, "
          "ETA %.0f s", done, total, temperature, batch_size,
          at_size[0]["tokens_per_cycle"], at_size[0]["draft_cost_ratio"],
          at_size[0]["verify_cost_ratio"],
          *(row["speedup"] for row in at_size), elapsed,
          elapsed / done * (total - done))
  return {"rows": rows,
          "crossover": {"measured": crossover(rows, "speedup"),
                        "predicted": crossover(rows, "predicted_speedup_iid")}}


def format_table(rows: list[dict]) -> str:
  return records.text_table(rows, [
      ("T", "{temperature:g}"), ("batch", "{batch_size:d}"),
      ("policy", "{policy}"), ("refill", "{refill}"),
      ("alpha", "{alpha_min_pq:.3f}"), ("tau", "{tokens_per_cycle:.2f}"),
      ("c", "{draft_cost_ratio:.3f}"), ("verify", "{verify_cost_ratio:.2f}"),
      ("/(g+1)", "{verify_over_gamma_plus_1:.2f}"),
      ("step s", "{target_step_s:.4f}"),
      ("AR/cycle", "{ar_steps_per_sd_cycle:.2f}"),
      ("AR tok/s", "{ar_tokens_per_s:.1f}"),
      ("SD tok/s", "{sd_tokens_per_s:.1f}"), ("speedup", "{speedup:.2f}x"),
      ("predicted", "{predicted_speedup_iid:.2f}x"),
      ("priced", "{predicted_speedup:.2f}x"),
      ("break-even v", "{break_even_verify_cost:.2f}")])
