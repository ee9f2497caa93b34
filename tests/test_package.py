"""The package boundary: what `import spec_jax` loads, the public API, the
drafter contract and the statistics' arithmetic."""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj

HARNESS_ONLY = ("matplotlib", "scipy", "absl", "ml_collections", "torch",
                "transformers", "orbax", "experiments")


def test_import_loads_no_harness_module():
  """spec_jax adds none of the harness's dependencies to what jax and flax
  load themselves (flax imports absl.logging on its own, so absl is judged
  against that baseline)."""
  code = (
      "import sys; import jax, flax.linen, flax.struct, numpy\n"
      "before = set(sys.modules)\n"
      "import spec_jax\n"
      "print(' '.join(sorted(set(sys.modules) - before)))")
  added = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True).stdout.split()
  tops = {name.split(".")[0] for name in added}
  assert not tops & set(HARNESS_ONLY), sorted(tops & set(HARNESS_ONLY))


def test_engine_source_names_no_harness_module():
  import pathlib  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(sj.__file__).parent
  for path in root.glob("*.py"):
    text = path.read_text()
    for name in ("absl", "ml_collections", "matplotlib", "scipy",
                 "experiments"):
      assert f"import {name}" not in text and f"from {name}" not in text, (
          path.name, name)
    assert "print(" not in text, path.name


def test_public_api_decodes_with_every_drafter(pair):
  target, draft = pair
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5]])
  config = sj.DecodeConfig(gamma=2, max_new_tokens=6,
                           sampling=sj.Sampling(temperature=0.0))
  ar = sj.generate_autoregressive(jax.random.key(0), target, prompts, lengths,
                                  config)
  chex.assert_shape(ar.tokens, (2, 6))
  for drafter in (sj.ModelDrafter(draft),
                  sj.LayerSkipDrafter(target, num_layers=1),
                  sj.NgramDrafter(target.vocab_size)):
    result = sj.generate(jax.random.key(0), target, drafter, prompts, lengths,
                         config)
    chex.assert_shape(result.tokens, (2, 6))
    np.testing.assert_array_equal(result.tokens, ar.tokens)
    assert isinstance(drafter.describe(), str)


def test_proposal_is_named_and_verify_scores_it(pair):
  target, draft = pair
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5]])
  drafter = sj.ModelDrafter(draft)
  max_len = 16
  state = drafter.prefill(jnp.asarray(prompts), jnp.asarray(lengths), max_len)
  cache = target.prefill(jnp.asarray(prompts), jnp.asarray(lengths), max_len)
  tokens = jnp.pad(jnp.asarray(prompts), ((0, 0), (0, 8)))
  proposal = drafter.propose(state, cache, tokens, jnp.asarray(lengths),
                             jax.random.key(0), 3, sj.Sampling())
  assert isinstance(proposal, sj.Proposal) and proposal.parents is None
  chex.assert_shape(proposal.tokens, (2, 3))
  chex.assert_shape(proposal.probs, (2, 3, target.vocab_size))
  verified = sj.verify(target, proposal.target_cache, tokens,
                       jnp.asarray(lengths), proposal.tokens, sj.Sampling(),
                       hidden_layers=(1,))
  assert isinstance(verified, sj.VerifyOutput)
  chex.assert_shape(verified.probs, (2, 4, target.vocab_size))
  chex.assert_shape(verified.hidden, [(2, 4, target.config.d_model)])


def test_drafters_validate_themselves(pair):
  target, _ = pair
  small = sj.Model.init(sj.TransformerConfig(
      vocab_size=target.vocab_size, d_model=16, num_layers=1, num_heads=2,
      d_ff=32, max_len=8), jax.random.key(0))
  with pytest.raises(ValueError, match="draft model has max_len=8"):
    sj.ModelDrafter(small).validate(target, max_len=20)
  with pytest.raises(ValueError, match="num_layers=2"):
    sj.LayerSkipDrafter(target, num_layers=2).validate(target, 20)
  with pytest.raises(ValueError, match="vocabulary"):
    sj.NgramDrafter(target.vocab_size + 1).validate(target, 20)


