"""The llama.cpp comparison: the GGUF it re-writes for llama.cpp holds the
same model, and (where llama-cpp-python is installed) its smoke run."""

import importlib.util
import json

import jax
import numpy as np
import pytest

import spec_jax as sj
from conftest import run_module
from experiments.harness import compare_llamacpp
from spec_jax.io import gguf as sj_gguf
from test_gguf import _config, write_gguf


@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_the_dequantized_file_holds_the_same_model(tmp_path, weight_type):
  """A Q8_0 file written back as F32 loads to the very params the Q8_0 file
  loads to, tokenizer and metadata included; as F16, to those params rounded
  to float16."""
  model = sj.Model.init(_config("llama"), jax.random.key(0))
  source = write_gguf(tmp_path / "q8.gguf", model, "llama", "Q8_0")
  out = tmp_path / f"{weight_type}.gguf"
  compare_llamacpp.dequantized_gguf(str(source), out, weight_type)
  want, got = sj_gguf.load_gguf(source), sj_gguf.load_gguf(out)
  assert got.model.config == want.model.config
  assert got.stop_ids == want.stop_ids
  assert got.chat_template == want.chat_template
  assert not list(tmp_path.glob("*.partial"))
  round_trip = (lambda x: x) if weight_type == "F32" else (
      lambda x: np.asarray(x, np.float16).astype(np.float32) if x.ndim == 2
      else x)
  jax.tree.map(lambda w, g: np.testing.assert_array_equal(
      g, round_trip(np.asarray(w))), want.model.params, got.model.params)


def test_summary_pools_and_splits_by_category():
  """tokens/s pooled over every prompt and within each category, and the
  count of outputs equal to the tool's AR."""
  runs = {"ar": [([1, 2], 1.0), ([3], 2.0), ([4, 5, 6], 1.0)],
          "lookup_4": [([1, 2], 0.5), ([3, 9], 1.0), ([4, 5, 6], 0.5)]}
  summary = compare_llamacpp._summary(runs, [t for t, _ in runs["ar"]],
                                      ["code", "edit", "code"])
  assert summary["ar"]["tokens_per_s"] == 6 / 4
  assert summary["ar"]["equal_to_ar"] == 3
  assert summary["lookup_4"]["equal_to_ar"] == 2
  assert summary["lookup_4"]["tokens_per_s"] == 7 / 2
  by_category = summary["lookup_4"]["by_category"]
  assert list(by_category) == ["code", "edit"]
  assert by_category["code"] == {"tokens": 5, "seconds": 1.0,
                                 "tokens_per_s": 5.0}
  assert by_category["edit"]["tokens_per_s"] == 2.0
  table = compare_llamacpp.format_table({"weights": {"F32": {
      "llama_cpp": summary, "spec_jax": summary}}})
  assert "by category" in table and "code" in table


@pytest.mark.slow  # builds nothing, but loads SmolLM2 twice and times both
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (the optional "
                    "llamacpp extra, never a test dependency)")
def test_compare_llamacpp_smoke_run(tmp_path):
  result = run_module("experiments.compare_llamacpp",
                      "--config=configs/compare_llamacpp.py:runlocal",
                      f"--workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads((tmp_path / "compare_llamacpp.json").read_text())
  row = report["weights"]["F32"]
  for tool in ("llama_cpp", "spec_jax"):
    assert set(row[tool]) == {"ar", "lookup_4"}
    for summary in row[tool].values():
      assert summary["tokens_per_s"] > 0
      assert summary["equal_to_ar"] == summary["prompts"]
      assert set(summary["by_category"]) == set(row["categories"])
