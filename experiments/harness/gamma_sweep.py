"""The gamma ablation: measured speedup and tau against the theory, per gamma.

For every (temperature, gamma) the sweep runs AR and SD side by side on the
same prompts (`compare.compare_at`), times the loop's components inside jitted
loops between those runs' batches (`timing.CycleTimer`, `timing.TargetTimer`),
and sets the measurements beside what they predict:

  * tau measured vs tau from the i.i.d. formula at the measured alpha;
  * speedup measured vs speedup predicted by pricing the work the runs did
    (AR steps, SD cycles, prefills) at the component times, a cycle timed
    whole. These two agree when the loops cost nothing beyond their parts, so
    their ratio is the loops' efficiency. The prediction from the cycle's
    isolated parts (gamma draft steps + a verify) is recorded too: on a CPU a
    cycle costs more than its parts (see timing.py).

With `adaptive_row`, each temperature gets one more run: the adaptive draft
length (`spec_jax.draft_length`), drafting up to the largest gamma, so that
the policy's speedup stands beside the best gamma's in the same run. Each
row is timed beside its own AR runs and component timers, minutes from the
others, and on a shared 2-core machine a row's speedup moves between runs by
more than neighbouring gammas differ; so the sweep ends with a head-to-head
stage (`head_to_head_turns`): every gamma's SD decode and the policy's, and
nothing else, each running every prompt through `batch_size` refilled rows,
take turns (`head_to_head`).

AR decoding does not depend on gamma, so the AR time and the target step are
pooled over each temperature's rows: the median of every row's AR runs (each
row still runs AR beside SD, batch by batch), and the median of every round of
target-step timing.
"""

import concurrent.futures
import logging
import time

import jax
import ml_collections
import numpy as np

from experiments.harness import compare, loading, records, timing
from experiments.harness import config as config_lib
from spec_jax import theory
from spec_jax.decoding import pad_prompts

_log = logging.getLogger(__name__)


def _predictions(run: dict, costs: timing.Costs) -> dict:
  """The same work the measured runs did, priced at the component times:
  with the cycle timed whole (what the loop body costs), and from its parts
  (what gamma draft steps and a verify cost alone)."""
  parts_cycle_s = costs.parts_cycle_s(run["gamma"])
  work = dict(ar_steps=run["ar"]["steps"], sd_cycles=run["sd"]["cycles"],
              num_prefills=run["num_batches"],
              target_prefill_s=costs.target_prefill_s,
              draft_prefill_s=costs.draft_prefill_s)
  return {
      "predicted_speedup": float(theory.predicted_speedup(
          costs.cycle_s, costs.target_step_s, **work)),
      "predicted_speedup_from_parts": float(theory.predicted_speedup(
          parts_cycle_s, costs.target_step_s, **work)),
      # What alternating the two models costs beyond their isolated times.
      "cycle_over_parts": costs.cycle_s / parts_cycle_s,
  }


def row_of(run: dict, costs: timing.Costs, ar_seconds: float) -> dict:
  """One sweep row from a `compare` RUN, the component costs and the AR time
  (pooled over the temperature's rows in the sweep): measured tau and
  speedup beside their predictions."""
  gamma, sd = run["gamma"], run["sd"]
  alpha = sd["mean_overlap"]
  measured = timing.speedup_over_ar(run, ar_seconds)
  # What the cycles really emitted, after EOS and max_new_tokens cut the last
  # one short.
  emitted_per_cycle = sd["new_tokens"] / max(sd["row_cycles"], 1)
  predictions = _predictions(run, costs)
  return {
      "gamma": gamma,
      "temperature": run["temperature"],
      "acceptance_rate": sd["acceptance_rate"],
      "alpha_min_pq": alpha,
      "tokens_per_cycle": sd["tokens_per_cycle"],
      "predicted_tokens_per_cycle_iid": float(
          theory.expected_tokens_per_cycle(alpha, gamma)),
      "emitted_tokens_per_cycle": emitted_per_cycle,
      **costs.as_row(),
      **measured,
      # This row's own AR runs, before pooling.
      "ar_tokens_per_s_row": run["ar"]["tokens_per_s"],
      "sd_tokens_per_s": sd["tokens_per_s"],
      **predictions,
      "measured_over_predicted":
          measured["speedup"] / predictions["predicted_speedup"],
      # The paper's model: i.i.d. acceptance at the measured alpha, with the
      # measured c and verify cost.
      "predicted_speedup_iid": float(theory.expected_speedup_with_verify_cost(
          alpha, gamma, costs.draft_cost_ratio, costs.verify_cost_ratio)),
      # Fraction of row-cycles that accepted the draft at position i
      # (1-based), and P(draft i accepted | proposed, with the drafts before
      # it accepted).
      "accepted_per_position": sd["position_acceptance"],
      "conditional_acceptance_per_position":
          sd["conditional_position_acceptance"],
  }


