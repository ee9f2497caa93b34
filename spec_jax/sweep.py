"""The gamma ablation: measured speedup and tau against the theory, per gamma.

For every (temperature, gamma) the sweep runs AR and SD side by side on the
same prompts (`evaluation.compare`), times the loop's components inside jitted
loops between those runs' batches (`benchmark.ComponentTimer`), and sets the
measurements beside what they predict:

  * tau measured vs tau from the i.i.d. formula at the measured alpha;
  * speedup measured vs speedup predicted by pricing the work the runs did
    (AR steps, SD cycles, prefills) at the component times, a cycle timed
    whole. These two agree when the loops cost nothing beyond their parts, so
    their ratio is the loops' efficiency. The prediction from the cycle's
    isolated parts (gamma draft steps + a verify) is recorded too: on a CPU a
    cycle costs more than its parts (see benchmark.py).

AR decoding does not depend on gamma, so the AR time and the target step are
pooled over each temperature's rows: the median of every row's AR runs (each
row still runs AR beside SD, batch by batch), and the median of every round of
target-step timing.
"""

import concurrent.futures
import itertools
import time

import ml_collections
import numpy as np

from spec_jax import benchmark, evaluation, theory
from spec_jax.decoding import DecodeConfig, pad_prompts
from spec_jax.sampling import Sampling


def parse_gammas(text) -> list[int]:
  """'1,2,4' or '1-10' (inclusive) -> [int]; every gamma must be >= 1."""
  gammas = []
  for part in str(text).split(","):
    if "-" in part:
      low, high = (int(x) for x in part.split("-"))
      gammas.extend(range(low, high + 1))
    elif part.strip():
      gammas.append(int(part))
  if not gammas or min(gammas) < 1:
    raise ValueError(f"gammas={text!r}: give gammas >= 1, e.g. '1-10' or "
                     "'2,4,8'.")
  return gammas


def _row(run: dict, parts: dict, ar_seconds: float) -> dict:
  """One sweep row from a `compare` RUN, the component times and the AR time
  pooled over the temperature's rows."""
  gamma, sd = run["gamma"], run["sd"]
  alpha = sd["mean_overlap"]
  ar_tokens_per_s = run["ar"]["new_tokens"] / ar_seconds
  speedup = sd["tokens_per_s"] / ar_tokens_per_s
  # What the cycles really emitted, after EOS and max_new_tokens cut the last
  # one short.
  emitted_per_cycle = sd["new_tokens"] / max(sd["cycles"], 1)
  c = parts["draft_step_s"] / parts["target_step_s"]
  verify_cost = parts["verify_s"] / parts["target_step_s"]
  # The same work the measured runs did, priced at the component times: with
  # the cycle timed whole (what the loop body costs), and from its parts (what
  # gamma draft steps and a verify cost alone).
  parts_cycle_s = gamma * parts["draft_step_s"] + parts["verify_s"]
  work = dict(ar_steps=run["ar"]["steps"], sd_cycles=sd["loop_cycles"],
              num_prefills=run["num_batches"],
              target_prefill_s=parts["target_prefill_s"],
              draft_prefill_s=parts["draft_prefill_s"])
  predicted = float(theory.predicted_speedup(
      parts["cycle_s"], parts["target_step_s"], **work))
  per_position = np.asarray(sd["accepted_per_position"]) / max(sd["cycles"], 1)
  return {
      "gamma": gamma,
      "temperature": run["temperature"],
      "acceptance_rate": sd["acceptance_rate"],
      "alpha_min_pq": alpha,
      "tokens_per_cycle": sd["tokens_per_cycle"],
      "predicted_tokens_per_cycle_iid": float(
          theory.expected_tokens_per_cycle(alpha, gamma)),
      "emitted_tokens_per_cycle": emitted_per_cycle,
      "draft_cost_ratio_c": c,
      "verify_cost_ratio": verify_cost,
      **parts,
      "ar_tokens_per_s": ar_tokens_per_s,
      # This row's own AR runs, before pooling.
      "ar_tokens_per_s_row": run["ar"]["tokens_per_s"],
      "sd_tokens_per_s": sd["tokens_per_s"],
      "speedup": speedup,
      "predicted_speedup": predicted,
      "measured_over_predicted": speedup / predicted,
      "predicted_speedup_from_parts": float(theory.predicted_speedup(
          parts_cycle_s, parts["target_step_s"], **work)),
      # What alternating the two models costs beyond their isolated times.
      "cycle_over_parts": parts["cycle_s"] / parts_cycle_s,
      # The paper's model: i.i.d. acceptance at the measured alpha, with the
      # measured c and verify cost.
      "predicted_speedup_iid": float(theory.expected_speedup_with_verify_cost(
          alpha, gamma, c, verify_cost)),
      # Fraction of cycles that accepted the draft at position i (1-based).
      "accepted_per_position": per_position.tolist(),
  }


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


