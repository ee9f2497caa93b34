"""Prompt lookup replayed on the target's greedy output: which setting pays.

At T=0 speculative output equals the target's greedy output token for token,
so that output fixes every cycle prompt lookup would run: at each cycle the
drafts are `prompt_lookup` of the sequence so far, and the accepted ones are
those that agree with what the target emits next. Replaying the library's own
`prompt_lookup` on recorded greedy output therefore gives, exactly and
without running the model again, each setting's cycles, drafts and accepted
drafts, and how acceptance depends on the length n of the n-gram that
matched (a one-token match is a weak clue; `NgramDrafter.min_n` sets the
shortest match worth a verify).

With the cost of a verify pass in target steps (bench_step's
`verify_cost_ratio`), each setting's cycles also predict its speedup, and the
same output bounds any drafter that copies from the context: proposing
exactly the drafts that will be accepted, and nothing in cycles where none
would be, each cycle in the cheapest measured pass that holds its drafts.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.harness import compare, loading
from experiments.harness import config as config_lib
from spec_jax.decoding import pad_prompts
from spec_jax.drafters import prompt_lookup


@functools.partial(jax.jit, static_argnames=("gamma", "n"))
def _lookups(sequence: jax.Array, lengths: jax.Array, gamma: int, n: int):
  """Drafts [P, G] and proposed [P, G] of an n-gram match for each of the P
  prefixes sequence[:lengths[p]] of one row's sequence [S]."""
  tokens = jnp.broadcast_to(sequence, (lengths.shape[0], sequence.shape[0]))
  return prompt_lookup(tokens, lengths, gamma, n, n)


def replay_row(prompt: list[int], output: list[int], gamma: int, max_n: int,
               min_n: int) -> list[tuple[int, int, int, int]]:
  """The cycles of prompt lookup on one row whose greedy output is known.

  Returns one (n, proposed, accepted, emitted) per cycle: the length of the
  n-gram that matched (0: none, the cycle is a plain target step), the
  drafts proposed, how many of them the target's argmax accepts, and the
  tokens the cycle emits (accepted + 1, fewer at the end of the output).
  """
  sequence = np.asarray(prompt + output, np.int32)
  # Every cycle starts at some prefix length: look them all up at once, in a
  # buffer padded to a power of two so that rows share compiled lookups (a
  # lookup reads only below each prefix's length).
  padded = pad_prompts([sequence])[0][0]
  starts = np.minimum(np.arange(len(padded), dtype=np.int32) + len(prompt),
                      len(padded))  # the first len(output) are cycle starts
  drafts, proposed = {}, {}
  for n in range(max_n, min_n - 1, -1):
    d, p = _lookups(jnp.asarray(padded), jnp.asarray(starts), gamma, n)
    drafts[n], proposed[n] = np.asarray(d), np.asarray(p)
  cycles, length = [], len(prompt)
  while length < len(sequence):
    index = length - len(prompt)
    matched = next((n for n in drafts if proposed[n][index, 0]), 0)
    if matched:
      draft = drafts[matched][index][proposed[matched][index]]
    else:
      draft = np.zeros(0, np.int32)
    upcoming = sequence[length:length + len(draft)]
    agree = draft[:len(upcoming)] == upcoming
    accepted = len(agree) if agree.all() else int(np.argmin(agree))
    emitted = min(accepted + 1, len(sequence) - length)
    cycles.append((matched, len(draft), accepted, emitted))
    length += emitted
  return cycles


def cycle_costs(verify_cost_ratio: dict) -> callable:
  """cost(drafts) in target steps of a cycle with that many drafts: 1 for a
  plain step, else the verify of drafts + 1 tokens, interpolated linearly in
  gamma between bench_step's measured {gamma: verify / step}."""
  gammas = np.array(sorted(int(g) for g in verify_cost_ratio))
  ratios = np.array([verify_cost_ratio[str(g)] for g in gammas])
  return lambda drafts: 1.0 if drafts == 0 else float(
      np.interp(drafts, gammas, ratios))


