"""Drafters beyond a small model: prompt lookup, layer skip, dynamic gamma.

Each must keep greedy SD equal to greedy AR token for token; their laws under
sampling are tested in test_resample.py (enumeration) and
test_law_monte_carlo.py (the whole loop).
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import drafting
from conftest import loop_cycles, tiny_pair
from test_tree_loop import assert_prefix_equal

# Row 0 repeats itself, so prompt lookup finds matches there.
PROMPTS = [[3, 9, 4, 7, 3, 9, 4, 7, 3, 9], [4, 5, 6, 7, 8], [13], [2, 7, 1, 8]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def pair4():
  """A 4-layer target (so layer skip has layers to skip) and its draft."""
  return tiny_pair(seed=3, num_layers=4)


def drafters(target, draft):
  return {
      "model": sj.ModelDrafter(draft),
      "dynamic": sj.ModelDrafter(draft, confidence_threshold=0.6),
      "ngram": sj.NgramDrafter(target.vocab_size, max_n=3, min_n=1),
      "layer_skip": sj.LayerSkipDrafter(target, num_layers=2),
      "layer_skip_dynamic": sj.LayerSkipDrafter(target, num_layers=1,
                                                confidence_threshold=0.6),
  }


@pytest.mark.parametrize("name", ["dynamic", "ngram", "layer_skip",
                                  "layer_skip_dynamic"])
def test_greedy_speculative_equals_greedy_target(pair4, name):
  target, draft = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = sj.DecodeConfig(gamma=4, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=0))
  key = jax.random.key(0)
  spec = sj.generate(key, target, drafters(target, draft)[name], padded,
                     lengths, config)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  stats = spec.stats.summary()
  assert 0 < stats["accepted"] < stats["drafted"]
  if name.endswith("dynamic") or name == "ngram":
    # Some rows proposed fewer than gamma drafts in some cycles.
    assert stats["drafted"] < 4 * stats["row_cycles"]


def test_prompt_lookup_takes_latest_longest_match():
  tokens = jnp.array([
      [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 0, 0],  # "1 2" last seen at 4 -> "4 8 1"
      [5, 6, 7, 5, 6, 7, 6, 7, 0, 0, 0, 0],  # "6 7": latest copy is at 4
      [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0],  # no earlier "5": nothing
      [7, 3, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # "7" at 0 -> "3 7", then unknown
  ], jnp.int32)
  lengths = jnp.array([10, 8, 5, 3])
  draft, proposed = sj.prompt_lookup(tokens, lengths, gamma=3, max_n=2,
                                     min_n=1)
  np.testing.assert_array_equal(draft[0], [4, 8, 1])
  np.testing.assert_array_equal(draft[1], [6, 7, 0])  # at 4: "6 7", then pos 8
  np.testing.assert_array_equal(proposed[1], [True, True, False])
  assert not proposed[2].any()
  np.testing.assert_array_equal(draft[3, :2], [3, 7])
  np.testing.assert_array_equal(proposed[3], [True, True, False])


def test_prompt_lookup_prefers_longer_ngrams():
  # "9 2" occurs at 0 (followed by 5); a bare "2" occurs later at 3 (then 6).
  tokens = jnp.array([[9, 2, 5, 2, 6, 1, 9, 2]], jnp.int32)
  draft, _ = sj.prompt_lookup(tokens, jnp.array([8]), 1, max_n=2, min_n=1)
  assert int(draft[0, 0]) == 5
  draft, _ = sj.prompt_lookup(tokens, jnp.array([8]), 1, max_n=1, min_n=1)
  assert int(draft[0, 0]) == 6


def test_layer_skip_keeps_no_second_cache(pair4):
  target, draft = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  layer_skip = sj.LayerSkipDrafter(target, num_layers=2)
  # The drafter's own state is empty: its keys and values live in the
  # target's cache, whose size does not change.
  assert jax.tree.leaves(layer_skip.prefill(padded, lengths, 64)) == []
  model_state = sj.ModelDrafter(target).prefill(padded, lengths, 64)
  assert sum(x.nbytes for x in jax.tree.leaves(model_state)) > 0
  # ...and the compiled loop carries no more memory than with prompt lookup,
  # which has no draft model at all, while a separate 2-layer copy does.
  # One verify width for all three, so that the loops differ only in their
  # drafters (prompt lookup's narrower passes have buffers of their own).
  config = sj.DecodeConfig(gamma=3, max_new_tokens=8, verify_buckets=1)

  def loop_bytes(drafter):
    compiled = sj.decoding.generate_jit.lower(
        jax.random.key(0), target, drafter, jnp.asarray(padded),
        jnp.asarray(lengths), config, len(padded)).compile()
    # The loop carry (caches included) is temporary memory; arguments are
    # not counted, since the layer-skip drafter passes the target's params a
    # second time, as the same buffers.
    return compiled.memory_analysis().temp_size_in_bytes

  # Keys and values of one layer: 2 x [B, H, S, Dh] float32, with
  # S = prompt width + max_new_tokens + gamma + 1.
  cache_layer_bytes = 2 * len(PROMPTS) * 4 * (padded.shape[1] + 12) * 8 * 4
  ngram_bytes = loop_bytes(sj.NgramDrafter(target.vocab_size))
  assert loop_bytes(layer_skip) < ngram_bytes + cache_layer_bytes
  first_two = target.replace(
      config=sj.TransformerConfig(**{**vars(target.config), "num_layers": 2}))
  assert loop_bytes(sj.ModelDrafter(first_two)) > (
      ngram_bytes + 2 * cache_layer_bytes)


def test_dynamic_gamma_exits_the_draft_loop_early(pair4):
  """With a threshold no draft reaches, every row drafts one token per cycle
  and the loop runs no further draft steps."""
  target, draft = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = sj.DecodeConfig(gamma=6, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=1))
  spec = sj.generate(jax.random.key(1), target,
                     sj.ModelDrafter(draft, confidence_threshold=1.01),
                     padded, lengths, config)
  stats = spec.stats.summary()
  assert stats["drafted"] == stats["row_cycles"]
  assert stats["accepted_per_position"][1:] == [0] * 5
  # Only draft 1 was ever proposed, so nothing after it was tried.
  tried = np.asarray(spec.stats.tried_per_position)
  np.testing.assert_array_equal(tried[:, 0], spec.stats.row_cycles)
  assert (tried[:, 1:] == 0).all()
  # The draft model ran once per cycle, so the while_loop exited at once:
  # count its calls through a traced counter in a host callback.
  calls = []
  counted = sj.ModelDrafter(draft, confidence_threshold=1.01)
  original = sj.Model.__call__

  def counting_call(self, *args, **kwargs):
    jax.debug.callback(lambda: calls.append(1))
    return original(self, *args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sj.Model, "__call__", counting_call)
    sj.drafting.propose(counted.model, counted.prefill(padded, lengths, 64),
                        jnp.asarray(padded), jnp.asarray(lengths),
                        jax.random.key(0), 6, sj.Sampling(temperature=1),
                        confidence_threshold=1.01)
  assert len(calls) == 2  # the context step and one draft step


def test_bad_drafter_settings_are_refused(pair4):
  target, _ = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  config = sj.DecodeConfig(gamma=2, max_new_tokens=4)
  with pytest.raises(ValueError, match="num_layers=4"):
    sj.generate(jax.random.key(0), target,
                sj.LayerSkipDrafter(target, num_layers=4), padded, lengths,
                config)
  with pytest.raises(ValueError, match="min_n"):
    sj.NgramDrafter(target.vocab_size, max_n=1, min_n=2)


def test_verify_widths_spread_from_one_to_gamma_plus_one():
  widths = sj.verification.verify_widths
  assert widths(4, 1) == (5,)
  assert widths(4, 2) == (1, 5)
  assert widths(4, 3) == (1, 3, 5)
  assert widths(4, 5) == (1, 2, 3, 4, 5)
  assert widths(10, 6) == (1, 3, 5, 7, 9, 11)
  assert widths(8, 6) == (1, 2, 4, 5, 7, 9)
  assert widths(1, 3) == widths(4, 8)[:2] == (1, 2)
  assert widths(4, 8) == (1, 2, 3, 4, 5)
  with pytest.raises(ValueError, match="at least 1 verify width"):
    sj.DecodeConfig(gamma=4, verify_buckets=0)


@pytest.mark.parametrize("buckets", [1, 2, 3, 5])
def test_verify_only_what_was_proposed(pair4, buckets):
  """A cycle in which no row proposed anything runs a one-token target step
  (width index 0 with 2 or more buckets), and the tokens do not change."""
  target, _ = pair4
  # No prompt repeats a token, so prompt lookup has no match at first.
  padded, lengths = sj.pad_prompts([[1, 2, 3, 4], [5, 6, 7], [8, 9]])
  config = sj.DecodeConfig(gamma=4, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=0.0),
                           verify_buckets=buckets)
  ar = sj.generate_autoregressive(jax.random.key(0), target, padded, lengths,
                                  config)
  sd = sj.generate(jax.random.key(0), target, sj.NgramDrafter(16), padded,
                   lengths, config)
  np.testing.assert_array_equal(sd.tokens, ar.tokens)
  stats = sd.stats.summary()
  widths = sj.verification.verify_widths(4, buckets)
  assert len(stats["width_cycles"]) == len(widths)
  assert sum(stats["width_cycles"]) == stats["cycles"]
  if buckets > 1:
    assert stats["width_cycles"][0] > 0  # some cycles were target steps


@pytest.mark.parametrize("name", [
    "model", "layer_skip", pytest.param("dynamic", marks=pytest.mark.slow),
    pytest.param("ngram", marks=pytest.mark.slow)])
def test_loop_caches_equal_a_prefill_after_every_cycle(pair4, name):
  """Through the loop's own step, at T = 1, with rows that accept different
  numbers of drafts (all of them included): after every cycle the target's
  cache equals a prefill of each row's sequence at every slot but the last
  token's, and a draft model's own cache at every slot but the last two (the
  last draft of a fully accepted cycle is fed in the next one)."""
  target, draft = pair4
  drafter = drafters(target, draft)[name]
  config = sj.DecodeConfig(gamma=3, max_new_tokens=MAX_NEW,
                           sampling=sj.Sampling(temperature=1.0))
  advances = set()
  # Prompt lookup's one-hot drafts are accepted with probability p(d), so it
  # needs more cycles to accept some.
  num_cycles = 12 if name == "ngram" else 4
  for state, advance in loop_cycles(target, drafter, PROMPTS, config,
                                    num_cycles=num_cycles):
    advances |= set(advance.tolist())
    width = state.tokens.shape[1]
    assert_prefix_equal(state.target_cache,
                        target.prefill(state.tokens, state.lengths, width),
                        state.lengths - 1)
    np.testing.assert_array_equal(state.target_cache.lengths,
                                  state.lengths - 1)
    if isinstance(drafter, sj.ModelDrafter):
      assert_prefix_equal(state.draft_state,
                          draft.prefill(state.tokens, state.lengths, width),
                          state.lengths - 2)
  assert len(advances) > 1, advances  # rows advanced by different amounts


def test_draft_limit_stops_the_draft_loop_at_a_traced_length(pair4):
  """`drafting.propose(max_drafts=k)`, k traced: the first k drafts are
  those of a full cycle with the same key, the rest propose nothing, and
  the draft model runs k - 1 feed-back steps (one call to prefill the
  context's last tokens aside)."""
  _, draft = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  gamma, sampling = 4, sj.Sampling(temperature=1)
  cache = draft.prefill(jnp.asarray(padded), jnp.asarray(lengths), 32)
  key = jax.random.key(5)
  calls = []

  def counted(*args, **kwargs):
    jax.debug.callback(lambda: calls.append(1))
    return draft(*args, **kwargs)

  @jax.jit
  def drafts(max_drafts):
    tokens, probs, _ = drafting.propose(
        counted, cache, jnp.asarray(padded), jnp.asarray(lengths), key, gamma,
        sampling, max_drafts=max_drafts)
    return tokens, probs

  full_tokens, full_probs = drafts(jnp.int32(gamma))
  for limit in range(gamma + 1):
    calls.clear()
    tokens, probs = jax.block_until_ready(drafts(jnp.int32(limit)))
    proposed = np.asarray(probs.sum(-1) > 0)  # [B, G]
    assert (proposed == (np.arange(gamma) < limit)).all(), limit
    np.testing.assert_array_equal(tokens[:, :limit], full_tokens[:, :limit])
    np.testing.assert_allclose(probs[:, :limit], full_probs[:, :limit])
    assert len(calls) == 1 + max(limit - 1, 0), (limit, len(calls))


@pytest.mark.parametrize("catch_up, whole", [
    (sj.drafters.CATCH_UP_WIDTH, True),
    # The negative control: without catching up, the rows left behind draft
    # from a cache with holes, and the same comparison fails.
    (0, False)])
def test_propose_catches_up_on_plain_steps(pair4, catch_up, whole):
  """A draft cache left at each prompt, its last slot junk as a fully
  accepted cycle leaves it, while the rows went on by 0, 3, 11 and 5
  tokens (plain target steps without the drafter; 11 takes two catch-up
  passes): `propose` drafts what it drafts from a prefill of the whole
  sequence, and leaves the cache that prefill would."""
  _, draft = pair4
  rng = np.random.default_rng(0)
  behind = [0, 3, 11, 5]
  sequences = [p + rng.integers(0, 16, n).tolist()
               for p, n in zip(PROMPTS, behind)]
  prompts, prompt_lengths = map(jnp.asarray, sj.pad_prompts(PROMPTS, 32))
  tokens, lengths = map(jnp.asarray, sj.pad_prompts(sequences, 32))
  stale = draft.prefill(prompts, prompt_lengths, 48)
  # After a cycle that accepted every draft, the slot before the pointer
  # holds junk (the last draft was never fed): the catch-up starts there.
  junk = lambda c: c.at[jnp.arange(len(PROMPTS)), :,
                        stale.lengths - 1].set(7.0)
  stale = stale.replace(keys=tuple(map(junk, stale.keys)),
                        values=tuple(map(junk, stale.values)))
  fresh = draft.prefill(tokens, lengths, 48)
  gamma, sampling, key = 3, sj.Sampling(temperature=1), jax.random.key(2)
  propose = lambda cache, width: drafting.propose(
      draft, cache, tokens, lengths, key, gamma, sampling, catch_up=width)
  want_tokens, want_probs, want_cache = propose(fresh, 0)
  got_tokens, got_probs, got_cache = propose(stale, catch_up)
  caught_up = (np.array_equal(got_tokens, want_tokens)
               and np.allclose(got_probs, want_probs, atol=1e-5))
  assert caught_up == whole
  if whole:
    # Drafts 1..gamma-1 were fed after the sequence.
    assert_prefix_equal(got_cache, want_cache, lengths + gamma - 1)


@flax.struct.dataclass
class _CountedDrafter(sj.ModelDrafter):
  """A draft model that counts the cycles it drafts in."""

  def propose(self, *args, **kwargs):
    jax.debug.callback(lambda: _PROPOSALS.append(1))
    return super().propose(*args, **kwargs)


_PROPOSALS = []


def test_cycles_of_no_drafts_run_without_the_drafter(pair4):
  """Under the adaptive draft length with costs that never let a draft
  pay, the loop runs plain target steps and calls the drafter in the first
  cycle and every explore_every-th only, and greedy output equals AR's
  (what the drafter drafts after catching up is the test above's)."""
  target, draft = pair4
  padded, lengths = sj.pad_prompts(PROMPTS)
  explore_every = 5
  config = sj.DecodeConfig(
      gamma=3, max_new_tokens=MAX_NEW, sampling=sj.Sampling(temperature=0),
      verify_buckets=3,
      # A budget that lets exploring lose all it does, every 5th cycle,
      # and no warm-up, so that the explore cycles are the only drafts.
      adaptive=sj.AdaptiveDraftLength(explore_every=explore_every,
                                      explore_budget=100.0, warmup_tries=0))
  _PROPOSALS.clear()
  spec = sj.generate(jax.random.key(0), target, _CountedDrafter(draft),
                     padded, lengths, config,
                     costs=sj.CycleCosts.of(1.0, [1.0, 50.0, 50.0]))
  plain = sj.generate_autoregressive(jax.random.key(0), target, padded,
                                     lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  limits = np.asarray(spec.stats.limit_cycles)
  # The first cycle, then every explore cycle (gamma drafts).
  assert limits[3] == int(spec.stats.cycles) // explore_every > 1, limits
  assert len(_PROPOSALS) == 1 + limits[3], (len(_PROPOSALS), limits)