def _measure(config, gamma: int, temperature: float, target, drafter,
             tokenizer, prompts, width: int, max_len: int,
             target_timer: benchmark.TargetTimer) -> tuple[dict, dict]:
  """One row's `compare` RUN and its cycle's component times, timed in rounds
  between the AR and SD runs' batches, so that a slow spell of the machine
  hits both sides of the comparison alike. The target's timer, pooled over
  the rows, gets a round every fourth batch."""
  run_config = ml_collections.ConfigDict(config.to_dict())
  run_config.gamma = gamma
  run_config.temperature = str(temperature)
  decode_config = DecodeConfig(
      gamma=gamma, max_new_tokens=config.max_new_tokens,
      sampling=Sampling(temperature=temperature, top_k=config.top_k,
                        top_p=config.top_p))
  # The cycle's timer compiles on one core while `compare` compiles the
  # decode loop on the other.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pending = pool.submit(benchmark.CycleTimer, target, drafter,
                          config.batch_size, width, max_len, decode_config)
    batches = itertools.count()

    def time_components():
      if next(batches) % 4 == 0:
        target_timer.time_round()
      pending.result().time_round()

    (run,) = evaluation.compare(
        run_config, target, drafter, tokenizer, prompts,
        before_timing=pending.result, after_batch=time_components)
  return run, pending.result().seconds()


def gamma_sweep(config: ml_collections.ConfigDict, target, drafter, tokenizer,
                prompts: list[str], log=print) -> dict:
  """Runs every (temperature, gamma) of config on the same prompts.

  Returns {"rows", "best_gamma_measured", "best_gamma_predicted"}; `log`
  receives a progress line per row.
  """
  gammas = parse_gammas(config.gammas)
  temperatures = evaluation.parse_temperatures(config.temperature)
  prompt_ids = [tokenizer.encode(p).ids or [0] for p in prompts]
  width = pad_prompts(prompt_ids)[0].shape[1]
  total = len(gammas) * len(temperatures)
  rows, done, start = [], 0, time.perf_counter()
  # A cache length for every gamma (the longest decode loop's), so the target
  # step and the prefills compile once; a few more cache slots change a
  # step's time by well under 1%.
  max_len = width + config.max_new_tokens + max(gammas) + 1
  for temperature in temperatures:
    sampling = Sampling(temperature=temperature, top_k=config.top_k,
                        top_p=config.top_p)
    # AR decoding does not depend on gamma, so every row's AR runs and
    # target-step timings measure the same thing. Pooled over the
    # temperature's rows, their noise shrinks by sqrt(len(gammas)).
    target_timer = benchmark.TargetTimer(
        target, config.batch_size, width, max_len, sampling,
        steps=config.max_new_tokens)
    runs = []
    for gamma in gammas:
      runs.append(_measure(config, gamma, temperature, target, drafter,
                           tokenizer, prompts, width, max_len, target_timer))
      run = runs[-1][0]
      done += 1
      elapsed = time.perf_counter() - start
      eta = elapsed / done * (total - done)
      log(f"[{done}/{total}] T={temperature:g} gamma={gamma:2d}: alpha "
          f"{run['sd']['mean_overlap']:.3f}, tau "
          f"{run['sd']['tokens_per_cycle']:.2f}, speedup {run['speedup']:.2f}x"
          f" over this row's AR runs | {elapsed:.0f} s, ETA {eta:.0f} s")
    ar_seconds = float(np.median([run["ar"]["wall_s"] for run, _ in runs]))
    target_parts = target_timer.seconds()
    rows.extend(_row(run, {**parts, **target_parts}, ar_seconds)
                for run, parts in runs)
  return {"rows": rows,
          "best_gamma_measured": _best(rows, "speedup"),
          "best_gamma_predicted": _best(rows, "predicted_speedup")}


def format_table(rows: list[dict]) -> str:
  lines = [f"{'T':>3} {'gamma':>5} {'alpha':>6} {'tau':>5} {'tau iid':>7} "
           f"{'c':>6} {'verify':>6} {'AR tok/s':>8} {'SD tok/s':>8} "
           f"{'speedup':>7} {'predicted':>9} {'ratio':>5}"]
  for r in rows:
    lines.append(
        f"{r['temperature']:>3g} {r['gamma']:>5d} {r['alpha_min_pq']:>6.3f} "
        f"{r['tokens_per_cycle']:>5.2f} "
        f"{r['predicted_tokens_per_cycle_iid']:>7.2f} "
        f"{r['draft_cost_ratio_c']:>6.3f} {r['verify_cost_ratio']:>6.2f} "
        f"{r['ar_tokens_per_s']:>8.1f} {r['sd_tokens_per_s']:>8.1f} "
        f"{r['speedup']:>6.2f}x {r['predicted_speedup']:>8.2f}x "
        f"{r['measured_over_predicted']:>5.2f}")
  return "\n".join(lines)
