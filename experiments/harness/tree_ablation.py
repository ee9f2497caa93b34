"""The tree ablation: draft trees against chains at a similar verify budget.

Each shape is a chain of gamma drafts (`ModelDrafter`) or a tree template
(`TreeDrafter`), drafted by the same draft model, or each by the same EAGLE-3
head (`--config.drafter=eagle3`). For every (temperature,
shape) the ablation runs AR and SD side by side on the same prompts and times
the cycle's parts between their batches (`gamma_sweep.measure_row`, as the gamma
sweep does), then sets beside the measured speedup what the acceptance by
depth predicts:

  predicted  = (1 + sum_d a_d) / (D draft passes + verify of N drafts),
  flat       = the same with the verify at 1 target step,

costs in target steps (`theory.speedup_from_depth_acceptance`). On this CPU a
verify of N drafts costs more the larger N is; "flat" is what an accelerator
whose verify costs about one step at this N would give.
"""

import dataclasses
import logging
import time

import ml_collections
import numpy as np

from experiments.harness import compare, gamma_sweep, loading, records, timing
from experiments.harness import config as config_lib
from spec_jax.decoding import pad_prompts
from spec_jax.draft_tree import TreeTemplate
from spec_jax.drafters import ModelDrafter, TreeDrafter
from spec_jax.eagle import EagleDrafter

_log = logging.getLogger(__name__)


def shapes(config: ml_collections.ConfigDict) -> list[tuple[str, object]]:
  """[(name, drafter factory argument)]: config.chains gammas, then
  config.trees templates."""
  chains = [(f"chain {g}", g) for g in config_lib.chains(config)]
  trees = [(f"tree {','.join(map(str, t))}", TreeTemplate(tuple(t)))
           for t in config.trees]
  return chains + trees


def _drafter(drafter, shape):
  """(drafter, gamma, N, D) for a chain's gamma or a tree's template, drawn
  by the loaded draft model or by the EAGLE-3 head (--config.drafter=eagle3)."""
  tree = shape if isinstance(shape, TreeTemplate) else None
  if isinstance(drafter, EagleDrafter):
    drafter = drafter.with_tree(tree)
  else:
    drafter = TreeDrafter(drafter.model, tree) if tree else ModelDrafter(
        drafter.model)
  if tree:
    return drafter, tree.num_nodes, tree.num_nodes, tree.depth
  return drafter, shape, shape, shape


def _row(name: str, num_nodes: int, depth: int, run: dict,
         costs: timing.Costs, ar_seconds: float) -> dict:
  """One ablation row from a `compare_at` RUN, the component costs and the
  AR time pooled over the temperature's rows."""
  sd = run["sd"]
  depth_acceptance = sd["position_acceptance"]
  measured = timing.speedup_over_ar(run, ar_seconds)
  # A tree's cycle drafts one pass per depth, as a chain's one step per draft.
  predicted = costs.speedup_from_depth_acceptance(depth_acceptance)
  return {
      "shape": name, "num_nodes": num_nodes, "depth": depth,
      "temperature": run["temperature"],
      "tokens_per_cycle": sd["tokens_per_cycle"],
      "nodes_per_cycle": sd["nodes_per_cycle"],
      "alpha_min_pq": sd["mean_overlap"],
      # The same drafts' acceptance under a point-mass (one-hot q) verifier.
      "alpha_point_mass": sd["mean_point_mass_acceptance"],
      # P(the accepted path reaches depth d), d = 1..D.
      "depth_acceptance": depth_acceptance,
      **costs.as_row(),
      **measured,
      "sd_tokens_per_s": sd["tokens_per_s"],
      "predicted_speedup": predicted,
      "measured_over_predicted": measured["speedup"] / predicted,
      "flat_verify_speedup": costs.speedup_from_depth_acceptance(
          depth_acceptance, verify_cost_ratio=1.0),
  }


def tree_ablation(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                  prompts) -> list[dict]:
  """Runs every (temperature, shape) of config on the same prompts; one row
  each, with a progress line."""
  variants = [(name, *_drafter(loaded.drafter, shape))
              for name, shape in shapes(config)]
  temperatures = config_lib.temperatures(config)
  prompts = loading.Prompts.of(prompts)
  width = pad_prompts(compare.encode(prompts, loaded.target.tokenizer))[
      0].shape[1]
  # One cache length for every shape (the largest N's loop), so that the
  # target step and the prefills compile once.
  max_len = width + config.max_new_tokens + max(v[2] for v in variants) + 1
  rows, total = [], len(variants) * len(temperatures)
  start = time.perf_counter()
  for temperature in temperatures:
    target_timer = timing.TargetTimer(
        loaded.target.model, config.batch_size, width, max_len,
        config_lib.sampling(config, temperature), steps=config.max_new_tokens)
    runs = []
    for name, drafter, gamma, num_nodes, depth in variants:
      run, parts = gamma_sweep.measure_row(
          config, gamma, temperature, dataclasses.replace(loaded,
                                                          drafter=drafter),
          prompts, width, max_len, target_timer)
      runs.append((name, num_nodes, depth, run, parts))
      elapsed = time.perf_counter() - start
      _log.info("[%d/%d] T=%g %s: tau %.2f, speedup %.2fx | %.0f s",
                len(rows) + len(runs), total, temperature, name,
                run["sd"]["tokens_per_cycle"], run["speedup"], elapsed)
    ar_seconds = float(np.median([r[3]["ar"]["wall_s"] for r in runs]))
    rows.extend(_row(*r[:4], timing.Costs(**r[4], **target_timer.seconds()),
                     ar_seconds) for r in runs)
  return rows


def format_table(rows: list[dict]) -> str:
  return records.text_table(rows, [
      ("T", "{temperature:g}"), ("shape<", "{shape}"), ("N", "{num_nodes:d}"),
      ("D", "{depth:d}"), ("tau", "{tokens_per_cycle:.2f}"),
      ("verify", "{verify_cost_ratio:.2f}"),
      ("cycle", "{cycle_cost_ratio:.2f}"),
      ("speedup", "{speedup:.2f}x"), ("predicted", "{predicted_speedup:.2f}x"),
      ("flat", "{flat_verify_speedup:.2f}x")])
