"""Figures of the ablations: a gamma sweep (the dict `gamma_sweep.gamma_sweep`
returns), drafters, categories, trees, batch scaling and an EAGLE head's
learning curve.

Figures are built without pyplot, so nothing depends on a global backend: a
script saves them as PNG, a notebook displays the returned objects.
"""

import os

from matplotlib.figure import Figure
import numpy as np

from spec_jax.io import files


def _fixed(rows):
  """The rows of a fixed gamma (a sweep's adaptive rows left out)."""
  return [r for r in rows if r.get("policy", "fixed") == "fixed"]


def _by_temperature(rows):
  """{temperature: the fixed-gamma rows sorted by gamma}."""
  groups = {}
  for row in sorted(_fixed(rows), key=lambda r: r["gamma"]):
    groups.setdefault(row["temperature"], []).append(row)
  return groups


def _measured_vs_predicted(rows, measured, predicted, predicted_label,
                           title, ylabel) -> Figure:
  figure = Figure(figsize=(6, 4), layout="constrained")
  axes = figure.add_subplot()
  for index, (temperature, group) in enumerate(
      _by_temperature(rows).items()):
    color = f"C{index}"
    gammas = [r["gamma"] for r in group]
    axes.plot(gammas, [r[measured] for r in group], "o-", color=color,
              label=f"T={temperature:g} measured")
    axes.plot(gammas, [r[predicted] for r in group], "s--", color=color,
              alpha=0.7, label=f"T={temperature:g} {predicted_label}")
  axes.set(title=title, xlabel="draft length gamma", ylabel=ylabel)
  axes.set_xticks(sorted({r["gamma"] for r in _fixed(rows)}))
  axes.grid(alpha=0.3)
  axes.legend()
  return figure


def tokens_per_cycle_figure(rows) -> Figure:
  return _measured_vs_predicted(
      rows, "tokens_per_cycle", "predicted_tokens_per_cycle_iid",
      "i.i.d. model at measured alpha",
      "Tokens per cycle: measured vs i.i.d. prediction",
      "tokens per cycle (tau)")


def speedup_figure(rows) -> Figure:
  figure = _measured_vs_predicted(
      rows, "speedup", "predicted_speedup",
      "predicted from tau and component times",
      "Speedup over autoregressive decoding", "speedup (x)")
  axes = figure.axes[0]
  axes.axhline(1.0, color="gray", lw=0.8)
  temperatures = list(_by_temperature(rows))
  for row in rows:
    if row.get("policy") == "adaptive":  # no gamma of its own: a level
      axes.axhline(row["speedup"], ls=":", lw=1.5,
                   color=f"C{temperatures.index(row['temperature'])}",
                   label=f"T={row['temperature']:g} adaptive, "
                         f"gamma <= {row['gamma']}")
  axes.legend()
  return figure


def acceptance_by_position_figure(rows) -> Figure:
  """P(draft i accepted | draft i-1 accepted) at each temperature's largest
  gamma. Under the i.i.d. model every position is accepted with the same
  probability alpha (dotted)."""
  figure = Figure(figsize=(6, 4), layout="constrained")
  axes = figure.add_subplot()
  for index, (temperature, group) in enumerate(
      _by_temperature(rows).items()):
    row = group[-1]
    conditional = np.array(row["conditional_acceptance_per_position"], float)
    positions = np.arange(1, len(conditional) + 1)
    axes.plot(positions, conditional, "o-", color=f"C{index}",
              label=f"T={temperature:g}, gamma={row['gamma']}")
    axes.axhline(row["alpha_min_pq"], color=f"C{index}", ls=":",
                 label=f"T={temperature:g} alpha (i.i.d. model)")
  axes.set(title="Acceptance by draft position",
           xlabel="draft position i",
           ylabel="P(accept draft i | drafts before it accepted)",
           ylim=(0, 1.02))
  axes.set_xticks(positions)
  axes.grid(alpha=0.3)
  axes.legend()
  return figure


