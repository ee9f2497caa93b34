"""Sharded decoding: exact layouts, clear errors, fake devices, real processes.

The suite runs on one CPU device, and the device count is fixed when JAX
starts, so the multi-device checks run in subprocesses: tests/sharded_decode.py
with 8 fake devices, and `experiments.run` as two processes of 4 devices.
"""

import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import spec_jax as sj
from experiments.harness import compare, loading
from spec_jax import sharding
from spec_jax.io import pretrained
from configs import quickstart as quickstart_configs

REPO = pathlib.Path(__file__).resolve().parents[1]


def abstract_mesh(data, model):
  """Mesh shape without devices: enough for the checks made before compiling."""
  return AbstractMesh((data, model), (sharding.DATA, sharding.MODEL))


def test_padded_head_major_layout_gives_the_same_logits(pair):
  target, _ = pair  # 4 heads of 8
  # What plan_config gives for a model axis of 3 (or 6), were d_ff divisible.
  planned = dataclasses.replace(target.config, num_heads=6, num_kv_heads=6,
                                head_dim=8, qkv_head_major=True)
  padded = sj.Model(planned, sharding.to_layout(target.params, target.config,
                                                planned))
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, target.vocab_size)
  np.testing.assert_allclose(sj.score(padded, tokens),
                             sj.score(target, tokens), rtol=1e-5, atol=1e-5)
  # Negative control: the reordered rows read in the trained order are wrong.
  misread = sj.Model(dataclasses.replace(planned, qkv_head_major=False),
                     padded.params)
  assert not np.allclose(sj.score(misread, tokens), sj.score(target, tokens),
                         atol=1e-3)


def test_padded_head_major_layout_with_grouped_kv_heads():
  """Llama-style GQA: 6 query heads on 2 key/value heads, padded to 3 key/value
  heads (9 query heads) as plan_config does for a model axis of 3."""
  config = sj.TransformerConfig(
      vocab_size=32, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2,
      d_ff=64, max_len=32, norm="rms", position="rope", mlp="swiglu",
      qkv_bias=False, bias=False, tie_embeddings=False)
  model = sj.Model.init(config, jax.random.key(1))
  planned = dataclasses.replace(config, num_heads=9, num_kv_heads=3,
                                head_dim=8, qkv_head_major=True)
  padded = sj.Model(planned, sharding.to_layout(model.params, config, planned))
  assert padded.init_cache(1, 4).keys[0].shape == (1, 3, 4, 8)
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
  np.testing.assert_allclose(sj.score(padded, tokens), sj.score(model, tokens),
                             rtol=1e-5, atol=1e-5)


