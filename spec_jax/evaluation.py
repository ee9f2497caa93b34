"""The experiments' library side: load a pair, run AR and SD side by side,
and test that their outputs follow one law. `experiments/` and the notebooks
call these functions."""

import os
import pathlib
import time

import jax
import ml_collections
import numpy as np
from scipy import stats

from spec_jax import checkpoint, data, hf, records, sharding
from spec_jax.decoding import (DecodeConfig, DecodeResult, generate,
                               generate_autoregressive, pad_prompts)
from spec_jax.drafting import LayerSkipDrafter, ModelDrafter, NgramDrafter
from spec_jax.sampling import Sampling

# The built-in pair, trained by configs/train.py (see README).
PRETRAINED = pathlib.Path(__file__).parent / "pretrained"


def resolve(path: str) -> pathlib.Path:
  """'pretrained/NAME' is the built-in model NAME; anything else a path."""
  if path.startswith("pretrained/"):
    return PRETRAINED / path.split("/", 1)[1]
  return pathlib.Path(path)


def load(path: str, mesh=None, replicate: bool = False,
         name: str = "model") -> hf.ModelBundle:
  """'hf:DIR' is a Hugging Face folder (or hub name), anything else a model
  directory (see `resolve`). With a mesh, the params end in their shardings
  (sharding.py), replicated if `replicate`; `name` says which model an error
  is about."""
  if path.startswith("hf:"):
    return hf.load_hf(path.removeprefix("hf:"), mesh=mesh, replicate=replicate)
  model, tokenizer = checkpoint.load_model(resolve(path), mesh, replicate,
                                           name)
  return hf.ModelBundle(model, tokenizer, tokenizer.token_to_id(data.EOS))


def load_pair(target_path: str, draft_path: str, mesh=None,
              replicate_draft: bool = False):
  """(target, draft, tokenizer); the two must share a vocabulary.

  With a mesh, both are read into their shardings (sharding.py); the draft is
  replicated on every device if replicate_draft.
  """
  target = load(target_path, mesh, name="target")
  draft = load(draft_path, mesh, replicate_draft, name="draft")
  if (draft.tokenizer.get_vocab(with_added_tokens=True)
      != target.tokenizer.get_vocab(with_added_tokens=True)):
    raise ValueError(
        f"the draft at {draft_path} and the target at {target_path} use "
        "different tokenizers; speculative decoding needs one vocabulary. "
        "Train the draft with --config.tokenizer=<target model directory>.")
  if draft.model.vocab_size != target.model.vocab_size:
    raise ValueError(
        f"the draft at {draft_path} has {draft.model.vocab_size} token ids and "
        f"the target at {target_path} {target.model.vocab_size}; speculative "
        "decoding needs one vocabulary. Pick a draft of the target's family.")
  return target.model, draft.model, target.tokenizer


def eos_id(path: str, tokenizer) -> int | None:
  """The end-of-sequence id of the model at path ('hf:DIR' reads the
  checkpoint's own)."""
  if path.startswith("hf:"):
    return hf.load_eos_id(path.removeprefix("hf:"))
  return tokenizer.token_to_id(data.EOS)


DRAFTERS = ("model", "ngram", "layer_skip")


def make_drafter(config: ml_collections.ConfigDict, target, draft=None):
  """The drafter config.drafter names, with its sub-config.

  model: the draft model (config.draft), dynamic gamma when
    config.confidence_threshold > 0;
  ngram: prompt lookup with config.ngram.max_n / min_n;
  layer_skip: the target's first config.layer_skip.num_layers layers, dynamic
    gamma as for model.
  """
  if config.drafter == "model":
    return ModelDrafter(draft, confidence_threshold=config.confidence_threshold)
  if config.drafter == "ngram":
    return NgramDrafter(target.vocab_size, max_n=config.ngram.max_n,
                        min_n=config.ngram.min_n)
  if config.drafter == "layer_skip":
    return LayerSkipDrafter(target, num_layers=config.layer_skip.num_layers,
                            confidence_threshold=config.confidence_threshold)
  raise ValueError(f"drafter={config.drafter!r}: choose one of {DRAFTERS}.")


def load_models(config: ml_collections.ConfigDict, mesh=None):
  """(target, drafter, tokenizer) as the config describes them.

  The draft model is loaded only for drafter=model; the others need none.
  With a mesh, params are loaded into their shardings.
  """
  if config.drafter not in DRAFTERS:
    raise ValueError(f"drafter={config.drafter!r}: choose one of {DRAFTERS}.")
  if config.drafter == "model":
    target, draft, tokenizer = load_pair(
        config.target, config.draft, mesh,
        config.get("mesh", {}).get("replicate_draft", False))
  else:
    bundle, draft = load(config.target, mesh, name="target"), None
    target, tokenizer = bundle.model, bundle.tokenizer
  return target, make_drafter(config, target, draft), tokenizer