def _speedup_bars(labels: list[str], series: list[tuple], title: str
                  ) -> Figure:
  """Horizontal speedup bars: one group per label, one bar per series
  (name, {label: speedup}, {label: bar annotation} or None)."""
  figure = Figure(figsize=(7, 0.5 * len(labels) + 1.5), layout="constrained")
  axes = figure.add_subplot()
  height = 0.8 / len(series)
  for index, (name, speedups, notes) in enumerate(series):
    bars = axes.barh(np.arange(len(labels)) + index * height,
                     [speedups.get(label, np.nan) for label in labels],
                     height, label=name)
    if notes is not None:
      axes.bar_label(bars, [notes.get(label, "") for label in labels],
                     padding=3, fontsize=8)
  axes.set_yticks(np.arange(len(labels)) + 0.4 - height / 2, labels)
  axes.invert_yaxis()
  axes.axvline(1.0, color="gray", lw=0.8)
  axes.set(title=title, xlabel="speedup (x)")
  axes.legend()
  return figure


def drafters_figure(rows) -> Figure:
  """Speedup of each drafter variant, one bar per temperature."""
  series = [(f"T={t:g}", {r["variant"]: r["speedup"] for r in rows
                          if r["temperature"] == t}, None)
            for t in sorted({r["temperature"] for r in rows})]
  return _speedup_bars(list(dict.fromkeys(r["variant"] for r in rows)),
                       series, "Speedup over autoregressive decoding by "
                       "drafter")


def categories_figure(runs) -> Figure:
  """Speedup (bars) and tau (labels) per prompt category, one bar per
  temperature, from the main job's runs."""
  series = [(f"T={run['temperature']:g}, gamma={run['gamma']}",
             {c: t["speedup"] for c, t in run["by_category"].items()},
             {c: f"tau {t['sd']['tokens_per_cycle']:.2f}"
              for c, t in run["by_category"].items()}) for run in runs]
  return _speedup_bars(list(runs[0]["by_category"]), series,
                       "Speedup over autoregressive decoding by task")


def tree_ablation_figure(rows) -> Figure:
  """Measured speedup of each chain and tree (bars labelled with tau and the
  verify cost in target steps), and what a flat verify cost would give."""
  temperatures = sorted({r["temperature"] for r in rows})
  series = []
  for t in temperatures:
    at = [r for r in rows if r["temperature"] == t]
    series.append((f"T={t:g} measured", {r["shape"]: r["speedup"] for r in at},
                   {r["shape"]: f"tau {r['tokens_per_cycle']:.2f}, verify "
                    f"{r['verify_cost_ratio']:.1f}" for r in at}))
    series.append((f"T={t:g} predicted, verify at 1 step",
                   {r["shape"]: r["flat_verify_speedup"] for r in at}, None))
  return _speedup_bars(list(dict.fromkeys(r["shape"] for r in rows)), series,
                       "Trees against chains: speedup over autoregressive")


