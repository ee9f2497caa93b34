"""Model directories: round trips, bad files, mismatched pairs."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import spec_jax as sj
from experiments.harness import compare, loading, train
from spec_jax.io import checkpoint
from configs import quickstart as quickstart_configs
from conftest import REPO, tiny_train_config


def test_checkpoint_round_trip_gives_identical_logits(tiny_models, tmp_path):
  model, tokenizer = checkpoint.load_model(tiny_models[0])
  checkpoint.save_model(tmp_path / "copy", model, tokenizer)
  loaded, loaded_tokenizer = checkpoint.load_model(tmp_path / "copy")
  tokens = jax.numpy.asarray([tokenizer.encode("def f(x):\n").ids])
  np.testing.assert_array_equal(sj.score(model, tokens),
                                sj.score(loaded, tokens))
  assert loaded_tokenizer.to_str() == tokenizer.to_str()


def test_missing_and_corrupt_checkpoints_raise(tiny_models, tmp_path):
  with pytest.raises(FileNotFoundError, match="no model at"):
    checkpoint.load_model(tmp_path / "nothing")
  model, tokenizer = checkpoint.load_model(tiny_models[0])
  checkpoint.save_model(tmp_path / "broken", model, tokenizer)
  data_files = [f for f in (tmp_path / "broken" / "params").rglob("*")
                if f.is_file() and f.stat().st_size > 1000]
  for f in data_files:  # truncate every array file
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
  with pytest.raises(ValueError, match="corrupt"):
    checkpoint.load_model(tmp_path / "broken")


def test_pair_with_different_tokenizers_is_refused(tiny_models, tmp_path):
  train.train(tiny_train_config(vocab_size=280, num_steps=2), tmp_path)
  with pytest.raises(ValueError, match="different tokenizers"):
    loading.load_pair(str(tiny_models[0]), str(tmp_path / "model"))


def test_builtin_pair_loads_and_greedy_sd_equals_ar():
  config = quickstart_configs.get_config("runlocal")
  config.max_new_tokens = 24
  config.temperatures = (0.0,)
  loaded = loading.load_models(config)
  prompts = loading.load_prompts(config, loaded.target.tokenizer)
  assert len(prompts) == config.num_prompts
  (run,) = compare.compare(config, loaded, prompts)
  for sample in run["samples"]:
    assert sample["sd_tokens"] == sample["ar_tokens"]
    assert len(sample["sd_tokens"]) > 0
  assert run["sd"]["acceptance_rate"] > 0.3


def test_model_loads_onto_the_default_device_whichever_device_wrote_it(
    tiny_models, tmp_path):
  # A model written on one device (a CPU) must load where that device does
  # not exist (a GPU or TPU). Two host devices stand in: written from the
  # second, it must come back on the first, the default.
  script = f"""
import jax
from spec_jax.io import checkpoint
model, tokenizer = checkpoint.load_model({str(tiny_models[0])!r})
params = jax.device_put(model.params, jax.devices()[1])
checkpoint.save_model({str(tmp_path / "copy")!r},
                      model.replace(params=params), tokenizer)
loaded, _ = checkpoint.load_model({str(tmp_path / "copy")!r})
print(sorted({{str(d) for x in jax.tree.leaves(loaded.params)
               for d in x.devices()}}))
"""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                          capture_output=True, text=True, check=True)
  assert result.stdout.split("\n")[-2] == "['cpu:0']", result.stdout