def describe(target, drafter) -> str:
  """One line naming the models, for logs."""
  draft = getattr(drafter, "model", None)
  what = (f"draft {draft.num_params:,} params" if draft is not None
          else type(drafter).__name__)
  return f"target {target.num_params:,} params, {what}"


def load_prompts(config: ml_collections.ConfigDict, tokenizer) -> list[str]:
  """config.prompts_file (one prompt per line), else held-out corpus files,
  each followed by its own first lines again when config.repeat_prompts."""
  if config.prompts_file:
    path = pathlib.Path(config.prompts_file)
    if not path.exists():
      raise FileNotFoundError(f"prompts_file {path} does not exist.")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    return prompts[:config.num_prompts]
  _, heldout = data.split_texts(data.corpus_files(config.corpus),
                                config.heldout_percent)
  prompts = data.prompts_from_texts(tokenizer, heldout, config.num_prompts,
                                    config.prompt_tokens, config.seed)
  if config.get("repeat_prompts", False):
    prompts = data.repeating_prompts(prompts)
  return prompts


def parse_temperatures(text) -> list[float]:
  return [float(t) for t in str(text).split(",") if t.strip()]


def _decode_all(decoders: dict, prompt_ids, batch_size: int, width: int,
                repeats: int = 1, after_batch=None) -> dict:
  """Runs each decoder over all the prompts in batches, `repeats` times.

  Batch by batch the decoders take turns, so a slow spell of the machine hits
  them alike; `after_batch()`, if given, runs after each batch's turns (a
  sweep times the loop's components there, for the same reason). A decoder's
  time is the median over repeats of its time for all the batches: the
  component times of `benchmark` are medians too, so measured and predicted
  speedups compare like with like. Every batch is padded to one width, so one
  compiled program serves all and no compilation falls inside the timing.

  Returns {name: (results of the first repeat, seconds)}.
  """
  batches = []
  for start in range(0, len(prompt_ids), batch_size):
    batch = prompt_ids[start:start + batch_size]
    batch = batch + [batch[-1]] * (batch_size - len(batch))  # fixed shape
    batches.append(pad_prompts(batch, min_width=width))
  results = {name: [] for name in decoders}
  totals = {name: [] for name in decoders}
  for repeat in range(repeats):
    seconds = dict.fromkeys(decoders, 0.0)
    for prompts, lengths in batches:
      for name, decode in decoders.items():
        begin = time.perf_counter()
        result = jax.block_until_ready(decode(prompts, lengths))
        seconds[name] += time.perf_counter() - begin
        if repeat == 0:
          results[name].append(sharding.to_host(result))
      if after_batch is not None:
        after_batch()
    for name in decoders:
      totals[name].append(seconds[name])
  return {name: (results[name], float(np.median(totals[name])))
          for name in decoders}


def _rows(results: list[DecodeResult], count: int) -> list[list[int]]:
  rows = []
  for result in results:
    for tokens, n in zip(np.asarray(result.tokens),
                         np.asarray(result.num_tokens)):
      rows.append(tokens[:n].tolist())
  return rows[:count]