def summarize(cycles: list[tuple[int, int, int, int]], gamma: int,
              verify_cost_ratio=None) -> dict:
  """Tokens per cycle, the share of plain-step cycles, acceptance by the
  matched n-gram's length and, given the verify costs, the predicted
  speedup over AR and the copy-from-context bound."""
  cycles = np.array(cycles, np.int64).reshape(-1, 4)
  n, proposed, accepted, emitted = cycles.T
  by_n = {}
  for length in sorted(set(n[proposed > 0].tolist())):
    mine = accepted[n == length]
    by_n[str(length)] = {"cycles": int(mine.size),
                         "mean_accepted": float(mine.mean()),
                         "some_accepted": float((mine > 0).mean())}
  tokens = int(emitted.sum())
  summary = {"cycles": len(cycles), "tokens": tokens,
             "tokens_per_cycle": tokens / max(len(cycles), 1),
             "plain_step_share": float((proposed == 0).mean()),
             "accepted_by_match_length": by_n}
  if verify_cost_ratio:
    cost = cycle_costs(verify_cost_ratio)
    # With `verify_buckets=2` a cycle with any draft verifies gamma + 1.
    spent = sum(cost(gamma if k else 0) for k in proposed)
    # The bound: only the drafts that will be accepted, in the cheapest
    # measured pass that holds them. Measured costs need not grow with the
    # width (a verify of 3 drafts can time below one of 2), so a wider pass
    # counts where it is cheaper; otherwise the bound could fall below what
    # the setting itself achieves.
    cheapest = [min(cost(g) for g in range(a, gamma + 1))
                for a in range(gamma + 1)]
    bound = sum(cheapest[a] for a in accepted)
    summary["predicted_speedup"] = tokens / spent
    summary["copy_bound_speedup"] = tokens / bound
  return summary


def greedy_rows(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                prompts: loading.Prompts) -> list[tuple[str, list, list]]:
  """(category, prompt ids, the target's greedy output ids) per prompt, from
  the autoregressive loop with the main job's batches and stop ids."""
  prompt_ids = compare.encode(prompts, loaded.target.tokenizer)
  groups = compare.groups_of(prompts)
  decode_config = config_lib.decode_config(config, 0.0,
                                           eos_id=loaded.target.stop_ids)
  decode = compare.decoders(loaded, decode_config,
                            jax.random.key(config.seed))["ar"]
  results = [decode(*batch) for batch in compare.batches(
      prompt_ids, config.batch_size, groups)]
  outputs = compare.rows(results, compare.batch_rows(groups,
                                                     config.batch_size))
  categories = prompts.categories or ["all"] * len(prompt_ids)
  return [(categories[i], prompt_ids[i], outputs[i])
          for i in range(len(prompt_ids))]


def replay(rows: list[tuple[str, list[int], list[int]]], settings,
           verify_cost_ratio=None) -> list[dict]:
  """Each (gamma, max_n, min_n) setting replayed on rows of (category,
  prompt ids, greedy output ids): overall and per category."""
  results = []
  for gamma, max_n, min_n in settings:
    by_category = {}
    for category, prompt, output in rows:
      by_category.setdefault(category, []).extend(
          replay_row(prompt, output, gamma, max_n, min_n))
    every = [c for cycles in by_category.values() for c in cycles]
    results.append({
        "gamma": gamma, "max_n": max_n, "min_n": min_n,
        "all": summarize(every, gamma, verify_cost_ratio),
        "by_category": {name: summarize(cycles, gamma, verify_cost_ratio)
                        for name, cycles in by_category.items()}})
  return results


def format_table(results: list[dict]) -> str:
  """tau and the predicted speedup (when costs were given) per setting and
  category."""
  categories = [c for c in results[0]["by_category"] if c != "all"]
  value = lambda s: (f"{s['predicted_speedup']:.2f}x" if "predicted_speedup"
                     in s else f"{s['tokens_per_cycle']:.2f}")
  lines = ["gamma max_n min_n " + " ".join(f"{c[:10]:>10}" for c in
                                            categories + ["all"])]
  for r in results:
    cells = [value(r["by_category"][c]) for c in categories] + [
        value(r["all"])]
    lines.append(f"{r['gamma']:>5} {r['max_n']:>5} {r['min_n']:>5} "
                 + " ".join(f"{c:>10}" for c in cells))
  return "\n".join(lines)
