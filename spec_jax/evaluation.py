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

from spec_jax import checkpoint, data, records, sharding
from spec_jax.decoding import (DecodeConfig, DecodeResult, generate,
                               generate_autoregressive, pad_prompts)
from spec_jax.drafting import ModelDrafter
from spec_jax.sampling import Sampling

# The built-in pair, trained by configs/train.py (see README).
PRETRAINED = pathlib.Path(__file__).parent / "pretrained"


def resolve(path: str) -> pathlib.Path:
  """'pretrained/NAME' is the built-in model NAME; anything else a path."""
  if path.startswith("pretrained/"):
    return PRETRAINED / path.split("/", 1)[1]
  return pathlib.Path(path)


def load_pair(target_path: str, draft_path: str, mesh=None,
              replicate_draft: bool = False):
  """(target, draft, tokenizer); the two must share a tokenizer.

  With a mesh, both are read straight into their shardings (sharding.py); the
  draft is replicated on every device if replicate_draft.
  """
  target, tokenizer = checkpoint.load_model(resolve(target_path), mesh,
                                            name="target")
  draft, draft_tokenizer = checkpoint.load_model(
      resolve(draft_path), mesh, replicate=replicate_draft, name="draft")
  if draft_tokenizer.to_str() != tokenizer.to_str():
    raise ValueError(
        f"the draft at {draft_path} and the target at {target_path} use "
        "different tokenizers; speculative decoding needs one vocabulary. "
        "Train the draft with --config.tokenizer=<target model directory>.")
  return target, draft, tokenizer


def load_prompts(config: ml_collections.ConfigDict, tokenizer) -> list[str]:
  """config.prompts_file (one prompt per line), else held-out corpus files."""
  if config.prompts_file:
    path = pathlib.Path(config.prompts_file)
    if not path.exists():
      raise FileNotFoundError(f"prompts_file {path} does not exist.")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    return prompts[:config.num_prompts]
  _, heldout = data.split_texts(data.corpus_files(config.corpus),
                                config.heldout_percent)
  return data.prompts_from_texts(tokenizer, heldout, config.num_prompts,
                                 config.prompt_tokens, config.seed)


def parse_temperatures(text) -> list[float]:
  return [float(t) for t in str(text).split(",") if t.strip()]


def _decode_all(decode, prompt_ids, batch_size):
  """Runs decode over prompts in batches; returns (results, seconds)."""
  results, seconds = [], 0.0
  for start in range(0, len(prompt_ids), batch_size):
    batch = prompt_ids[start:start + batch_size]
    batch = batch + [batch[-1]] * (batch_size - len(batch))  # fixed shape
    prompts, lengths = pad_prompts(batch)
    begin = time.perf_counter()
    result = jax.block_until_ready(decode(prompts, lengths))
    seconds += time.perf_counter() - begin
    results.append(sharding.to_host(result))
  return results, seconds


def _rows(results: list[DecodeResult], count: int) -> list[list[int]]:
  rows = []
  for result in results:
    for tokens, n in zip(np.asarray(result.tokens),
                         np.asarray(result.num_tokens)):
      rows.append(tokens[:n].tolist())
  return rows[:count]


def compare(config: ml_collections.ConfigDict, target, draft, tokenizer,
            prompts: list[str], mesh=None) -> list[dict]:
  """AR and SD on the same prompts and settings, one RUN per temperature.

  Each decode is compiled and warmed up on the first batch before timing.
  With a mesh (the one the pair was loaded on), batches are split over it.
  """
  if mesh is not None:
    sharding.check_batch(config.batch_size, mesh)
  prompt_ids = [tokenizer.encode(p).ids or [0] for p in prompts]
  eos_id = tokenizer.token_to_id(data.EOS)
  drafter = ModelDrafter(draft)
  runs = []
  for index, temperature in enumerate(parse_temperatures(config.temperature)):
    decode_config = DecodeConfig(
        gamma=config.gamma, max_new_tokens=config.max_new_tokens,
        sampling=Sampling(temperature=temperature, top_k=config.top_k,
                          top_p=config.top_p),
        eos_id=eos_id)
    key = jax.random.key(config.seed + index)
    ar = lambda p, n: generate_autoregressive(key, target, p, n,
                                              decode_config, mesh)
    sd = lambda p, n: generate(key, target, drafter, p, n, decode_config,
                               mesh)
    for decode in (ar, sd):  # warm-up: compile outside the timing
      _decode_all(decode, prompt_ids[:config.batch_size], config.batch_size)
    ar_results, ar_seconds = _decode_all(ar, prompt_ids, config.batch_size)
    sd_results, sd_seconds = _decode_all(sd, prompt_ids, config.batch_size)
    ar_rows = _rows(ar_results, len(prompts))
    sd_rows = _rows(sd_results, len(prompts))
    ar_tokens, sd_tokens = sum(map(len, ar_rows)), sum(map(len, sd_rows))
    # Statistics of every batch, summed: counters add across runs.
    totals = [r.stats.summary() for r in sd_results]
    cycles = sum(t["row_cycles"] for t in totals)
    accepted = sum(t["accepted"] for t in totals)
    drafted = sum(t["drafted"] for t in totals)
    per_position = np.sum([t["accepted_per_position"] for t in totals], 0)
    runs.append({
        "temperature": temperature,
        "gamma": config.gamma,
        "batch_size": config.batch_size,
        "ar": {"tokens_per_s": ar_tokens / ar_seconds,
               "new_tokens": ar_tokens, "wall_s": ar_seconds},
        "sd": {"tokens_per_s": sd_tokens / sd_seconds,
               "new_tokens": sd_tokens, "wall_s": sd_seconds,
               "cycles": cycles,
               "acceptance_rate": accepted / max(drafted, 1),
               "tokens_per_cycle": (accepted + cycles) / max(cycles, 1),
               "accepted_per_position": per_position.astype(int).tolist()},
        "speedup": (sd_tokens / sd_seconds) / (ar_tokens / ar_seconds),
        "samples": [{"prompt": p, "ar_tokens": a, "sd_tokens": s}
                    for p, a, s in zip(prompts, ar_rows, sd_rows)],
    })
  return runs


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


def exactness(config: ml_collections.ConfigDict, target, draft, tokenizer,
              workdir: str) -> dict:
  """Draws config.num_samples AR and SD continuations per sampling setting.

  Saves workdir/tokens_{ar,sd}_{tag}.npy, each [N, max_new_tokens] int32, and
  returns per-position p-values. A setting passes when every p-value is above
  significance / max_new_tokens (Bonferroni over positions).
  """
  prompt_ids = tokenizer.encode(config.prompt).ids
  prompts, lengths = pad_prompts([prompt_ids] * config.batch_size)
  drafter = ModelDrafter(draft)
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