def compare(config: ml_collections.ConfigDict, target, drafter, tokenizer,
            prompts: list[str], mesh=None, before_timing=None,
            after_batch=None) -> list[dict]:
  """AR and SD on the same prompts and settings, one RUN per temperature.

  Each decode is compiled and warmed up on the first batch before timing.
  With a mesh (the one the pair was loaded on), batches are split over it.
  before_timing() runs after the warm-up and before the first timed batch
  (a sweep waits there for work it compiled alongside); after_batch() after
  each timed batch (see `_decode_all`).
  """
  if mesh is not None:
    sharding.check_batch(config.batch_size, mesh)
  prompt_ids = [tokenizer.encode(p).ids or [0] for p in prompts]
  end_id = eos_id(config.target, tokenizer)
  width = pad_prompts(prompt_ids)[0].shape[1]
  runs = []
  for index, temperature in enumerate(parse_temperatures(config.temperature)):
    decode_config = DecodeConfig(
        gamma=config.gamma, max_new_tokens=config.max_new_tokens,
        sampling=Sampling(temperature=temperature, top_k=config.top_k,
                          top_p=config.top_p),
        eos_id=end_id)
    key = jax.random.key(config.seed + index)
    ar = lambda p, n: generate_autoregressive(key, target, p, n,
                                              decode_config, mesh)
    sd = lambda p, n: generate(key, target, drafter, p, n, decode_config,
                               mesh)
    decoders = {"ar": ar, "sd": sd}
    # Warm-up: compile outside the timing.
    _decode_all(decoders, prompt_ids[:config.batch_size], config.batch_size,
                width)
    if before_timing is not None:
      before_timing()
    timed = _decode_all(decoders, prompt_ids, config.batch_size, width,
                        config.get("timing_repeats", 1), after_batch)
    (ar_results, ar_seconds), (sd_results, sd_seconds) = timed["ar"], timed["sd"]
    ar_rows = _rows(ar_results, len(prompts))
    sd_rows = _rows(sd_results, len(prompts))
    ar_tokens, sd_tokens = sum(map(len, ar_rows)), sum(map(len, sd_rows))
    # Statistics of every batch, summed: counters add across runs.
    totals = [r.stats.summary() for r in sd_results]
    cycles = sum(t["row_cycles"] for t in totals)
    # Loop iterations: rows of a batch run in lockstep until the last ends.
    loop_cycles = sum(t["cycles"] for t in totals)
    ar_steps = sum(max(map(len, ar_rows[i:i + config.batch_size]))
                   for i in range(0, len(ar_rows), config.batch_size))
    accepted = sum(t["accepted"] for t in totals)
    drafted = sum(t["drafted"] for t in totals)
    per_position = np.sum([t["accepted_per_position"] for t in totals], 0)
    verified = sum(t["verified"] for t in totals)
    overlap_sum = sum(t["overlap_sum"] for t in totals)
    runs.append({
        "temperature": temperature,
        "gamma": config.gamma,
        "batch_size": config.batch_size,
        "num_batches": len(sd_results),
        "ar": {"tokens_per_s": ar_tokens / ar_seconds,
               "new_tokens": ar_tokens, "wall_s": ar_seconds,
               "steps": ar_steps},
        "sd": {"tokens_per_s": sd_tokens / sd_seconds,
               "new_tokens": sd_tokens, "wall_s": sd_seconds,
               "cycles": cycles, "loop_cycles": loop_cycles,
               "acceptance_rate": accepted / max(drafted, 1),
               "tokens_per_cycle": (accepted + cycles) / max(cycles, 1),
               "mean_overlap": overlap_sum / max(verified, 1),
               "accepted_per_position": per_position.astype(int).tolist()},
        "speedup": (sd_tokens / sd_seconds) / (ar_tokens / ar_seconds),
        "samples": [{"prompt": p, "ar_tokens": a, "sd_tokens": s}
                    for p, a, s in zip(prompts, ar_rows, sd_rows)],
    })
  return runs


def compare_drafters(config: ml_collections.ConfigDict, log=print
                     ) -> list[dict]:
  """`compare` for each of config.variants (name -> config overrides).

  Returns one row per (variant, temperature): the drafter, gamma, alpha
  (mean sum_x min(p, q)), acceptance rate, tau, tokens/s and the speedup.
  """
  rows = []
  for index, (name, overrides) in enumerate(config.variants.items()):
    variant = ml_collections.ConfigDict(config.to_dict())
    del variant["variants"]
    variant.update(overrides)
    target, drafter, tokenizer = load_models(variant)
    prompts = load_prompts(variant, tokenizer)
    for run in compare(variant, target, drafter, tokenizer, prompts):
      sd = run["sd"]
      rows.append({
          "variant": name, "drafter": variant.drafter, "gamma": run["gamma"],
          "temperature": run["temperature"],
          "alpha_min_pq": sd["mean_overlap"],
          "acceptance_rate": sd["acceptance_rate"],
          "tokens_per_cycle": sd["tokens_per_cycle"],
          "ar_tokens_per_s": run["ar"]["tokens_per_s"],
          "sd_tokens_per_s": sd["tokens_per_s"], "speedup": run["speedup"],
          "overrides": overrides.to_dict() if hasattr(overrides, "to_dict")
                       else dict(overrides)})
      log(f"[{index + 1}/{len(config.variants)}] {name}, "
          f"T={run['temperature']:g}: alpha {sd['mean_overlap']:.3f}, tau "
          f"{sd['tokens_per_cycle']:.2f}, speedup {run['speedup']:.2f}x")
  return rows


