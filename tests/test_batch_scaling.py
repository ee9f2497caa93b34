"""The batch-scaling ablation: its row arithmetic on a made-up run, the
crossover, and the entry point end to end on the built-in pair."""

import json

import pytest

from experiments.harness import batch_scaling, timing
from conftest import run_module


def made_up_row(batch_size, temperature=0.0, verify_s=0.002,
                target_step_s=0.001):
  """A row from a run of 100 AR steps and 30 SD cycles at gamma 4."""
  run = {
      "gamma": 4, "temperature": temperature, "num_batches": 2,
      "ar": {"new_tokens": 100 * batch_size, "wall_s": 1.0, "steps": 100,
             "tokens_per_s": 100.0 * batch_size},
      "sd": {"new_tokens": 100 * batch_size, "tokens_per_s": 200.0 * batch_size,
             "mean_overlap": 0.8, "acceptance_rate": 0.7,
             "tokens_per_cycle": 3.4, "row_cycles": 30 * batch_size,
             "cycles": 30, "position_acceptance": [0.8, 0.6, 0.5, 0.4],
             "conditional_position_acceptance": [0.8, 0.75, 0.8, 0.8]}}
  parts = {"draft_step_s": 0.1 * target_step_s, "verify_s": verify_s,
           "cycle_s": verify_s + 0.4 * target_step_s,
           "target_step_s": target_step_s, "target_prefill_s": 0.01,
           "draft_prefill_s": 0.001}
  return batch_scaling.row_of(batch_size, run, timing.Costs(**parts))


def test_row_sets_the_verify_cost_beside_gamma_plus_1_and_the_break_even():
  row = made_up_row(8, verify_s=0.004, target_step_s=0.002)
  assert row["batch_size"] == 8 and row["speedup"] == pytest.approx(2.0)
  assert row["verify_cost_ratio"] == pytest.approx(2.0)
  assert row["verify_over_gamma_plus_1"] == pytest.approx(2.0 / 5)
  assert row["draft_cost_ratio"] == pytest.approx(0.1)
  assert row["target_step_s_per_row"] == pytest.approx(0.002 / 8)
  # SD pays while the verify costs less than the AR steps a loop cycle
  # replaces (100 / 30), less gamma c.
  assert row["ar_steps_per_sd_cycle"] == pytest.approx(100 / 30)
  assert row["break_even_verify_cost"] == pytest.approx(100 / 30 - 4 * 0.1)
  # The i.i.d. model at alpha 0.8, gamma 4: tau 3.36 over 4 * 0.1 + v.
  assert row["predicted_speedup_iid"] == pytest.approx(3.3616 / 2.4)
  assert row["predicted_speedup_flat_verify"] == pytest.approx(3.3616 / 1.4)


def test_crossover_is_the_first_batch_size_where_sd_is_slower():
  rows = [made_up_row(b, t, verify_s=v * 0.001)
          for t in (0.0, 1.0) for b, v in ((1, 1.5), (8, 2.5), (32, 4.5))]
  for row in rows:  # T=1 never crosses
    if row["temperature"] == 1.0:
      row["speedup"] = 1.2
    else:
      row["speedup"] = {1: 1.5, 8: 0.9, 32: 1.1}[row["batch_size"]]
  assert batch_scaling.crossover(rows, "speedup") == {"0": 8, "1": None}
  # Predicted: 3.36 / (0.4 + v) falls below 1 once v > 2.96.
  assert batch_scaling.crossover(rows, "predicted_speedup_iid") == {
      "0": 32, "1": 32}
  # An adaptive row has a measured speedup and no gamma-bound prediction.
  adaptive = {**made_up_row(8), "speedup": 0.95, "policy": "adaptive",
              "refill": True, "predicted_speedup_iid": None}
  assert batch_scaling.crossover(rows + [adaptive], "speedup")[
      "0 adaptive refill"] == 8
  assert "0 adaptive refill" not in batch_scaling.crossover(
      rows + [adaptive], "predicted_speedup_iid")
  # The terminal table shows the one missing cell as "-".
  assert batch_scaling.format_table([adaptive]).splitlines()[1].split(
      ).count("-") == 1


def test_busy_shares_separate_the_queue_order_from_the_queue_end():
  # Two rows, prompts of 2, 2 and 4 cycles in that order: the 4 starts
  # third and runs 6 cycles where 4 hold 8 row-cycles of work.
  shares = batch_scaling.busy_shares([2, 2, 4], 2, 6)
  assert shares["busy_share"] == 8 / 12
  # Longest first, the 4 beside the two 2s: 4 cycles, none idle.
  assert shares["busy_share_longest_first"] == 1.0


def test_bad_batch_sizes_are_refused_before_loading(tmp_path):
  result = run_module("experiments.batch_scaling",
                      "--config=configs/batch_scaling.py",
                      f"--workdir={tmp_path}", "--config.batch_sizes=0,2")
  assert result.returncode != 0 and "batch sizes >= 1" in result.stderr


@pytest.mark.slow  # about 150 s: each cell compiles a dozen programs
def test_smoke_run_writes_the_json_and_the_plot(tmp_path):
  result = run_module("experiments.batch_scaling",
                      "--config=configs/batch_scaling.py:runlocal",
                      f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "[2/2] T=1 batch= 2" in result.stderr  # progress per row
  report = json.loads((tmp_path / "batch_scaling.json").read_text())
  assert {"code_version", "config", "rows", "crossover"} <= set(report)
  rows = report["rows"]
  assert [(r["temperature"], r["batch_size"], r["refill"], r["policy"])
          for r in rows] == [
              (1, b, refill, policy) for b in (1, 2)
              for refill, policy in ((False, "fixed"), (True, "fixed"),
                                     (True, "adaptive"))]
  for row in rows:
    assert {"speedup", "predicted_speedup_iid", "predicted_speedup",
            "tokens_per_cycle", "verify_cost_ratio", "draft_cost_ratio",
            "target_step_s", "verify_over_gamma_plus_1",
            "break_even_verify_cost"} <= set(row)
    assert row["tokens_per_cycle"] >= 1 and row["speedup"] > 0
    assert row["verify_cost_ratio"] > 0 and row["draft_cost_ratio"] > 0
    assert row["speedup"] == pytest.approx(
        row["sd_tokens_per_s"] / row["ar_tokens_per_s"])
    if row["refill"]:
      assert sum(row["limit_cycles"]) == row["cycles"]
  adaptive = [r for r in rows if r["policy"] == "adaptive"]
  assert all(len(r["cycle_costs"]["verify"]) == 3 for r in adaptive)
  # Predictions for cycles of gamma drafts are left out of the adaptive rows.
  assert all(r[key] is None for r in adaptive
             for key in batch_scaling.GAMMA_PREDICTIONS)
  assert set(report["crossover"]) == {"measured", "predicted"}
  assert set(report["crossover"]["measured"]) == {
      "1", "1 fixed refill", "1 adaptive refill"}
  assert set(report["crossover"]["predicted"]) == {"1", "1 fixed refill"}
  assert (tmp_path / "batch_scaling.png").read_bytes()[:4] == b"\x89PNG"