def adaptive_row_of(run: dict, ar_seconds: float) -> dict:
  """The adaptive draft length's row (`policy: adaptive`, drafting up to
  `gamma`) beside the fixed gammas': measured only, since its cycles draft
  different lengths, which no one gamma's component costs price.
  limit_cycles counts its cycles by draft length, 0 being plain target
  steps."""
  sd = run["sd"]
  return {
      "policy": "adaptive",
      "gamma": run["gamma"],
      "temperature": run["temperature"],
      "acceptance_rate": sd["acceptance_rate"],
      "alpha_min_pq": sd["mean_overlap"],
      "tokens_per_cycle": sd["tokens_per_cycle"],
      **timing.speedup_over_ar(run, ar_seconds),
      "ar_tokens_per_s_row": run["ar"]["tokens_per_s"],
      "sd_tokens_per_s": sd["tokens_per_s"],
      "limit_cycles": sd["limit_cycles"],
  }


def head_to_head(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                 prompts: loading.Prompts, temperature: float) -> dict:
  """Every gamma's SD decode and the adaptive policy's (up to the largest
  gamma), timed against each other with no AR runs or timers between them.
  Each decode runs every prompt through config.batch_size rows, a finished
  row taking the next prompt (`generate(..., slots=B)`), as a loop over a
  data set would: the policy's pooled counts then carry from prompt to
  prompt, where a decode per batch would start each prompt of a few dozen
  cycles at its prior. In each of config.head_to_head_turns turns the
  decodes run one after another, each turn with its own key, so that at
  T > 0 the turns average over samples as well as over the machine's slow
  spells.

  Returns {"seconds": {name: median over turns of its time for every
  prompt}, "best_gamma": the fastest gamma, "adaptive_over_best": the best
  gamma's seconds over the policy's}; names are "gamma_<g>" and "adaptive".
  """
  queue = pad_prompts(compare.encode(prompts, loaded.target.tokenizer))
  eos_id = loaded.target.stop_ids
  gammas = config_lib.gammas(config)
  configs = {f"gamma_{g}": config_lib.decode_config(config, temperature,
                                                     gamma=g, eos_id=eos_id)
             for g in gammas}
  adaptive = ml_collections.ConfigDict(config.to_dict())
  adaptive.policy = "adaptive"
  configs["adaptive"] = config_lib.decode_config(
      adaptive, temperature, gamma=max(gammas), eos_id=eos_id)
  costs = {name: compare.adaptive_costs(loaded, decode_config,
                                        config.batch_size, queue[0].shape[1])
           for name, decode_config in configs.items()}
  seconds = {name: [] for name in configs}
  for turn in range(config.head_to_head_turns):
    key = jax.random.key(config.seed + turn)
    run = {name: compare.decoders(loaded, decode_config, key,
                                  costs=costs[name],
                                  slots=config.batch_size)["sd"]
           for name, decode_config in configs.items()}
    if turn == 0:  # compiles outside the timing
      timing.interleave(run, [queue])
    for name, (_, total, _) in timing.interleave(run, [queue]).items():
      seconds[name].append(total)
  median = {name: float(np.median(s)) for name, s in seconds.items()}
  best = min(gammas, key=lambda g: median[f"gamma_{g}"])
  return {"seconds": median, "best_gamma": best,
          "adaptive_over_best": median[f"gamma_{best}"] / median["adaptive"]}


