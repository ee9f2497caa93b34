"""Lossless check on real models: are SD's samples distributed as AR's?"""

import logging
import os

import jax
import ml_collections
import numpy as np
from scipy import stats

from experiments.harness import config as config_lib
from experiments.harness import loading, records
from spec_jax.decoding import generate, generate_autoregressive, pad_prompts

_log = logging.getLogger(__name__)


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


def settings(config: ml_collections.ConfigDict) -> list[tuple[float, float]]:
  """config.settings as (temperature, top_p) pairs; the old string form
  "1.0:1.0,1.0:0.9" is read too."""
  pairs = []
  for setting in config.settings:
    if isinstance(setting, str):
      pairs.extend(tuple(float(x) for x in part.split(":"))
                   for part in setting.split(",") if part.strip())
    else:
      pairs.append(tuple(float(x) for x in setting))
  if not pairs or any(len(pair) != 2 for pair in pairs):
    raise ValueError(f"settings={config.settings!r}: give (temperature, "
                     "top_p) pairs, e.g. --config.settings='((1, 1), (1, 0.9))'.")
  return pairs


def exactness(config: ml_collections.ConfigDict, loaded: loading.Loaded,
              workdir: str) -> dict:
  """Draws config.num_samples AR and SD continuations per sampling setting.

  Saves workdir/tokens_{ar,sd}_{tag}.npy, each [N, max_new_tokens] int32, and
  returns per-position p-values. A setting passes when every p-value is above
  significance / max_new_tokens (Bonferroni over positions).
  """
  target, drafter = loaded.target.model, loaded.drafter
  prompt_ids = loaded.target.tokenizer.encode(config.prompt).ids
  prompts, lengths = pad_prompts([prompt_ids] * config.batch_size)
  result = []
  for temperature, top_p in settings(config):
    tag = f"T{temperature:g}_p{top_p:g}"
    setting_config = ml_collections.ConfigDict(config.to_dict())
    setting_config.top_p = top_p
    decode_config = config_lib.decode_config(setting_config, temperature)
    samples = {"ar": [], "sd": []}
    num_batches = -(-config.num_samples // config.batch_size)
    for batch in range(num_batches):
      _log.info("%s: batch %d/%d", tag, batch + 1, num_batches)
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
    result.append({"tag": tag, "temperature": temperature, "top_p": top_p,
                   "num_samples": config.num_samples, "p_values": p_values,
                   "threshold": threshold,
                   "passed": min(p_values) > threshold})
  return {"prompt": config.prompt, "settings": result}
