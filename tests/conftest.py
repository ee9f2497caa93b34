"""Tiny random draft/target pairs, tiny trained models and the statistics
helpers the tests share."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize, stats

import spec_jax as sj
from configs import train as train_configs
from experiments.harness import train
from spec_jax import decoding

REPO = pathlib.Path(__file__).resolve().parents[1]
# With this set to 1 (CI sets it), a skipped test fails the run: the real-model
# and parity tests skip where torch, transformers or a GGUF package is missing,
# so a failed install would otherwise pass as green. Skips by design are named.
REQUIRE_OPTIONAL = os.environ.get("SPEC_JAX_REQUIRE_OPTIONAL") == "1"
EXPECTED_SKIPS = ("this GGUF carries no chat template",
                  "llama-cpp-python is not installed",
                  "this CPU cannot run the variant's instructions")
_unexpected_skips = []
# A small corpus that ships with the project: its own source.
CORPUS = str(REPO / "spec_jax")

# Most of a test's time is XLA compiling, and tests compile many of the same
# programs (the loop of one tiny pair under several tests). JAX's persistent
# cache shares them across tests, across the default and slow runs, and with
# the next run, which loads every program whose code did not change; the key
# covers the program, the XLA flags and the jax version. It lives in pytest's
# own git-ignored cache (JAX_COMPILATION_CACHE_DIR set beforehand picks
# another place), bounded by least-recently-used eviction. The variables
# reach the processes tests start: the experiments' `--compilation_cache`
# defaults to the directory, so tests never write to the user's cache.
CACHE_DIR = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                  str(REPO / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
# Every program, not only those over JAX's default second: the tests' many
# small programs recur across tests and in the processes they start, and
# caching them all made a cold run 16% faster (tests/test_refill.py and
# tests/test_draft_length.py: 126 s against 106 s).
MIN_COMPILE_SECS = os.environ.setdefault(
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_compilation_cache_max_size",
                  int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(MIN_COMPILE_SECS))


def tiny_pair(vocab_size=16, max_len=64, sharpness=12.0, draft_noise=0.2,
              seed=0, num_layers=2):
  """A target and a draft that is a perturbed copy of it.

  Freshly initialised transformers predict nearly uniform next tokens, which
  makes every sampler look right. Scaling the tied embedding makes the laws
  peaked, scaling the position table keeps greedy decoding from repeating one
  token forever, and perturbing the target's weights gives a draft that agrees with
  it often but not always, as a real draft does.
  """
  config = sj.TransformerConfig(vocab_size=vocab_size, d_model=32,
                                num_layers=num_layers, num_heads=4, d_ff=64,
                                max_len=max_len)
  target_key, noise_key = jax.random.split(jax.random.key(seed))
  target = sj.Model.init(config, target_key)
  params = dict(target.params)
  params["embed"] = {"embedding": params["embed"]["embedding"] * sharpness}
  params["positions"] = params["positions"] * 100
  target = target.replace(params=params)
  return target, target.replace(params=_perturb(target.params, noise_key,
                                                draft_noise))


@jax.jit
def _perturb(params, key, scale):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
      for x, k in zip(leaves, keys)
  ])


def loop_cycles(target, drafter, prompts, config, num_cycles=3, seed=2):
  """The decode loop's own step run num_cycles times from the prefilled
  state of the prompts: yields each state and each row's advance [B]."""
  padded, lengths = map(jnp.asarray, sj.pad_prompts(prompts))
  state = decoding._initial_state(  # pylint: disable=protected-access
      jax.random.key(seed), target, drafter, padded, lengths, config,
      len(prompts))
  step = jax.jit(decoding.speculative_step,
                 static_argnames="config")
  for _ in range(num_cycles):
    before = state.lengths
    state = step(state, target, drafter, config)
    yield state, np.asarray(state.lengths - before)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops every compiled program after each test module. A process runs many
  modules (the whole suite under `-n 0`, a share of the files per xdist
  worker), and each compiled program keeps its code mapped: left to
  accumulate over 300 tests, XLA aborted while compiling late in the run."""
  yield
  jax.clear_caches()


@pytest.fixture(scope="session")
def pair():
  return tiny_pair()


def _pooled(counts, law):
  """(observed, expected) over the chi-square's cells: law [K] scaled to
  counts.sum(), the cells expected to hold fewer than 5 draws pooled."""
  counts, law = np.asarray(counts), np.asarray(law, np.float64)
  expected = law / law.sum() * counts.sum()
  small = expected < 5
  observed, expected_kept = counts[~small], expected[~small]
  if expected[small].sum() > 0:
    observed = np.append(observed, counts[small].sum())
    expected_kept = np.append(expected_kept, expected[small].sum())
  return observed, expected_kept


def chi_square_p_value(counts, law):
  """Pearson's goodness-of-fit p-value of counts [K] against law [K]
  (probabilities or expected counts: it is scaled to counts.sum()), the
  cells expected to hold fewer than 5 draws pooled into one. A draw in a cell
  the law gives probability 0 is an impossible outcome: p = 0."""
  if np.asarray(counts)[np.asarray(law) == 0].any():
    return 0.0
  return stats.chisquare(*_pooled(counts, law)).pvalue


def detectable_total_variation(counts, law, significance, power=0.9):
  """The smallest total variation, over the cells `chi_square_p_value`
  tests, that it rejects at `significance` with probability >= `power`.

  Against a sampling law p' that is TV = d away from the law p over K cells,
  Pearson's statistic on N draws is noncentral chi-square with K - 1 degrees
  of freedom and noncentrality N sum (p' - p)^2 / p >= 4 N d^2 (by
  Cauchy-Schwarz, (sum |p' - p|)^2 <= sum (p' - p)^2 / p). So d is the one
  that makes 4 N d^2 the noncentrality with the wanted power.
  """
  _, expected = _pooled(counts, law)
  dof = len(expected) - 1
  critical = stats.chi2.isf(significance, dof)
  noncentrality = optimize.brentq(
      lambda nc: stats.ncx2.sf(critical, dof, nc) - power, 1e-9, 1e7)
  return float(np.sqrt(noncentrality / (4 * expected.sum())))


def tiny_train_config(**overrides):
  config = train_configs.get_config("runlocal")
  config.corpus = CORPUS
  config.update(overrides)
  return config


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
  """(target dir, draft dir) trained for a few steps on the tiny corpus."""
  root = tmp_path_factory.mktemp("models")
  # Two layers, so that layer skip has one to skip.
  train.train(tiny_train_config(model=dict(
      d_model=32, num_layers=2, num_heads=2, d_ff=64, max_len=128)),
              root / "target")
  draft_config = tiny_train_config(
      tokenizer=str(root / "target" / "model"), seed=1,
      model=dict(d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=128))
  train.train(draft_config, root / "draft")
  return root / "target" / "model", root / "draft" / "model"


def run_module(module, *flags):
  return subprocess.run([sys.executable, "-m", module, *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=600)


def _note_skip(report) -> None:
  if report.skipped and not hasattr(report, "wasxfail"):
    reason = (report.longrepr[2] if isinstance(report.longrepr, tuple)
              else str(report.longrepr))
    if not any(expected in reason for expected in EXPECTED_SKIPS):
      _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
  _note_skip(report)  # a module that skips whole (pytest.importorskip)


def pytest_runtest_logreport(report):
  _note_skip(report)


def pytest_sessionfinish(session):
  if REQUIRE_OPTIONAL and _unexpected_skips:
    print("\nSPEC_JAX_REQUIRE_OPTIONAL=1, and these tests were skipped:\n  "
          + "\n  ".join(_unexpected_skips))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