def _best(rows: list[dict], key: str) -> dict:
  """The row maximising `key`, overall and per temperature."""
  def pick(candidates):
    best = max(candidates, key=lambda r: r[key])
    return {"gamma": best["gamma"], "temperature": best["temperature"],
            key: best[key]}
  temperatures = sorted({r["temperature"] for r in rows})
  return {**pick(rows), "by_temperature": {
      f"{t:g}": pick([r for r in rows if r["temperature"] == t])
      for t in temperatures}}


def measure_row(config, gamma: int, temperature: float,
                loaded: loading.Loaded, prompts, width: int, max_len: int,
                target_timer: timing.TargetTimer, target_every: int = 4,
                min_rounds: int = 0) -> tuple[dict, dict]:
  """One row's `compare_at` RUN and its cycle's component times, timed in
  rounds between the AR and SD runs' batches, so that a slow spell of the
  machine hits both sides of the comparison alike. The target's timer,
  pooled over the rows, gets a round every `target_every`th batch. A row of
  few batches (a large batch size) gets more rounds of both timers after its
  runs, up to `min_rounds`."""
  decode_config = config_lib.decode_config(config, temperature, gamma=gamma)
  # The cycle's timer compiles on one core while the comparison compiles the
  # decode loop on the other.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pending = pool.submit(timing.CycleTimer, loaded.target.model,
                          loaded.drafter, config.batch_size, width, max_len,
                          decode_config)
    cycle_timer = timing.Deferred(pending)
    # The cycle's timer first: its first round waits for it to compile, so
    # that no other timer runs beside the compilation.
    run = compare.compare_at(
        config, loaded, prompts, temperature, gamma=gamma,
        timers=(cycle_timer, timing.EveryNth(target_timer, target_every)))
    # compare_at timed a round before its first batch and after each one.
    for _ in range(min_rounds - run["num_batches"] - 1):
      target_timer.time_round()
      cycle_timer.time_round()
  return run, pending.result().seconds()


