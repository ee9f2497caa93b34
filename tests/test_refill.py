"""A queue of prompts through fewer rows, refilled inside the loop: each
prompt gets the tokens a decode of it alone gives, in prompt order."""

import jax
import numpy as np
import pytest

import spec_jax as sj

MAX_NEW = 12


def queue(num_prompts, seed=0):
  """Prompts of mixed lengths (1 to 11 tokens) over the tiny vocabulary."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 16, rng.integers(1, 12)).tolist()
          for _ in range(num_prompts)]


@pytest.fixture(scope="module")
def prompts():
  return queue(48)


@pytest.fixture(scope="module")
def alone(pair, prompts):
  """Each prompt's greedy AR tokens, decoded one prompt at a time, and an
  EOS id that stops some of them mid-way."""
  target, _ = pair
  config = sj.DecodeConfig(max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=0))
  rows = []
  for prompt in prompts:
    padded, lengths = sj.pad_prompts([prompt])
    result = sj.generate_autoregressive(jax.random.key(0), target, padded,
                                        lengths, config)
    rows.append(np.asarray(result.tokens[0]).tolist())
  # As EOS, the token that stops about half the rows mid-way.
  stops = lambda t: np.mean([t in row[2:-2] and t not in row[:2]
                             for row in rows])
  never = lambda t: np.mean([t not in row for row in rows])
  eos_id = min(range(16), key=lambda t: abs(stops(t) - 0.5) + (never(t) == 0))
  stopped = []
  for row in rows:
    end = row.index(eos_id) + 1 if eos_id in row else MAX_NEW
    stopped.append(row[:end] + [sj.decoding.PAD_ID] * (MAX_NEW - end))
  return np.array(stopped), eos_id


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_greedy_refilled_decodes_equal_each_prompt_alone(pair, prompts, alone,
                                                         slots):
  target, draft = pair
  expected, eos_id = alone
  chosen = prompts[:3 * slots]
  expected = expected[:3 * slots]
  num_tokens = (expected != sj.decoding.PAD_ID).sum(1)
  # EOS mid-way in some rows, so rows finish at different cycles.
  assert (num_tokens < MAX_NEW).any() and len(set(num_tokens.tolist())) > 1
  padded, lengths = sj.pad_prompts(chosen)
  config = sj.DecodeConfig(gamma=3, max_new_tokens=MAX_NEW, eos_id=eos_id,
                           sampling=sj.Sampling(temperature=0))
  key = jax.random.key(1)
  spec = sj.generate(key, target, sj.ModelDrafter(draft), padded, lengths,
                     config, slots=slots)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config,
                                     slots=slots)
  for result in (spec, plain):
    np.testing.assert_array_equal(result.tokens, expected)
    np.testing.assert_array_equal(result.num_tokens, num_tokens)
  # Statistics come back per prompt, each prompt's own: greedy, with one
  # verify width, a row's cycles do not depend on its neighbours, so every
  # row counter equals that of the prompts decoded all at once.
  batch = sj.generate(key, target, sj.ModelDrafter(draft), padded, lengths,
                      config)
  for name in sj.stats.ROW_FIELDS:
    np.testing.assert_array_equal(getattr(spec.stats, name),
                                  getattr(batch.stats, name), err_msg=name)
  # The loop runs the queue's schedule and no cycle more: a freed row takes
  # the next prompt at the next cycle, so no row waits for another's
  # prompt, only for the queue's end.
  assert int(spec.stats.cycles) == sj.refill.loop_iterations(
      spec.stats.row_cycles.tolist(), slots)


def test_loop_iterations_schedule_the_queue_in_prompt_order():
  # Two rows: prompts of 3 and 5 iterations start; the 3's row takes the 4
  # (iterations 4-7), the 5's row the 1 (iteration 6); the loop ends after 7.
  assert sj.refill.loop_iterations([3, 5, 4, 1], 2) == 7
  assert sj.refill.loop_iterations([3, 5], 2) == 5
  assert sj.refill.loop_iterations([3, 5], 4) == 5
  assert sj.refill.loop_iterations([2, 2, 2], 1) == 6


def test_refill_same_seed_same_tokens_and_rows_match_a_batch_decode(
    pair, prompts):
  """At T=1 the same seed gives the same tokens; with slots >= P the decode
  is the plain batch decode, and one compiled program serves both calls."""
  target, draft = pair
  padded, lengths = sj.pad_prompts(prompts[:10])
  config = sj.DecodeConfig(gamma=2, max_new_tokens=MAX_NEW)
  drafter = sj.ModelDrafter(draft)
  runs = [sj.generate(jax.random.key(3), target, drafter, padded, lengths,
                      config, slots=4) for _ in range(2)]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  whole = sj.generate(jax.random.key(3), target, drafter, padded, lengths,
                      config, slots=10)
  again = sj.generate(jax.random.key(3), target, drafter, padded, lengths,
                      config)
  np.testing.assert_array_equal(whole.tokens, again.tokens)


def test_bad_slots_are_refused_before_compiling(pair, prompts):
  target, draft = pair
  padded, lengths = sj.pad_prompts(prompts[:4])
  config = sj.DecodeConfig(gamma=2, max_new_tokens=MAX_NEW)
  with pytest.raises(ValueError, match="slots=0"):
    sj.generate(jax.random.key(0), target, sj.ModelDrafter(draft), padded,
                lengths, config, slots=0)
  # A queued prompt too long for the cache is refused like a batch's.
  long = sj.pad_prompts(prompts[:3] + [[1] * 60])
  with pytest.raises(ValueError, match="max_len"):
    sj.generate_autoregressive(jax.random.key(0), target, *long, config,
                               slots=2)