def format_drafter_table(rows: list[dict]) -> str:
  width = max(len(r["variant"]) for r in rows)
  lines = [f"{'drafter':<{width}} {'T':>3} {'gamma':>5} {'alpha':>6} "
           f"{'tau':>5} {'AR tok/s':>8} {'SD tok/s':>8} {'speedup':>7}"]
  for r in rows:
    lines.append(
        f"{r['variant']:<{width}} {r['temperature']:>3g} {r['gamma']:>5d} "
        f"{r['alpha_min_pq']:>6.3f} {r['tokens_per_cycle']:>5.2f} "
        f"{r['ar_tokens_per_s']:>8.1f} {r['sd_tokens_per_s']:>8.1f} "
        f"{r['speedup']:>6.2f}x")
  return "\n".join(lines)


def format_table(runs: list[dict]) -> str:
  lines = [f"{'T':>4} {'gamma':>5} {'alpha':>6} {'tau':>5} {'AR tok/s':>9} "
           f"{'SD tok/s':>9} {'speedup':>7}"]
  for run in runs:
    lines.append(
        f"{run['temperature']:>4g} {run['gamma']:>5d} "
        f"{run['sd']['acceptance_rate']:>6.3f} "
        f"{run['sd']['tokens_per_cycle']:>5.2f} "
        f"{run['ar']['tokens_per_s']:>9.1f} {run['sd']['tokens_per_s']:>9.1f} "
        f"{run['speedup']:>6.2f}x")
  return "\n".join(lines)


def two_sample_p_values(a: np.ndarray, b: np.ndarray,
                        min_expected: float = 5.0) -> list[float]:
  """Per position, a chi-square test that samples a and b share one law.

  a, b: [N, L] token arrays. Tokens whose pooled count would give an expected
  count below min_expected in either sample are merged into one category.
  """
  p_values = []
  for position in range(a.shape[1]):
    values, inverse = np.unique(
        np.concatenate([a[:, position], b[:, position]]), return_inverse=True)
    counts = np.zeros((2, len(values)), np.int64)
    np.add.at(counts[0], inverse[:len(a)], 1)
    np.add.at(counts[1], inverse[len(a):], 1)
    expected = counts.sum(0) * min(len(a), len(b)) / (len(a) + len(b))
    rare = expected < min_expected
    table = counts[:, ~rare]
    if rare.any():
      table = np.concatenate([table, counts[:, rare].sum(1, keepdims=True)], 1)
    if table.shape[1] < 2:
      p_values.append(1.0)  # One category: nothing to compare.
      continue
    p_values.append(float(stats.chi2_contingency(table).pvalue))
  return p_values


def exactness(config: ml_collections.ConfigDict, target, drafter, tokenizer,
              workdir: str) -> dict:
  """Draws config.num_samples AR and SD continuations per sampling setting.

  Saves workdir/tokens_{ar,sd}_{tag}.npy, each [N, max_new_tokens] int32, and
  returns per-position p-values. A setting passes when every p-value is above
  significance / max_new_tokens (Bonferroni over positions).
  """
  prompt_ids = tokenizer.encode(config.prompt).ids
  prompts, lengths = pad_prompts([prompt_ids] * config.batch_size)
  settings = []
  for setting in config.settings.split(","):
    temperature, top_p = (float(x) for x in setting.split(":"))
    tag = f"T{temperature:g}_p{top_p:g}"
    decode_config = DecodeConfig(
        gamma=config.gamma, max_new_tokens=config.max_new_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p))
    samples = {"ar": [], "sd": []}
    num_batches = -(-config.num_samples // config.batch_size)
    for batch in range(num_batches):
      print(f"{tag}: batch {batch + 1}/{num_batches}", flush=True)
      key = jax.random.key(config.seed * 100_003 + batch)
      samples["ar"].append(generate_autoregressive(
          key, target, prompts, lengths, decode_config).tokens)
      samples["sd"].append(generate(
          jax.random.fold_in(key, 1), target, drafter, prompts, lengths,
          decode_config).tokens)
    arrays = {}
    for name, chunks in samples.items():
      arrays[name] = np.concatenate(
          [np.asarray(c) for c in chunks])[:config.num_samples].astype(
              np.int32)
      records.save_npy(os.path.join(workdir, f"tokens_{name}_{tag}.npy"),
                       arrays[name])
    p_values = two_sample_p_values(arrays["ar"], arrays["sd"])
    threshold = config.significance / config.max_new_tokens
    settings.append({"tag": tag, "temperature": temperature, "top_p": top_p,
                     "num_samples": config.num_samples, "p_values": p_values,
                     "threshold": threshold,
                     "passed": min(p_values) > threshold})
  return {"prompt": config.prompt, "settings": settings}