def gamma_sweep(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                prompts) -> dict:
  """Runs every (temperature, gamma) of config on the same prompts.

  Returns {"rows", "best_gamma_measured", "best_gamma_predicted"} and logs a
  progress line per row. With config.adaptive_row, one more run per
  temperature, the adaptive draft length up to max(gammas) beside its own
  AR runs and priced against the pooled AR time as the gammas are:
  "adaptive_rows" and "adaptive_over_best_measured" (its speedup over the
  best gamma's, per temperature); and with config.head_to_head_turns,
  "head_to_head" per temperature (`head_to_head`).
  """
  gammas = config_lib.gammas(config)
  temperatures = config_lib.temperatures(config)
  prompts = loading.Prompts.of(prompts)
  prompt_ids = compare.encode(prompts, loaded.target.tokenizer)
  width = pad_prompts(prompt_ids)[0].shape[1]
  total = len(gammas) * len(temperatures)
  rows, adaptive_rows, done, start = [], [], 0, time.perf_counter()
  # A cache length for every gamma (the longest decode loop's), so the target
  # step and the prefills compile once; a few more cache slots change a
  # step's time by well under 1%.
  max_len = width + config.max_new_tokens + max(gammas) + 1
  for temperature in temperatures:
    # AR decoding does not depend on gamma, so every row's AR runs and
    # target-step timings measure the same thing. Pooled over the
    # temperature's rows, their noise shrinks by sqrt(len(gammas)).
    target_timer = timing.TargetTimer(
        loaded.target.model, config.batch_size, width, max_len,
        config_lib.sampling(config, temperature), steps=config.max_new_tokens)
    runs = []
    for gamma in gammas:
      runs.append(measure_row(config, gamma, temperature, loaded, prompts,
                              width, max_len, target_timer))
      run = runs[-1][0]
      done += 1
      elapsed = time.perf_counter() - start
      _log.info(
          "[%d/%d] T=%g gamma=%2d: alpha %.3f, tau %.2f, speedup %.2fx over "
          "this row's AR runs | %.0f s, ETA %.0f s", done, total, temperature,
          gamma, run["sd"]["mean_overlap"], run["sd"]["tokens_per_cycle"],
          run["speedup"], elapsed, elapsed / done * (total - done))
    ar_seconds = float(np.median([run["ar"]["wall_s"] for run, _ in runs]))
    target_parts = target_timer.seconds()
    rows.extend(row_of(run, timing.Costs(**parts, **target_parts), ar_seconds)
                for run, parts in runs)
    if config.get("adaptive_row", False):
      adaptive = ml_collections.ConfigDict(config.to_dict())
      adaptive.policy = "adaptive"
      run = compare.compare_at(adaptive, loaded, prompts, temperature,
                               gamma=max(gammas))
      adaptive_rows.append(adaptive_row_of(run, ar_seconds))
      _log.info("T=%g adaptive, gamma <= %d: tau %.2f, speedup %.2fx over "
                "the pooled AR runs | %.0f s", temperature, max(gammas),
                run["sd"]["tokens_per_cycle"], adaptive_rows[-1]["speedup"],
                time.perf_counter() - start)
    # A temperature's rows compile some 40 programs (each gamma's decodes and
    # timers) that nothing after them reuses; kept, their code exhausted
    # the process's memory maps in the head-to-head stage.
    jax.clear_caches()
  result = {"rows": rows,
            "best_gamma_measured": _best(rows, "speedup"),
            "best_gamma_predicted": _best(rows, "predicted_speedup")}
  if config.get("adaptive_row", False) and config.get("head_to_head_turns"):
    result["head_to_head"] = {}
    for temperature in temperatures:
      versus = head_to_head(config, loaded, prompts, temperature)
      jax.clear_caches()  # its refilled decodes, one per gamma and the policy's
      result["head_to_head"][f"{temperature:g}"] = versus
      _log.info("T=%g head to head: best gamma %d, adaptive %.3f of its "
                "speed | %.0f s", temperature, versus["best_gamma"],
                versus["adaptive_over_best"], time.perf_counter() - start)
  if adaptive_rows:
    best = result["best_gamma_measured"]["by_temperature"]
    result["adaptive_rows"] = adaptive_rows
    # 1 when the policy gets, without a sweep, what the best gamma gets.
    result["adaptive_over_best_measured"] = {
        f"{row['temperature']:g}": row["speedup"] / best[
            f"{row['temperature']:g}"]["speedup"] for row in adaptive_rows}
  return result


def format_adaptive_table(rows: list[dict]) -> str:
  return records.text_table(rows, [
      ("T", "{temperature:g}"), ("gamma <=", "{gamma:d}"),
      ("alpha", "{alpha_min_pq:.3f}"), ("tau", "{tokens_per_cycle:.2f}"),
      ("AR tok/s", "{ar_tokens_per_s:.1f}"),
      ("SD tok/s", "{sd_tokens_per_s:.1f}"), ("speedup", "{speedup:.2f}x"),
      ("cycles by K<", "{limit_cycles}")])


def format_table(rows: list[dict]) -> str:
  return records.text_table(rows, [
      ("T", "{temperature:g}"), ("gamma", "{gamma:d}"),
      ("alpha", "{alpha_min_pq:.3f}"), ("tau", "{tokens_per_cycle:.2f}"),
      ("tau iid", "{predicted_tokens_per_cycle_iid:.2f}"),
      ("c", "{draft_cost_ratio:.3f}"), ("verify", "{verify_cost_ratio:.2f}"),
      ("AR tok/s", "{ar_tokens_per_s:.1f}"),
      ("SD tok/s", "{sd_tokens_per_s:.1f}"), ("speedup", "{speedup:.2f}x"),
      ("predicted", "{predicted_speedup:.2f}x"),
      ("ratio", "{measured_over_predicted:.2f}")])
