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
"""

import logging
import time

import ml_collections

from experiments.harness import compare, gamma_sweep, loading, timing
from experiments.harness import config as config_lib
from spec_jax import theory
from spec_jax.decoding import pad_prompts

_log = logging.getLogger(__name__)


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


def crossover(rows: list[dict], key: str) -> dict:
  """{temperature: the smallest batch size at which `key` (a speedup) is
  below 1, or None if it never is}."""
  result = {}
  for row in sorted(rows, key=lambda r: r["batch_size"]):
    name = f"{row['temperature']:g}"
    result.setdefault(name, None)
    if result[name] is None and row[key] < 1:
      result[name] = row["batch_size"]
  return result


def batch_scaling(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                  prompts) -> dict:
  """Runs every (temperature, batch size) of config on the same prompts.

  Returns {"rows", "crossover"}: one row per (temperature, batch size), and
  per temperature the smallest batch size at which SD is slower than AR,
  measured and predicted. Logs a progress line per row.
  """
  sizes = config_lib.batch_sizes(config)
  temperatures = config_lib.temperatures(config)
  prompts = loading.Prompts.of(prompts)
  if len(prompts.texts) < max(sizes):
    _log.warning("%d prompts fill no batch of %d: its padding rows cost time "
                 "but emit no counted token; raise --config.num_prompts.",
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
      rows.append(row_of(batch_size, run,
                         timing.Costs(**parts, **target_timer.seconds())))
      row, elapsed = rows[-1], time.perf_counter() - start
      _log.info(
          "[%d/%d] T=%g batch=%2d: tau %.2f, c %.3f, verify/step %.2f, "
          "speedup %.2fx (predicted %.2fx) | %.0f s, ETA %.0f s", len(rows),
          total, temperature, batch_size, row["tokens_per_cycle"],
          row["draft_cost_ratio"], row["verify_cost_ratio"], row["speedup"],
          row["predicted_speedup_iid"], elapsed,
          elapsed / len(rows) * (total - len(rows)))
  return {"rows": rows,
          "crossover": {"measured": crossover(rows, "speedup"),
                        "predicted": crossover(rows, "predicted_speedup_iid")}}


def format_table(rows: list[dict]) -> str:
  lines = [f"{'T':>3} {'batch':>5} {'alpha':>6} {'tau':>5} {'c':>6} "
           f"{'verify':>6} {'/(g+1)':>6} {'step ms':>7} {'ms/row':>6} "
           f"{'AR/cycle':>8} {'AR tok/s':>8} {'SD tok/s':>8} {'speedup':>7} "
           f"{'predicted':>9} {'priced':>6} {'break-even v':>12}"]
  for r in rows:
    lines.append(
        f"{r['temperature']:>3g} {r['batch_size']:>5d} "
        f"{r['alpha_min_pq']:>6.3f} {r['tokens_per_cycle']:>5.2f} "
        f"{r['draft_cost_ratio']:>6.3f} {r['verify_cost_ratio']:>6.2f} "
        f"{r['verify_over_gamma_plus_1']:>6.2f} "
        f"{1e3 * r['target_step_s']:>7.2f} "
        f"{1e3 * r['target_step_s_per_row']:>6.3f} "
        f"{r['ar_steps_per_sd_cycle']:>8.2f} "
        f"{r['ar_tokens_per_s']:>8.1f} {r['sd_tokens_per_s']:>8.1f} "
        f"{r['speedup']:>6.2f}x {r['predicted_speedup_iid']:>8.2f}x "
        f"{r['predicted_speedup']:>5.2f}x "
        f"{r['break_even_verify_cost']:>12.2f}")
  return "\n".join(lines)
