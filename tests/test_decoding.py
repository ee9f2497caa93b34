"""The fused loop: greedy equality, full acceptance, row independence, one
program, and clear errors on bad input."""

import jax
import numpy as np
import pytest

import spec_jax as sj

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [2, 7, 1, 8, 2]]
MAX_NEW = 24


def decode_both(pair, gamma, sampling, eos_id=None, prompts=PROMPTS, seed=0):
  target, draft = pair
  padded, lengths = sj.pad_prompts(prompts)
  config = sj.DecodeConfig(gamma=gamma, max_new_tokens=MAX_NEW,
                           sampling=sampling, eos_id=eos_id)
  key = jax.random.key(seed)
  spec = sj.generate(key, target, sj.ModelDrafter(draft), padded, lengths,
                     config)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  return spec, plain


@pytest.fixture(scope="module")
def eos_id(pair):
  """A token the greedy target emits mid-way through row 0 and not before."""
  _, plain = decode_both(pair, 1, sj.Sampling(temperature=0))
  row = np.asarray(plain.tokens[0]).tolist()
  return next(t for i, t in enumerate(row) if i >= 4 and t not in row[:i])


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_speculative_equals_greedy_target(pair, eos_id, gamma):
  spec, plain = decode_both(pair, gamma, sj.Sampling(temperature=0), eos_id)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.num_tokens, plain.num_tokens)
  assert spec.num_tokens[0] < MAX_NEW  # row 0 stopped at EOS mid-way...
  assert len(set(np.asarray(spec.num_tokens).tolist())) > 1  # ...others later.
  stats = spec.stats.summary()
  assert 0 < stats["acceptance_rate"] < 1  # drafts were both kept and cut.


@pytest.mark.parametrize("sampling", [
    sj.Sampling(temperature=0), sj.Sampling(temperature=1),
    sj.Sampling(temperature=1, top_k=4, top_p=0.9),
])
def test_draft_equal_to_target_accepts_everything(pair, sampling):
  target, _ = pair
  spec, _ = decode_both((target, target), 4, sampling)
  stats = spec.stats.summary()
  assert stats["acceptance_rate"] == 1.0
  assert stats["tokens_per_cycle"] == 5.0
  assert abs(stats["mean_overlap"] - 1) < 1e-4
  # Every row-cycle before the last verifies all 4 drafts and a bonus token.
  assert stats["accepted_per_position"] == [stats["row_cycles"]] * 4


def test_statistics_are_consistent(pair):
  spec, _ = decode_both(pair, 4, sj.Sampling(temperature=1), seed=3)
  stats, raw = spec.stats.summary(), spec.stats
  assert stats["drafted"] == 4 * stats["row_cycles"]
  assert sum(stats["accepted_per_position"]) == stats["accepted"]
  # Acceptance by position can only fall: accepting i+1 requires accepting i.
  per_position = stats["accepted_per_position"]
  assert all(a >= b for a, b in zip(per_position, per_position[1:]))
  # Every row emits what its cycles produced, less what max_new_tokens cut.
  produced = np.asarray(raw.accepted + raw.row_cycles)
  assert (produced >= np.asarray(spec.num_tokens)).all()
  assert (produced - np.asarray(spec.num_tokens) <= 4).all()
  assert 0 < stats["mean_overlap"] < 1
  # A draft model proposes every position: draft 1 is tried every row-cycle,
  # draft i + 1 whenever draft i was accepted.
  tried, accepted = (np.asarray(raw.tried_per_position),
                     np.asarray(raw.accepted_per_position))
  np.testing.assert_array_equal(tried[:, 0], raw.row_cycles)
  np.testing.assert_array_equal(tried[:, 1:], accepted[:, :-1])


def test_rows_do_not_depend_on_each_other(pair):
  sampling = sj.Sampling(temperature=1)
  mixed, _ = decode_both(pair, 3, sampling, prompts=PROMPTS)
  swapped, _ = decode_both(pair, 3, sampling,
                           prompts=[PROMPTS[0], [5, 5, 5], [6], [1, 1]])
  np.testing.assert_array_equal(swapped.tokens[0], mixed.tokens[0])
  np.testing.assert_array_equal(swapped.num_tokens[0], mixed.num_tokens[0])


