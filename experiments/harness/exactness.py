"""Lossless check on real models: are SD's samples distributed as AR's?

Per sampling setting, N AR and N SD continuations of one prompt, compared by
two-sample chi-square tests: one per position (the marginals) and one per
prefix length k = 2..L (the joint law of the first k tokens: each distinct
prefix a category, the most frequent kept and the rest pooled), with a
Bonferroni correction over the 2L - 1 tests. Long prefixes are nearly all
distinct at T = 1, so the short ones carry the joint test's power. A negative control runs the same
tests on SD whose correction is drawn from p instead of norm(max(0, p - q)),
which they must reject: a check that cannot fail it proves nothing.
"""

import dataclasses
import functools
import logging
import os

import jax
import ml_collections
import numpy as np
from scipy import stats

from experiments.harness import config as config_lib
from experiments.harness import loading, records
from spec_jax import rules
from spec_jax.decoding import generate, generate_autoregressive, pad_prompts

_log = logging.getLogger(__name__)


def _from_p(draft_probs, target_probs):
  del draft_probs
  return target_probs


# config.candidate -> the rule SD runs: the decode's own, or the negative
# control. One function object each, so that every batch reuses one program.
CANDIDATES = {"exact": None,
              "correction_from_p": functools.partial(rules.resample,
                                                     correction=_from_p)}


def _contingency_p_value(counts: np.ndarray, min_expected: float) -> float:
  """Chi-square test of a [2, K] table of counts; categories whose pooled
  count gives an expected count below min_expected in either sample are
  merged into one."""
  expected = counts.sum(0) * counts.sum(1).min() / counts.sum()
  rare = expected < min_expected
  table = counts[:, ~rare]
  if rare.any():
    table = np.concatenate([table, counts[:, rare].sum(1, keepdims=True)], 1)
  if table.shape[1] < 2:
    return 1.0  # One category: nothing to compare.
  return float(stats.chi2_contingency(table).pvalue)


def _counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """[2, K] counts of each distinct value (or row, for 2-D a and b)."""
  _, inverse = np.unique(np.concatenate([a, b]), axis=0, return_inverse=True)
  inverse = inverse.reshape(-1)
  counts = np.zeros((2, inverse.max() + 1), np.int64)
  np.add.at(counts[0], inverse[:len(a)], 1)
  np.add.at(counts[1], inverse[len(a):], 1)
  return counts


def two_sample_p_values(a: np.ndarray, b: np.ndarray,
                        min_expected: float = 5.0) -> list[float]:
  """Per position, a chi-square test that samples a and b share one law.

  a, b: [N, L] token arrays. Tokens whose pooled count would give an expected
  count below min_expected in either sample are merged into one category.
  """
  return [_contingency_p_value(_counts(a[:, i], b[:, i]), min_expected)
          for i in range(a.shape[1])]


def joint_p_value(a: np.ndarray, b: np.ndarray, max_categories: int = 500,
                  min_expected: float = 5.0) -> float:
  """A chi-square test that whole rows of a and b [N, k] share one law: each
  distinct row is a category; the max_categories most frequent are kept and
  the rest pooled, with the rare ones, into one."""
  counts = _counts(a, b)
  order = np.argsort(-counts.sum(0), kind="stable")
  table = counts[:, order[:max_categories]]
  if len(order) > max_categories:
    tail = counts[:, order[max_categories:]].sum(1, keepdims=True)
    table = np.concatenate([table, tail], 1)
  return _contingency_p_value(table, min_expected)


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
  if config.candidate not in CANDIDATES:
    raise ValueError(f"candidate={config.candidate!r}: choose one of "
                     f"{tuple(CANDIDATES)}.")
  return pairs


