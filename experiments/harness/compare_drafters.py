"""Drafters side by side on the same prompts: what each accepts and costs.

Each variant is the experiment's config with a few fields overridden. For
each, at every temperature: alpha, tau, acceptance by draft position, the
cost of a draft step and of a verify in target steps (c and v, timed in
rounds between the AR and SD runs' batches, as the gamma sweep does), the
measured speedup and the speedup those predict,
(1 + sum_i a_i) / (gamma c + v).
"""

import logging

import ml_collections

from experiments.harness import compare, gamma_sweep, loading, timing
from experiments.harness import config as config_lib
from spec_jax import theory
from spec_jax.decoding import pad_prompts

_log = logging.getLogger(__name__)


def _variants(config: ml_collections.ConfigDict):
  """(name, the variant's full config, its overrides) for each variant."""
  for name, overrides in config.variants.items():
    variant = ml_collections.ConfigDict(config.to_dict())
    del variant["variants"]
    variant.update(overrides)
    yield name, variant, (overrides.to_dict() if hasattr(overrides, "to_dict")
                          else dict(overrides))


def _row(name, variant, overrides, run, costs: timing.Costs) -> dict:
  sd = run["sd"]
  depth = len(sd["position_acceptance"])
  return {
      "variant": name, "drafter": variant.drafter, "gamma": run["gamma"],
      "temperature": run["temperature"],
      "alpha_min_pq": sd["mean_overlap"],
      "acceptance_rate": sd["acceptance_rate"],
      "tokens_per_cycle": sd["tokens_per_cycle"],
      "position_acceptance": sd["position_acceptance"],
      **costs.as_row(),
      "predicted_speedup": float(theory.speedup_from_depth_acceptance(
          sd["position_acceptance"], depth * costs.draft_cost_ratio,
          costs.verify_cost_ratio)),
      "ar_tokens_per_s": run["ar"]["tokens_per_s"],
      "sd_tokens_per_s": sd["tokens_per_s"], "speedup": run["speedup"],
      "overrides": overrides}


def compare_drafters(config: ml_collections.ConfigDict) -> list[dict]:
  """One row per (variant, temperature); see the module docstring."""
  result = []
  variants = list(_variants(config))
  for index, (name, variant, overrides) in enumerate(variants):
    loaded = loading.load_models(variant)
    prompts = loading.Prompts.of(loading.load_prompt_set(variant, loaded))
    width = pad_prompts(compare.encode(prompts,
                                       loaded.target.tokenizer))[0].shape[1]
    num_nodes, _ = loaded.drafter.cycle_shape(variant.gamma)
    max_len = width + variant.max_new_tokens + num_nodes + 1
    for temperature in config_lib.temperatures(variant):
      target_timer = timing.TargetTimer(
          loaded.target.model, variant.batch_size, width, max_len,
          config_lib.sampling(variant, temperature),
          steps=variant.max_new_tokens)
      run, parts = gamma_sweep.measure_row(variant, variant.gamma, temperature,
                                     loaded, prompts, width, max_len,
                                     target_timer)
      row = _row(name, variant, overrides, run,
                 timing.Costs(**parts, **target_timer.seconds()))
      result.append(row)
      _log.info("[%d/%d] %s, T=%g: alpha %.3f, tau %.2f, c %.3f, verify "
                "%.2f steps, speedup %.2fx (predicted %.2fx)", index + 1,
                len(variants), name, temperature, row["alpha_min_pq"],
                row["tokens_per_cycle"], row["draft_cost_ratio"],
                row["verify_cost_ratio"], row["speedup"],
                row["predicted_speedup"])
  return result


def format_table(result: list[dict]) -> str:
  width = max(len(r["variant"]) for r in result)
  lines = [f"{'drafter':<{width}} {'T':>3} {'gamma':>5} {'alpha':>6} "
           f"{'tau':>5} {'c':>6} {'verify':>6} {'AR tok/s':>8} "
           f"{'SD tok/s':>8} {'speedup':>7} {'pred':>6}  acceptance by "
           "position"]
  for r in result:
    by_position = " ".join(f"{a:.2f}" for a in r["position_acceptance"])
    lines.append(
        f"{r['variant']:<{width}} {r['temperature']:>3g} {r['gamma']:>5d} "
        f"{r['alpha_min_pq']:>6.3f} {r['tokens_per_cycle']:>5.2f} "
        f"{r['draft_cost_ratio']:>6.3f} "
        f"{r['verify_cost_ratio']:>6.2f} "
        f"{r['ar_tokens_per_s']:>8.1f} {r['sd_tokens_per_s']:>8.1f} "
        f"{r['speedup']:>6.2f}x {r['predicted_speedup']:>5.2f}x  "
        f"{by_position}")
  return "\n".join(lines)
