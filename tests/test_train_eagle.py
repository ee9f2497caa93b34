"""Training an EAGLE head from the command line, and using it everywhere a
drafter is named: resume, the head directory, the exactness and drafter
comparison entry points, and the shipped head of the built-in target."""

import json
import logging

import jax
import numpy as np
import pytest

import spec_jax as sj
from configs import quickstart as quickstart_configs
from configs import train_eagle as train_eagle_configs
from experiments.harness import eagle_data, loading, train_eagle
from spec_jax import eagle
from conftest import CORPUS, run_module


def tiny_config(target, **overrides):
  config = train_eagle_configs.get_config("runlocal")
  config.target = str(target)
  config.corpus = CORPUS
  config.feature_layers = (1, 2)
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def tiny_head(tiny_models, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("eagle")
  train_eagle.train(tiny_config(tiny_models[0]), workdir)
  return workdir


@pytest.mark.slow  # 17 s: trains, stops and resumes a head
def test_training_resumes_and_writes_a_learning_curve(tiny_models, tmp_path,
                                                      caplog):
  caplog.set_level(logging.INFO, logger="experiments")
  train_eagle.train(tiny_config(tiny_models[0], num_steps=3), tmp_path)
  assert "self-distillation:" in caplog.text
  caplog.clear()
  config = tiny_config(tiny_models[0], num_steps=6)
  train_eagle.train(config, tmp_path)
  assert "resumed from step 3" in caplog.text
  assert "self-distillation:" not in caplog.text  # the cache was reused
  record = json.loads((tmp_path / "learning_curve.json").read_text())
  assert record["code_version"] and record["config"]["num_steps"] == 6
  curve = record["evaluations"]
  assert [r["step"] for r in curve] == [3, 6]
  # One top-1 accuracy per training-time step, i.e. per draft position.
  assert len(curve[-1]["top1"]) == config.ttt_steps
  assert curve[-1]["tokens_seen"] == 6 * 4 * 32
  assert (tmp_path / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
  metadata = json.loads((tmp_path / "head" / "metadata.json").read_text())
  assert metadata["tokens_seen"] == 6 * 4 * 32


def test_head_directory_loads_as_a_drafter(tiny_models, tiny_head):
  config = quickstart_configs.get_config("runlocal")
  config.target = str(tiny_models[0])
  config.drafter = "eagle3"
  config.eagle = str(tiny_head / "head")
  loaded = loading.load_models(config)
  assert isinstance(loaded.drafter, eagle.EagleDrafter)
  assert loaded.drafter.config.draft_vocab_size == 64
  assert loaded.drafter.vocab_ids.shape == (64,)
  assert "EAGLE-3 head" in loaded.describe()


def test_missing_head_is_a_clear_error(tiny_models, tmp_path):
  result = run_module(
      "experiments.run", "--config=configs/quickstart.py:runlocal",
      f"--workdir={tmp_path}", f"--config.target={tiny_models[0]}",
      "--config.drafter=eagle3", f"--config.eagle={tmp_path / 'nothing'}")
  assert result.returncode != 0 and "train_eagle" in result.stderr


@pytest.mark.slow  # 30 s
def test_exactness_and_drafter_comparison_run_with_the_head(
    tiny_models, tiny_head, tmp_path):
  result = run_module(
      "experiments.exactness", "--config=configs/exactness.py:runlocal",
      f"--workdir={tmp_path}", f"--config.target={tiny_models[0]}",
      "--config.drafter=eagle3", f"--config.eagle={tiny_head / 'head'}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(json.loads((tmp_path / "report.json").read_text())
             ["settings"]) == 2
  result = run_module(
      "experiments.compare_drafters",
      "--config=configs/compare_drafters.py:runlocal", f"--workdir={tmp_path}",
      f"--config.target={tiny_models[0]}", f"--config.draft={tiny_models[1]}",
      f"--config.corpus={CORPUS}", "--config.prompt_tokens=8",
      "--config.temperatures=0",
      "--config.variants.layer_skip.layer_skip.num_layers=1",
      f"--config.variants.eagle.eagle={tiny_head / 'head'}")
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads((tmp_path / "drafters.json").read_text())["rows"]
  assert {r["drafter"] for r in rows} == {"model", "ngram", "layer_skip",
                                          "eagle3"}
  for row in rows:
    assert row["tokens_per_cycle"] >= 1 and row["speedup"] > 0
    assert row["draft_cost_ratio"] > 0
    assert len(row["position_acceptance"]) == row["gamma"]
  assert (tmp_path / "drafters.png").read_bytes()[:4] == b"\x89PNG"


def test_instructions_come_from_training_files_only():
  requests = eagle_data.instructions(50, seed=0, corpus=CORPUS)
  assert len(requests) == 50 and len(set(requests)) == 50
  assert any(r.startswith("Write a Python function") for r in requests)
  assert any(r.startswith("What does this Python code do?")
             for r in requests)
  _, heldout = eagle_data.data.split_texts(
      eagle_data.data.corpus_files(CORPUS))
  from_heldout = {r for text in heldout for r in eagle_data._requests(text)}  # pylint: disable=protected-access
  assert from_heldout and not from_heldout & set(requests)


def test_shipped_head_is_exact_and_accepts_on_the_builtin_target():
  config = quickstart_configs.get_config("runlocal")
  config.drafter = "eagle3"
  loaded = loading.load_models(config)
  prompts = loading.load_prompts(config, loaded.target.tokenizer)[:4]
  ids = [loaded.target.tokenizer.encode(p).ids for p in prompts]
  padded, lengths = sj.pad_prompts(ids)
  decode = sj.DecodeConfig(gamma=4, max_new_tokens=32,
                           sampling=sj.Sampling(temperature=0))
  key = jax.random.key(0)
  target = loaded.target.model
  spec = sj.generate(key, target, loaded.drafter, padded, lengths, decode)
  plain = sj.generate_autoregressive(key, target, padded, lengths, decode)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert spec.stats.tokens_per_cycle > 2.5, spec.stats.summary()
