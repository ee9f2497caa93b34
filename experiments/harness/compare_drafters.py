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

from experiments.harness import compare, gamma_sweep, loading, records, timing
from experiments.harness import config as config_lib
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
  return {
      "variant": name, "drafter": variant.drafter, "gamma": run["gamma"],
      "temperature": run["temperature"],
      "alpha_min_pq": sd["mean_overlap"],
      # The same drafts' acceptance under a point-mass (one-hot q) verifier.
      "alpha_point_mass": sd["mean_point_mass_acceptance"],
      "acceptance_rate": sd["acceptance_rate"],
      "tokens_per_cycle": sd["tokens_per_cycle"],
      "position_acceptance": sd["position_acceptance"],
      **costs.as_row(),
      "predicted_speedup": costs.speedup_from_depth_acceptance(
          sd["position_acceptance"]),
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
      run, parts = gamma_sweep.measure_row(
          variant, variant.gamma, temperature, loaded, prompts, width,
          max_len, target_timer)
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
  rows = [{**r, "by_position": " ".join(
      f"{a:.2f}" for a in r["position_acceptance"])} for r in result]
  return records.text_table(rows, [
      ("drafter<", "{variant}"), ("T", "{temperature:g}"),
      ("gamma", "{gamma:d}"), ("alpha", "{alpha_min_pq:.3f}"),
      ("tau", "{tokens_per_cycle:.2f}"), ("c", "{draft_cost_ratio:.3f}"),
      ("verify", "{verify_cost_ratio:.2f}"),
      ("AR tok/s", "{ar_tokens_per_s:.1f}"),
      ("SD tok/s", "{sd_tokens_per_s:.1f}"), ("speedup", "{speedup:.2f}x"),
      ("pred", "{predicted_speedup:.2f}x"),
      ("acceptance by position<", "{by_position}")])