def _samples(config, loaded: loading.Loaded, temperature: float,
             top_p: float) -> dict:
  """{"ar", "sd", "control"}: [N, max_new_tokens] int32 continuations."""
  target, drafter = loaded.target.model, loaded.drafter
  prompt_ids = loaded.target.tokenizer.encode(config.prompt).ids
  prompts, lengths = pad_prompts([prompt_ids] * config.batch_size)
  setting_config = ml_collections.ConfigDict(config.to_dict())
  setting_config.top_p = top_p
  decode_config = config_lib.decode_config(setting_config, temperature)
  candidate = CANDIDATES[config.candidate]
  decoders = {
      "ar": lambda key: generate_autoregressive(key, target, prompts, lengths,
                                                decode_config),
      "sd": lambda key: generate(
          jax.random.fold_in(key, 1), target, drafter, prompts, lengths,
          decode_config if candidate is None else
          dataclasses.replace(decode_config, resample=candidate)),
  }
  if config.negative_control:
    control = dataclasses.replace(
        decode_config, resample=CANDIDATES["correction_from_p"])
    decoders["control"] = lambda key: generate(
        jax.random.fold_in(key, 2), target, drafter, prompts, lengths,
        control)
  samples = {name: [] for name in decoders}
  num_batches = -(-config.num_samples // config.batch_size)
  for batch in range(num_batches):
    _log.info("T=%g top_p=%g: batch %d/%d", temperature, top_p, batch + 1,
              num_batches)
    key = jax.random.key(config.seed * 100_003 + batch)
    for name, decode in decoders.items():
      samples[name].append(np.asarray(decode(key).tokens))
  return {name: np.concatenate(chunks)[:config.num_samples].astype(np.int32)
          for name, chunks in samples.items()}


def _tests(ar: np.ndarray, other: np.ndarray, threshold: float) -> dict:
  """The marginal tests of other against AR, the joint test of each prefix
  of 2..L tokens, and their verdict."""
  p_values = two_sample_p_values(ar, other)
  joint = [joint_p_value(ar[:, :k], other[:, :k])
           for k in range(2, ar.shape[1] + 1)]
  return {"p_values": p_values, "joint_p_values": joint,
          "same_law": min(p_values + joint) > threshold}


def exactness(config: ml_collections.ConfigDict, loaded: loading.Loaded,
              workdir: str) -> dict:
  """Draws config.num_samples AR and SD continuations per sampling setting
  (and as many of the negative control's, with config.negative_control).

  Saves workdir/tokens_{ar,sd,control}_{tag}.npy, each [N, max_new_tokens]
  int32. A setting passes when SD passes every test at significance /
  (2 max_new_tokens - 1) and the control fails one; the report passes when
  every setting does.
  """
  result = []
  threshold = config.significance / (2 * config.max_new_tokens - 1)
  for temperature, top_p in settings(config):
    tag = f"T{temperature:g}_p{top_p:g}"
    arrays = _samples(config, loaded, temperature, top_p)
    for name, array in arrays.items():
      records.save_npy(os.path.join(workdir, f"tokens_{name}_{tag}.npy"),
                       array)
    setting = {"tag": tag, "temperature": temperature, "top_p": top_p,
               "num_samples": config.num_samples, "threshold": threshold,
               **_tests(arrays["ar"], arrays["sd"], threshold)}
    setting["passed"] = setting["same_law"]
    if "control" in arrays:
      setting["control"] = _tests(arrays["ar"], arrays["control"], threshold)
      setting["passed"] &= not setting["control"]["same_law"]
    result.append(setting)
  return {"prompt": config.prompt, "candidate": config.candidate,
          "settings": result, "passed": all(s["passed"] for s in result)}


def describe(setting: dict) -> str:
  """One line per setting: each test's smallest p-value and its verdict."""
  def verdict(tests):
    law = "same law" if tests["same_law"] else "DIFFERENT LAWS"
    return (f"min p-value {min(tests['p_values']):.4f} over positions, "
            f"{min(tests['joint_p_values'], default=1.0):.4f} over prefixes "
            f"-> {law}")
  line = f"{setting['tag']}: SD {verdict(setting)}"
  if "control" in setting:
    line += f"; negative control {verdict(setting['control'])}"
  return line