def test_init_model_creates_params_in_their_shardings():
  config = sj.TransformerConfig(vocab_size=16, d_model=16, num_layers=1,
                                num_heads=2, d_ff=32, max_len=8)
  mesh = sharding.make_mesh(sharding.MeshConfig(), jax.devices()[:1])
  model = sharding.init_model(config, jax.random.key(3), mesh)
  plain = sj.Model.init(config, jax.random.key(3))
  jax.tree.map(np.testing.assert_array_equal, model.params, plain.params)
  kernel = model.params["block_0"]["qkv"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("model", None)
  assert model.cache_sharding.lengths.spec == jax.sharding.PartitionSpec("data")


def test_mesh_that_does_not_match_the_devices_is_refused():
  devices = jax.devices()[:1]
  with pytest.raises(sharding.MeshError, match="does not match the 1 devices"):
    sharding.make_mesh(sharding.MeshConfig(data=2, model=1), devices)
  with pytest.raises(sharding.MeshError, match="at most one may be -1"):
    sharding.make_mesh(sharding.MeshConfig(data=-1, model=-1), devices)
  mesh = sharding.make_mesh(sharding.MeshConfig(), devices)
  assert dict(mesh.shape) == {"data": 1, "model": 1}


@pytest.mark.parametrize("field, size", [("d_ff", 102), ("vocab_size", 250)])
def test_sizes_the_model_axis_does_not_divide_are_refused(field, size):
  config = sj.TransformerConfig(vocab_size=256, d_model=32, num_heads=4,
                                d_ff=64)
  config = dataclasses.replace(config, **{field: size})
  with pytest.raises(sharding.MeshError, match=f"{field}={size}.*model axis"):
    sharding.plan_config(config, abstract_mesh(2, 4), name="target")
  with pytest.raises(sharding.MeshError, match="replicate_draft"):
    sharding.plan_config(config, abstract_mesh(2, 4), name="draft")
  # A replicated draft needs no such split.
  assert sharding.plan_config(config, abstract_mesh(2, 4), replicate=True,
                              name="draft") == config


def test_heads_are_padded_and_the_padding_is_said(caplog):
  config = sj.TransformerConfig(vocab_size=512, d_model=384, num_heads=6,
                                d_ff=1536)
  planned = sharding.plan_config(config, abstract_mesh(1, 8), name="target")
  assert (planned.num_heads, planned.head_dim) == (8, 64)
  assert ("target: 6 key/value heads padded with zero heads to 8"
          in caplog.text)


def test_batch_the_data_axis_does_not_divide_is_refused():
  with pytest.raises(sharding.MeshError, match="batch size 3.*data axis \\(2\\)"):
    sharding.check_batch(3, abstract_mesh(2, 4))
  config = quickstart_configs.get_config("runlocal")
  config.batch_size = 3
  with pytest.raises(sharding.MeshError, match="batch size 3"):
    compare.compare(config, None, [], abstract_mesh(2, 1))


def run_with_8_devices(*flags, timeout=600):
  result = subprocess.run(
      [sys.executable, "tests/sharded_decode.py", *flags], cwd=REPO,
      env=dict(os.environ, JAX_NUM_CPU_DEVICES="8",
               PYTHONPATH=os.pathsep.join(
                   [str(REPO), os.environ.get("PYTHONPATH", "")])),
      capture_output=True,
      text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.splitlines()[-1])


def check_report(report, temperatures):
  for shape, entry in report.items():
    if shape == "reference_lengths":
      continue
    for t in temperatures:
      run = entry["runs"][t]
      assert run["same_tokens"], (shape, t)
      # Only tokens and per-row values move between devices inside the
      # program: no parameter or cache is gathered.
      assert run["largest_move"] < entry["smallest_sharded"], (shape, t, run)


def test_mesh_2x4_gives_the_one_device_tokens_and_splits_the_params():
  report = run_with_8_devices("--meshes=2x4", "--temperatures=0",
                              "--max_new_tokens=12")
  check_report(report, ["0"])
  # The reference is a whole decode: each of its 8 rows ran to
  # max_new_tokens.
  assert report["reference_lengths"] == {"0": [12] * 8}
  entry = report["2x4"]
  assert entry["num_heads"] == 8  # 6 heads padded for the model axis of 4
  share = entry["param_bytes_per_device"]
  assert share <= 0.3 * entry["param_bytes"]
  assert share <= 0.3 * entry["unpadded_param_bytes"]
  specs = entry["specs"]
  assert specs["embed/embedding"] == "P('model', None)"
  assert specs["block_0/qkv/kernel"] == "P('model', None)"
  assert specs["block_0/attn_out/kernel"] == "P(None, 'model')"
  assert specs["block_5/mlp_in/kernel"] == "P('model', None)"
  assert specs["block_5/mlp_out/kernel"] == "P(None, 'model')"
  assert specs["positions"] == "P(None, None)"


@pytest.mark.slow  # the float32 test above covers the layout
def test_bfloat16_weights_on_a_mesh_give_the_one_device_tokens():
  report = run_with_8_devices("--meshes=2x4", "--temperatures=0,1",
                              "--weight_dtype=bfloat16")
  check_report(report, ["0", "1"])
  assert report["2x4"]["dtypes"] == ["bfloat16", "float32"]


@pytest.mark.slow
def test_every_mesh_of_8_gives_the_one_device_tokens_greedy_and_sampled():
  # Keys are replicated and random bits do not depend on the sharding, so at
  # temperature 1 the same seed gives the same tokens on every mesh.
  report = run_with_8_devices("--meshes=1x8,2x4,8x1", "--temperatures=0,1",
                              "--max_new_tokens=24")
  check_report(report, ["0", "1"])
  assert report["1x8"]["num_heads"] == report["2x4"]["num_heads"] == 8
  assert report["8x1"]["num_heads"] == 6  # nothing split over model


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # about 40-100 s; CI runs the slow tests too (.ci/run)
def test_two_processes_give_the_single_process_tokens(tmp_path):
  """Two processes of 4 CPU devices form one (2, 4) mesh over localhost."""
  flags = ["--config=configs/quickstart.py:runlocal", "--config.temperatures=0",
           "--config.batch_size=2", "--config.mesh.data=2",
           "--config.mesh.model=4",
           f"--coordinator_address=127.0.0.1:{free_port()}",
           "--num_processes=2"]
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4")
  begin = time.monotonic()
  processes = [
      subprocess.Popen(
          [sys.executable, "-m", "experiments.run", *flags,
           f"--process_id={i}", f"--workdir={tmp_path / str(i)}"],
          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          text=True)
      for i in range(2)]
  try:
    logs = [p.communicate(timeout=max(1, 120 - (time.monotonic() - begin)))[0]
            for p in processes]
  finally:
    for p in processes:  # on a timeout or failure, leave nothing running
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(processes, logs):
    assert p.returncode == 0, log[-3000:]
  assert not (tmp_path / "1" / "results.json").exists()  # process 0 writes
  results = json.loads((tmp_path / "0" / "results.json").read_text())
  assert results["mesh"] == {"data": 2, "model": 4}
  assert results["num_processes"] == 2

  # The single-process answer: greedy decoding on one device.
  config = quickstart_configs.get_config("runlocal")
  target, _ = loading.load_pair(config.target, config.draft)
  target, tokenizer = target.model, target.tokenizer
  prompts = loading.load_prompts(config, tokenizer)
  ids, lengths = sj.pad_prompts([tokenizer.encode(p).ids for p in prompts])
  one = sj.generate_autoregressive(
      jax.random.key(0), target, ids, lengths,
      sj.DecodeConfig(max_new_tokens=config.max_new_tokens,
                      sampling=sj.Sampling(temperature=0.0),
                      eos_id=tokenizer.token_to_id(pretrained.EOS)))
  (run,) = results["runs"]
  for sample, tokens, n in zip(run["samples"], np.asarray(one.tokens),
                               np.asarray(one.num_tokens)):
    assert sample["ar_tokens"] == tokens[:n].tolist()
    assert sample["sd_tokens"] == tokens[:n].tolist()


@pytest.mark.parametrize("line, size", [
    ("%a = f32[8,128]{1,0} all-gather(f32[2,128]{1,0} %p), dimensions={0}",
     1024),
    # Sums of partial activations are not moves.
    ("%a = bf16[4,384]{1,0} all-reduce(bf16[4,384]{1,0} %x), to_apply=%add",
     0),
    # Async: the result is a tuple (operand, output); the output counts.
    ("%a = (f32[2,64]{1,0}, f32[16,64]{1,0}) all-gather-start(f32[2,64]{1,0}"
     " %q), dimensions={0}", 1024),
    ("%a = f32[3]{0} reduce-scatter(f32[24]{0} %r), dimensions={0}", 0),
    ("%a = (f32[4]{0}, f32[8]{0}) collective-permute-start(f32[4]{0} %c), "
     "source_target_pairs={{0,1}}", 8),
    ("%a = s32[8,2]{1,0} all-to-all(s32[8,2]{1,0} %t), dimensions={0}", 16),
    ("%a = f32[5]{0} collective-permute(f32[5]{0} %c), "
     "source_target_pairs={{0,1}}", 5),
    # Not a collective, though an operand is named after one.
    ("%a = f32[999,999]{1,0} fusion(f32[8,128]{1,0} %all-gather.1)", 0),
])
def test_largest_move_reads_every_collective(line, size):
  """The check that no parameter or cache is gathered reads every form of
  collective XLA prints (its positive control)."""
  import sharded_decode  # pylint: disable=import-outside-toplevel
  assert sharded_decode.largest_move(line) == size