def test_stats_add_as_counters():
  """Merged stats have the ratios of the summed counts, not the mean of the
  runs' ratios."""
  one = sj.DecodeStats(cycles=np.int32(3), row_cycles=np.array([3]),
                       drafted=np.array([6]), accepted=np.array([6]),
                       accepted_per_position=np.array([[3, 3]]),
                       tried_per_position=np.array([[3, 3]]),
                       overlap_sum=np.array([6.0]),
                       point_mass_sum=np.array([5.0]), verified=np.array([6]),
                       width_cycles=np.array([0, 3]),
                       limit_cycles=np.array([0, 0, 3]))
  two = sj.DecodeStats(cycles=np.int32(4), row_cycles=np.array([1, 4]),
                       drafted=np.array([2, 8]), accepted=np.array([0, 2]),
                       accepted_per_position=np.array([[0, 0], [2, 0]]),
                       tried_per_position=np.array([[1, 0], [4, 2]]),
                       overlap_sum=np.array([0.5, 2.5]),
                       point_mass_sum=np.array([0.25, 0.75]),
                       verified=np.array([1, 5]), width_cycles=np.array([1, 3]),
                       limit_cycles=np.array([0, 1, 3]))
  merged = sj.DecodeStats.merge([one, two])
  assert int(merged.cycles) == 7 and merged.row_cycles.tolist() == [3, 1, 4]
  assert merged.width_cycles.tolist() == [1, 6]
  assert merged.limit_cycles.tolist() == [0, 1, 6]
  assert merged.tried_per_position.tolist() == [[3, 3], [1, 0], [4, 2]]
  assert merged.acceptance_rate == pytest.approx(8 / 16)
  assert merged.tokens_per_cycle == pytest.approx((8 + 8) / 8)
  assert merged.accepted_per_cycle == pytest.approx(8 / 8)
  assert merged.mean_overlap == pytest.approx(9 / 12)
  assert merged.mean_point_mass_acceptance == pytest.approx(6 / 12)
  np.testing.assert_allclose(merged.position_acceptance, [5 / 8, 3 / 8])
  np.testing.assert_allclose(merged.conditional_position_acceptance,
                             [5 / 8, 3 / 5])
  assert merged.summary()["tokens_per_cycle"] == merged.tokens_per_cycle


def test_conditional_acceptance_counts_only_drafts_proposed():
  """Four cycles, three drafting one token (two accepted) and one drafting
  two (both accepted), as under a draft-length policy: draft 2 was tried
  once and accepted once, so its conditional acceptance is 1, not the 1/3
  of dividing by every cycle that accepted draft 1."""
  stats = sj.DecodeStats(cycles=np.int32(4), row_cycles=np.array([4]),
                         drafted=np.array([5]), accepted=np.array([4]),
                         accepted_per_position=np.array([[3, 1]]),
                         tried_per_position=np.array([[4, 1]]),
                         overlap_sum=np.array([4.0]),
                         point_mass_sum=np.array([3.0]),
                         verified=np.array([5]), width_cycles=np.array([3, 1]),
                         limit_cycles=np.array([0, 3, 1]))
  np.testing.assert_allclose(stats.conditional_position_acceptance,
                             [3 / 4, 1.0])
  assert stats.summary()["conditional_position_acceptance"] == [0.75, 1.0]


def test_stats_leave_out_padding_rows():
  stats = sj.DecodeStats(cycles=np.int32(2), row_cycles=np.array([2, 2]),
                         drafted=np.array([4, 4]), accepted=np.array([1, 4]),
                         accepted_per_position=np.array([[1, 0], [2, 2]]),
                         tried_per_position=np.array([[2, 1], [2, 2]]),
                         overlap_sum=np.array([1.0, 4.0]),
                         point_mass_sum=np.array([0.5, 3.0]),
                         verified=np.array([3, 4]),
                         width_cycles=np.array([0, 2]),
                         limit_cycles=np.array([0, 0, 2]))
  real = stats.select_rows([0])
  assert real.accepted.tolist() == [1] and int(real.cycles) == 2
  assert real.tokens_per_cycle == pytest.approx((1 + 2) / 2)
  assert real.summary()["accepted_per_position"] == [1, 0]
  assert real.tried_per_position.tolist() == [[2, 1]]