def batch_scaling_figure(rows) -> Figure:
  """Against batch size, per temperature: speedup over AR, one line per
  policy (fixed batches; refill at gamma; refill with the adaptive draft
  length), with the fixed batches' prediction (the i.i.d. model at the
  measured alpha, c and verify cost; dotted, the runs' work priced at the
  component times); tau and the AR steps each SD loop cycle replaced, in
  fixed batches and with refill; and verify / step beside gamma + 1 and the
  break-even verify cost above which SD is slower than AR."""
  figure = Figure(figsize=(13, 4), layout="constrained")
  speedup, tau, verify = figure.subplots(1, 3)
  kinds = {(False, "fixed"): ("o-", "fixed batches"),
           (True, "fixed"): ("^-", "refill"),
           (True, "adaptive"): ("D-", "refill, adaptive")}
  for index, temperature in enumerate(sorted({r["temperature"]
                                              for r in rows})):
    color, label = f"C{index}", f"T={temperature:g}"
    of = lambda refill, policy, t=temperature: sorted(
        (r for r in rows if r["temperature"] == t
         and r.get("refill", False) == refill
         and r.get("policy", "fixed") == policy),
        key=lambda r: r["batch_size"])
    for (refill, policy), (marker, name) in kinds.items():
      group = of(refill, policy)
      if group:
        speedup.plot([r["batch_size"] for r in group],
                     [r["speedup"] for r in group], marker, color=color,
                     label=f"{label} {name}")
    group = of(False, "fixed")
    sizes = [r["batch_size"] for r in group]
    column = lambda key, group=group: [r[key] for r in group]
    speedup.plot(sizes, column("predicted_speedup_iid"), "s--", color=color,
                 alpha=0.5, label=f"{label} predicted")
    speedup.plot(sizes, column("predicted_speedup"), ":", color=color,
                 alpha=0.5, label=f"{label} work priced")
    tau.plot(sizes, column("tokens_per_cycle"), "o-", color=color,
             label=f"{label} tau measured")
    tau.plot(sizes, column("ar_steps_per_sd_cycle"), "v:", color=color,
             alpha=0.7, label=f"{label} AR steps per SD cycle")
    refilled = of(True, "fixed")
    if refilled:
      tau.plot([r["batch_size"] for r in refilled],
               [r["ar_steps_per_sd_cycle"] for r in refilled], "^--",
               color=color, alpha=0.7,
               label=f"{label} AR steps per SD cycle, refill")
    verify.plot(sizes, column("verify_cost_ratio"), "o-", color=color,
                label=f"{label} verify / step")
    verify.plot(sizes, column("break_even_verify_cost"), "^--", color=color,
                alpha=0.7, label=f"{label} break-even")
  gamma = rows[0]["gamma"]
  verify.axhline(gamma + 1, color="gray", lw=0.8, ls="--",
                 label=f"gamma + 1 = {gamma + 1}")
  speedup.axhline(1.0, color="gray", lw=0.8)
  speedup.set(title="Speedup over autoregressive decoding",
              ylabel="speedup (x)")
  tau.set(title="Tokens per cycle", ylabel="tokens (AR steps) per cycle")
  verify.set(title="Verify cost in target steps", ylabel="target steps")
  for axes in (speedup, tau, verify):
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted({r["batch_size"] for r in rows}),
                    [str(b) for b in sorted({r["batch_size"] for r in rows})])
    axes.set_xlabel(f"batch size (gamma {gamma})")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=6)
  return figure


FIGURES = {
    "tokens_per_cycle.png": tokens_per_cycle_figure,
    "speedup.png": speedup_figure,
    "acceptance_by_position.png": acceptance_by_position_figure,
}


def learning_curve_figure(records) -> Figure:
  """An EAGLE head's held-out greedy acceptance of each draft (training-time
  test step) against the training tokens seen, from learning_curve.json."""
  figure = Figure(figsize=(6, 4), layout="constrained")
  axes = figure.add_subplot()
  tokens = [r["tokens_seen"] for r in records]
  for step in range(len(records[0]["top1"])):
    axes.plot(tokens, [r["top1"][step] for r in records], "o-",
              label=f"draft {step + 1}")
  axes.set(title="EAGLE head: held-out greedy acceptance",
           xlabel="training tokens seen", ylabel="P(draft = target argmax)",
           ylim=(0, 1))
  axes.grid(alpha=0.3)
  axes.legend()
  return figure


def save_figures(rows, directory: str, figures=None) -> list[str]:
  """Writes figures ({file name: function of rows}, the sweep's by default)
  as PNG into directory; returns the paths."""
  paths = []
  for name, make in (figures or FIGURES).items():
    path = os.path.join(directory, name)
    # No half-written PNG on a crash.
    files.write_atomic(
        path, lambda f: make(rows).savefig(f, format="png", dpi=120), "wb")
    paths.append(path)
  return paths