def test_same_key_same_tokens_and_one_compilation(pair):
  target, draft = pair
  config = sj.DecodeConfig(gamma=3, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=1))
  drafter = sj.ModelDrafter(draft)
  key = jax.random.key(7)
  first = sj.generate(key, target, drafter, *sj.pad_prompts(PROMPTS), config)
  compiled = sj.decoding.generate_jit._cache_size()
  again = sj.generate(key, target, drafter, *sj.pad_prompts(PROMPTS), config)
  np.testing.assert_array_equal(first.tokens, again.tokens)
  other = sj.generate(key, target, drafter,
                      *sj.pad_prompts([[3, 3], [1], [4, 4, 4], [2] * 10]),
                      config)
  assert sj.decoding.generate_jit._cache_size() == compiled
  assert not np.array_equal(other.tokens, first.tokens)


def bad_call(pair, prompts=PROMPTS, drafter=None, **config):
  target, draft = pair
  config = {"gamma": 2, "max_new_tokens": 8} | config
  sj.generate(jax.random.key(0), target, drafter or sj.ModelDrafter(draft),
              *sj.pad_prompts(prompts), sj.DecodeConfig(**config))


def test_bad_input_raises_before_compiling(pair):
  target, _ = pair
  other_vocab = sj.Model.init(
      sj.TransformerConfig(vocab_size=17, d_model=16, num_layers=1,
                           num_heads=2, d_ff=32, max_len=64),
      jax.random.key(0))
  compiled = sj.decoding.generate_jit._cache_size()
  with pytest.raises(ValueError, match="gamma=0"):
    bad_call(pair, gamma=0)
  with pytest.raises(ValueError, match="vocabulary"):
    bad_call(pair, drafter=sj.ModelDrafter(other_vocab))
  with pytest.raises(ValueError, match="max_len=64"):
    bad_call(pair, max_new_tokens=60)
  with pytest.raises(ValueError, match="empty prompt"):
    bad_call(pair, prompts=[[1, 2], []])
  with pytest.raises(ValueError, match="temperature"):
    bad_call(pair, sampling=sj.Sampling(temperature=-1))
  with pytest.raises(ValueError, match="top_p"):
    bad_call(pair, sampling=sj.Sampling(top_p=0))
  with pytest.raises(ValueError, match="top_k"):
    bad_call(pair, sampling=sj.Sampling(top_k=-2))
  assert sj.decoding.generate_jit._cache_size() == compiled


def test_token_id_outside_the_vocabulary_is_refused(pair):
  """A gather would clamp the id and decode silently; both loops refuse it
  before compiling, naming the id and its row."""
  target, _ = pair
  compiled = (sj.decoding.generate_jit._cache_size(),
              sj.decoding.generate_autoregressive_jit._cache_size())
  vocab = target.vocab_size
  for bad_id in (vocab, 99999, -3):
    with pytest.raises(ValueError, match=rf"row 1 holds token id {bad_id} "):
      bad_call(pair, prompts=[[1, 2], [3, bad_id, 4]])
  with pytest.raises(ValueError, match=rf"token id {vocab} .*\[0, {vocab}\)"):
    sj.generate_autoregressive(jax.random.key(0), target,
                               *sj.pad_prompts([[vocab]]),
                               sj.DecodeConfig(max_new_tokens=4))
  assert (sj.decoding.generate_jit._cache_size(),
          sj.decoding.generate_autoregressive_jit._cache_size()) == compiled
  # Padding past a row's length is not read as a prompt token.
  prompts, lengths = sj.pad_prompts([[1, 2], [3]])
  prompts[1, 1:] = vocab
  sj.decoding.check_inputs(target, prompts, lengths,
                           sj.DecodeConfig(max_new_tokens=4))
