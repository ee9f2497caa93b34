"""The step benchmark: its verify timers run the width they name, and its
named shapes (published models' shapes with random weights) are timed as a
real checkpoint's are."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import bench_step as bench_step_config
from experiments.harness import bench_step, loading, timing
from experiments.harness import config as config_lib
from spec_jax import decoding, model
from spec_jax.io import gguf, hf

# The parameter counts each model's own card publishes.
PUBLISHED_PARAMETERS = {"smollm2_135m": 134_515_008,
                        "llama3_1b": 1_235_814_400,
                        "llama3_8b": 8_030_261_248,
                        "gemma3_1b": 999_885_952}


def test_the_verify_timer_runs_the_full_width_whatever_token_comes_back():
  """The timing loop feeds each verify's first output token back as the
  first draft. With prompt lookup's several verify widths, a proposal that
  stops proposing that token would time the one-token width; a one-hot q of
  the first drafts (the control) does."""
  config = bench_step_config.get_config("runlocal")
  config.update(config.models.builtin.to_dict())
  loaded = loading.load_models(config)
  target, drafter = loaded.target.model, loaded.drafter
  gamma = 4
  decode_config = config_lib.decode_config(config, 0.0, gamma=gamma)
  widths = decoding.loop_verify_widths(drafter, decode_config)
  assert len(widths) > 1
  tokens, lengths, _, cache, _ = timing._context(target, 1, 32)  # pylint: disable=protected-access
  proposal = bench_step.full_width_proposal(tokens[:, :gamma],
                                            target.vocab_size, cache)
  control = proposal.replace(
      probs=jax.nn.one_hot(proposal.tokens, target.vocab_size))

  def widths_run(proposal):
    return [int(decoding.verify_and_resample(
        jax.random.key(0), target, drafter,
        proposal.replace(tokens=proposal.tokens.at[:, 0].set(first)), tokens,
        lengths, jnp.ones((1,), bool), decode_config).width)
            for first in range(8)]

  assert widths_run(proposal) == [len(widths) - 1] * 8
  assert np.min(widths_run(control)) == 0


@pytest.mark.parametrize("shape", bench_step.NAMED_SHAPES)
def test_named_shapes_have_the_published_parameter_counts(shape):
  config = hf.config_from_hf(bench_step.NAMED_SHAPES[shape])
  params = model.abstract_params(config)
  assert sum(math.prod(p.shape) for p in jax.tree.leaves(
      params)) == PUBLISHED_PARAMETERS[shape]


def test_the_smollm2_shape_is_the_packaged_checkpoints_config():
  """Every field, read from the GGUF's metadata as load_gguf reads it."""
  path = gguf.packaged("smollm2-135m-instruct")
  if path is None:
    pytest.skip("smollm2-135m-instruct is not installed; see the README's "
                "set-up.")
  reader = gguf._open(path)  # pylint: disable=protected-access
  checkpoint = gguf.config_from_gguf(
      gguf._Metadata(reader, path),  # pylint: disable=protected-access
      {tensor.name for tensor in reader.tensors})
  named = hf.config_from_hf(bench_step.NAMED_SHAPES["smollm2_135m"])
  # GGUF stores the norm's epsilon as a float32.
  assert checkpoint.norm_eps == pytest.approx(named.norm_eps, rel=1e-6)
  assert dataclasses.replace(checkpoint, norm_eps=named.norm_eps) == named


@pytest.mark.slow  # 20 s: a 135M model's step and verify compiled and timed
def test_a_named_shape_is_timed_without_a_tokenizer():
  config = bench_step_config.get_config("shapes")
  config.gammas, config.batch_sizes, config.rounds = (2,), (1,), 1
  config.cache_length = 32
  row = bench_step.measure_model(
      config, {"shape": "smollm2_135m", "weight_dtype": "bfloat16"})
  # bfloat16 matmul weights; the norms stay float32.
  assert row["weight_bytes"] == pytest.approx(
      2 * PUBLISHED_PARAMETERS["smollm2_135m"], rel=1e-3)
  assert row["step_s"] > 0 and set(row["verify_cost_ratio"]) == {"2"}
  # The faster of the reads timed beside this model's step.
  assert row["bandwidth_gb_s"] == max(row["bandwidth_reads_gb_s"].values())
  assert "ar_tokens_per_s" not in row
  table = bench_step.format_table({"models": {"smollm2_135m": row}})
  assert table.splitlines()[1].split()[-2:] == ["-", "-"]


def test_an_unknown_shape_is_refused_before_anything_runs():
  config = bench_step_config.get_config("shapes")
  config.models = ml_collections.ConfigDict({"mine": {"shape": "llama3_70b"}})
  with pytest.raises(ValueError, match="models.mine.shape='llama3_70b': "
                     "choose one of"):
    bench_step.bench_step(config)


def test_a_named_shape_with_a_draft_model_is_refused():
  config = bench_step_config.get_config("shapes")
  config.drafter = "model"
  with pytest.raises(ValueError, match="a named shape has no draft model"):
    bench_step.bench_step(config)
