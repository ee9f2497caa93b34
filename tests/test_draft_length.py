"""The adaptive draft length in the loop: greedy output unchanged for every
chain drafter while the policy changes the draft length during the run, the
policy's choice as the cost model says, and clear errors."""

import jax
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import decoding, draft_length, eagle
from conftest import tiny_pair

MAX_NEW = 16
GAMMA = 4
# Widths 1, 3 and 5 at gamma 4 (verify_buckets=3). A draft pass costs a
# tenth of a step and verifies cost more with width, so that rows that
# accept often draft 4 and rows that are rejected draft less.
COSTS = sj.CycleCosts.of(0.1, [1.0, 1.3, 1.6])


@pytest.fixture(scope="module")
def target_and_draft():
  return tiny_pair(seed=3, num_layers=3, draft_noise=0.5)


def drafters(target, draft):
  config = eagle.EagleConfig.for_target(target.config)
  return {
      "model": sj.ModelDrafter(draft),
      "ngram": sj.NgramDrafter(target.vocab_size),
      "layer_skip": sj.LayerSkipDrafter(target, num_layers=1),
      "eagle3": eagle.EagleDrafter(
          target, eagle.init_params(config, jax.random.key(1), target),
          config),
  }


def prompts(num_prompts, seed=0):
  rng = np.random.default_rng(seed)
  return sj.pad_prompts([rng.integers(0, 16, rng.integers(2, 10)).tolist()
                         for _ in range(num_prompts)])


@pytest.mark.parametrize("name", [
    "model", "ngram",
    # The same limit through the other two draft loops; slow, as the
    # default suite's time is over its target.
    pytest.param("layer_skip", marks=pytest.mark.slow),
    pytest.param("eagle3", marks=pytest.mark.slow)])
def test_greedy_adaptive_equals_greedy_target(target_and_draft, name):
  """With refill (12 prompts through 4 rows), and the draft length varying:
  the loop drafted at least two different lengths (every 8th cycle
  explores gamma, whatever it loses, and the others draft what the counts
  choose)."""
  target, draft = target_and_draft
  padded, lengths = prompts(12)
  greedy = sj.Sampling(temperature=0)
  config = sj.DecodeConfig(gamma=GAMMA, max_new_tokens=MAX_NEW,
                           sampling=greedy, verify_buckets=3,
                           adaptive=sj.AdaptiveDraftLength(
                               explore_every=8, explore_budget=1.0))
  key = jax.random.key(0)
  spec = sj.generate(key, target, drafters(target, draft)[name], padded,
                     lengths, config, slots=4, costs=COSTS)
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  limits = np.asarray(spec.stats.limit_cycles)
  assert limits.sum() == int(spec.stats.cycles)
  assert (limits > 0).sum() >= 2, limits


@pytest.mark.parametrize("name", [
    "model", "ngram", pytest.param("layer_skip", marks=pytest.mark.slow),
    pytest.param("eagle3", marks=pytest.mark.slow)])
def test_no_drafts_where_drafting_cannot_pay(target_and_draft, name):
  """Costs under which every draft costs 100 steps: after the warm-up (one
  draft a cycle until draft 1 has been tried 8 times: 3 cycles of the first
  3 prompts, or more for prompt lookup, which drafts only where it finds a
  match), the policy drafts nothing, so every cycle is a plain target step
  (width 1), and the limit reaches the drafter (nothing is drafted), with
  the output unchanged."""
  target, draft = target_and_draft
  padded, lengths = prompts(6)
  config = sj.DecodeConfig(
      gamma=GAMMA, max_new_tokens=MAX_NEW, sampling=sj.Sampling(temperature=0),
      verify_buckets=3, adaptive=sj.AdaptiveDraftLength(explore_every=10**6))
  key = jax.random.key(0)
  spec = sj.generate(key, target, drafters(target, draft)[name], padded,
                     lengths, config, slots=3,
                     costs=sj.CycleCosts.of(100.0, [1.0, 200.0, 300.0]))
  plain = sj.generate_autoregressive(key, target, padded, lengths, config)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  stats = spec.stats
  warmup = int(np.asarray(stats.limit_cycles)[1])
  plain_cycles = int(stats.cycles) - warmup
  assert np.asarray(stats.limit_cycles).tolist() == [plain_cycles, warmup, 0,
                                                     0, 0]
  assert int(np.asarray(stats.width_cycles)[0]) >= plain_cycles
  if name == "ngram":
    assert warmup >= 3
  else:
    assert warmup == 3
    assert np.asarray(stats.drafted).tolist() == [3] * 3 + [0] * 3


def _trace_again(monkeypatch):
  """`generate` through a jit of a function of its own, so that the program
  is traced again (jit's cache is keyed by the function) with what the test
  patched in `decoding`."""
  def decode(key, target, drafter, prompts, prompt_lengths, config, slots,
             costs):
    return decoding._decode(key, target, drafter, prompts, prompt_lengths,
                            config, slots, costs)
  monkeypatch.setattr(decoding, "generate_jit", jax.jit(
      decode, static_argnames=("config", "slots")))


def test_plain_steps_choose_again_only_when_their_inputs_change(
    target_and_draft, monkeypatch):
  """The loop of plain steps chooses K again only where a row finishes or
  an explore cycle falls due (`decoding._plain_steps`). Against a loop that
  chooses after every plain step (the policy's definition), at T = 1 with
  refill (12 prompts through 3 rows) and EOS mid-way: the same tokens, token
  counts and counters, bit for bit, in a run that drafted nothing in most
  cycles, explored every 8th and finished rows between them."""
  target, draft = target_and_draft
  padded, lengths = prompts(12)
  config = sj.DecodeConfig(
      gamma=GAMMA, max_new_tokens=MAX_NEW, eos_id=3, verify_buckets=3,
      adaptive=sj.AdaptiveDraftLength(explore_every=8, explore_budget=1.0,
                                      warmup_tries=2))
  # K* = 0 (a cycle of K >= 1 costs 3-5 steps), and an explore cycle loses
  # under 4 steps, within the budget at every 8th cycle.
  costs = sj.CycleCosts.of(0.5, [1.0, 2.5, 3.0])
  run = lambda: sj.generate(jax.random.key(7), target, sj.ModelDrafter(draft),
                            padded, lengths, config, slots=3, costs=costs)
  batched = run()
  monkeypatch.setattr(decoding, "_plain_steps", decoding._plain_step)
  _trace_again(monkeypatch)
  each_step = run()
  np.testing.assert_array_equal(batched.tokens, each_step.tokens)
  np.testing.assert_array_equal(batched.num_tokens, each_step.num_tokens)
  jax.tree.map(np.testing.assert_array_equal, batched.stats, each_step.stats)
  limits = np.asarray(batched.stats.limit_cycles)
  assert limits[0] > limits[GAMMA] > 0 and limits[0] > limits.sum() / 2, limits
  num_tokens = np.asarray(batched.num_tokens)
  assert (num_tokens < MAX_NEW).any() and (num_tokens == MAX_NEW).any()


@pytest.mark.parametrize("empties_refilled_rows", [
    True,
    # The negative control: a refilled row left with the previous prompt's
    # draft cache drafts from it, and the same comparison fails. In the
    # default suite, as it is what shows that the decode refilled rows
    # during plain steps and drafted for them afterwards.
    False])
def test_rows_refilled_during_plain_steps_draft_as_if_prefilled(
    target_and_draft, monkeypatch, empties_refilled_rows):
  """A row refilled while the loop runs plain steps gets an empty draft
  cache, which the next cycle that drafts catches up with the rest
  (`decoding._next_prompts`). Against a loop that prefills the draft model
  at every refill: at T = 1 with refill (12 prompts through 3 rows), K* = 0
  and an explore cycle every 8th, the same tokens and counters (the
  overlaps to float rounding: the catch-up passes and a prefill sum in
  different orders)."""
  target, draft = target_and_draft
  padded, lengths = prompts(12)
  config = sj.DecodeConfig(
      gamma=GAMMA, max_new_tokens=MAX_NEW, verify_buckets=3,
      adaptive=sj.AdaptiveDraftLength(explore_every=8, explore_budget=1.0,
                                      warmup_tries=2))
  costs = sj.CycleCosts.of(0.5, [1.0, 2.5, 3.0])  # K* = 0, as above

  def run():
    _trace_again(monkeypatch)
    return sj.generate(jax.random.key(7), target, sj.ModelDrafter(draft),
                       padded, lengths, config, slots=3, costs=costs)

  if not empties_refilled_rows:
    monkeypatch.setattr(decoding, "_emptied", lambda state, row: state)
  emptied = run()
  next_prompts = decoding._next_prompts
  monkeypatch.setattr(
      decoding, "_next_prompts",
      lambda state, target, drafter, config, plain=False: next_prompts(
          state, target, drafter, config))
  prefilled = run()
  limits = np.asarray(prefilled.stats.limit_cycles)
  assert limits[0] > limits[GAMMA] > 0 and limits[0] > limits.sum() / 2, limits
  same = (np.array_equal(emptied.tokens, prefilled.tokens)
          and all(jax.tree.leaves(jax.tree.map(
              lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6),
              emptied.stats, prefilled.stats))))
  assert same == empties_refilled_rows


def _goodput_by_hand(accepted, tried, decoded_accepted, decoded_tried,
                     active, prior_rate, prior_weight, cost):
  """sum_b active_b E_b(K) / C(K) for K = 0..2, from the module docstring's
  equations written out for two positions."""
  pooled = lambda a, d: a.sum(0) + d.sum(0)
  pooled_accepted = pooled(accepted, decoded_accepted)
  pooled_tried = pooled(tried, decoded_tried)
  rate = ((pooled_accepted.sum() + prior_weight * prior_rate)
          / (pooled_tried.sum() + prior_weight))
  m_1 = ((pooled_accepted[0] + prior_weight * rate)
         / (pooled_tried[0] + prior_weight))
  m_2 = ((pooled_accepted[1] + prior_weight * m_1)
         / (pooled_tried[1] + prior_weight))
  r = (accepted + prior_weight * np.array([m_1, m_2])) / (tried + prior_weight)
  emitted = np.stack([np.ones(len(r)), 1 + r[:, 0], 1 + r[:, 0] + r.prod(1)],
                     1)
  return (emitted * active[:, None]).sum(0) / cost


def test_policy_drafts_the_cost_models_optimum():
  """draft_length.choose against the goodput of each K computed by hand:
  one row always accepted (counts 10/10), one never (0/10); then a fresh
  row, which drafts by the prompts already decoded."""
  accepted, tried = np.array([[10, 10], [0, 0]]), np.array([[10, 10], [10, 0]])
  stats = sj.DecodeStats.zeros(2, 2, 3).replace(
      accepted_per_position=accepted, tried_per_position=tried)
  policy = sj.AdaptiveDraftLength(prior_rate=0.5, prior_weight=2,
                                  warmup_tries=0)
  widths = (1, 2, 3)
  costs = sj.CycleCosts.of(0.1, [1.0, 1.5, 2.0])
  cost = np.array([0.1 + 1.0, 0.1 + 1.5, 0.2 + 2.0])
  none = np.zeros((1, 2))
  for active, want in ([True, True], 1), ([True, False], 2):
    # Only the row that is always accepted active: drafting 2 pays.
    active = np.array(active)
    goodput = _goodput_by_hand(accepted, tried, none, none, active, 0.5, 2,
                               cost)
    assert int(draft_length.choose(policy, stats, None, active, costs,
                                   widths, 2)) == np.argmax(goodput) == want
  # The loop's overhead (a step per cycle that drafts) against a plain step
  # that costs 1: drafting no longer pays for that row either.
  overhead = sj.CycleCosts.of(0.1, [1.0, 1.5, 2.0], overhead=1.0)
  cost_with_overhead = draft_length.cycle_cost(overhead, widths, 2,
                                               plain_step=True)
  np.testing.assert_allclose(cost_with_overhead, [1.0, 2.6, 3.2], rtol=1e-6)
  goodput = _goodput_by_hand(accepted, tried, none, none, active, 0.5, 2,
                             np.asarray(cost_with_overhead))
  assert int(draft_length.choose(policy, stats, None, active, overhead,
                                 widths, 2, plain_step=True)) == np.argmax(
                                     goodput) == 0
  # A fresh row: by the prior alone it drafts 1; after prompts whose every
  # draft was accepted (40 of 40), 2.
  fresh = sj.DecodeStats.zeros(1, 2, 3)
  zero, one = np.zeros((1, 2)), np.ones(1, bool)
  assert int(draft_length.choose(policy, fresh, None, one, costs, widths,
                                 2)) == 1
  decoded = sj.DecodeStats.zeros(4, 2, 3).replace(
      accepted_per_position=np.full((4, 2), 10),
      tried_per_position=np.full((4, 2), 10))
  goodput = _goodput_by_hand(zero, zero, decoded.accepted_per_position,
                             decoded.tried_per_position, one, 0.5, 2, cost)
  assert int(draft_length.choose(policy, fresh, decoded, one, costs, widths,
                                 2)) == np.argmax(goodput) == 2
  # Prompts that tried only the first draft (36 of 40 accepted): the second
  # is priced at the first's pooled rate (0.90), not at the prior (0.5),
  # and 2 drafts pay.
  decoded = decoded.replace(
      accepted_per_position=np.array([[9, 0]] * 4),
      tried_per_position=np.array([[10, 0]] * 4))
  goodput = _goodput_by_hand(zero, zero, decoded.accepted_per_position,
                             decoded.tried_per_position, one, 0.5, 2, cost)
  assert int(draft_length.choose(policy, fresh, decoded, one, costs, widths,
                                 2)) == np.argmax(goodput) == 2


def test_untried_drafts_are_priced_at_the_draft_before_them():
  """Acceptance that rises with the position, as a draft model's in an easy
  stretch: the decoded prompts accepted draft 1 in 50 of 100 cycles and
  draft 2 in 50 of 50, and never tried draft 3. Priced at draft 2's pooled
  rate (0.98), draft 3 pays at a verify of 4 tokens costing 1.2 steps;
  priced at the rate over all drafts (0.66), as an estimate that shrinks
  every draft's pooled rate toward m would price it, it would not."""
  policy = sj.AdaptiveDraftLength(prior_rate=0.5, prior_weight=2,
                                  warmup_tries=0)
  decoded = sj.DecodeStats.zeros(1, 3, 4).replace(
      accepted_per_position=np.array([[50, 50, 0]]),
      tried_per_position=np.array([[100, 50, 0]]))
  costs = sj.CycleCosts.of(0.0, [1.0, 1.0, 1.0, 1.2])
  cost = np.array([1.0, 1.0, 1.0, 1.2])
  fresh, one = sj.DecodeStats.zeros(1, 3, 4), np.ones(1, bool)
  assert int(draft_length.choose(policy, fresh, decoded, one, costs,
                                 (1, 2, 3, 4), 3)) == 3
  goodput = lambda m: np.concatenate([[1], 1 + np.cumsum(np.cumprod(m))]) / cost
  rate = (100 + 2 * 0.5) / (150 + 2)
  m_1 = (50 + 2 * rate) / (100 + 2)
  m_2 = (50 + 2 * m_1) / (50 + 2)
  assert np.argmax(goodput([m_1, m_2, m_2])) == 3
  unchained = [(50 + 2 * rate) / (100 + 2), (50 + 2 * rate) / (50 + 2), rate]
  assert np.argmax(goodput(unchained)) == 2


def test_warmup_drafts_until_the_first_draft_is_tried_enough():
  """A prior under which no draft pays (r0 = 0.05): a fresh decode drafts
  one token until its rows and decoded prompts have tried draft 1
  warmup_tries times, then what the counts choose. Under a prior whose K* is
  1 of gamma = 2 (r0 = 0.7: C = 1, 1.6, 2.2 and E = 1, 1.7, 2.19), the
  warm-up drafts K*, not gamma."""
  costs, widths = sj.CycleCosts.of(0.1, [1.0, 1.5, 2.0]), (1, 2, 3)
  one = np.ones(1, bool)
  choose = lambda policy, stats, decoded: int(draft_length.choose(
      policy, stats, decoded, one, costs, widths, 2, plain_step=True))
  tried = lambda n, k: sj.DecodeStats.zeros(n, 2, 3).replace(
      accepted_per_position=np.zeros((n, 2), int),
      tried_per_position=np.full((n, 2), k))
  fresh = sj.DecodeStats.zeros(1, 2, 3)
  pessimist = sj.AdaptiveDraftLength(prior_rate=0.05, warmup_tries=8)
  assert choose(pessimist, fresh, None) == 1
  assert choose(pessimist, tried(1, 7), None) == 1
  assert choose(pessimist, tried(1, 3), tried(4, 1)) == 1  # 7 tries in all
  # 8 tries, none accepted: K = 0 from here.
  assert choose(pessimist, tried(1, 8), None) == 0
  assert choose(pessimist, tried(1, 4), tried(2, 2)) == 0
  assert choose(pessimist, fresh, tried(1, 8)) == 0
  assert choose(sj.AdaptiveDraftLength(prior_rate=0.7, warmup_tries=8),
                fresh, None) == 1


@pytest.mark.parametrize("warmup_tries, drafts", [(8, True), (0, False)])
def test_the_loop_escapes_a_pessimistic_prior(target_and_draft, warmup_tries,
                                              drafts):
  """A prior of 0.05 prices drafting below a plain step, at costs where the
  drafter's acceptance makes drafting pay (the target drafting for itself
  is always accepted): with the warm-up the loop finds that out and drafts
  in most cycles; without it (the negative control) it never tries a
  draft, so it never learns."""
  target, _ = target_and_draft
  padded, lengths = prompts(8)
  config = sj.DecodeConfig(
      gamma=GAMMA, max_new_tokens=MAX_NEW, sampling=sj.Sampling(temperature=0),
      verify_buckets=3, adaptive=sj.AdaptiveDraftLength(
          prior_rate=0.05, explore_every=10**6, warmup_tries=warmup_tries))
  spec = sj.generate(jax.random.key(0), target, sj.ModelDrafter(target),
                     padded, lengths, config, slots=2,
                     costs=sj.CycleCosts.of(0.05, [1.0, 1.05, 1.1]))
  limits = np.asarray(spec.stats.limit_cycles)
  if drafts:
    assert limits[1:].sum() > 0.9 * limits.sum(), limits
  else:
    assert limits[1:].sum() == 0, limits


@pytest.mark.parametrize("verify, best, catch_up, doublings", [
    # A verify of 5 costs 8 steps: no draft pays (K* = 0), and an explore
    # cycle loses C(4) - E(4) = 8.4 - 1.9375 = 6.46 steps, 20 times a 1%
    # budget of 32 cycles: 2^5 x 32 = 1024 cycles between explore cycles.
    ([1.0, 4.0, 8.0], 0, 0.0, 5),
    # A draft model's catch-up of 0.005 steps per plain step takes half the
    # budget at any interval: the explore cycles get the other half, every
    # 2048th cycle.
    ([1.0, 4.0, 8.0], 0, 0.005, 6),
    # A catch-up of 0.01 takes it all: no explore cycle after the warm-up.
    ([1.0, 4.0, 8.0], 0, 0.01, 30),
    # Cheaper verifies: K* = 2 (C = 1.3, E = 1.75); an explore cycle
    # (C = 2.2, E = 1.9375) loses 2.2 (1 - 0.881 / 1.346) / 1.3 = 0.59
    # cycles of K*, 1.8 times the budget: every 64th cycle. A row drafting
    # in every cycle never falls behind: the catch-up does not count.
    ([1.0, 1.2, 2.0], 2, 0.0, 1),
    ([1.0, 1.2, 2.0], 2, 0.01, 1)])
def test_explore_cycles_thin_out_where_exploring_loses(verify, best,
                                                       catch_up, doublings):
  """Two rows that accept half their drafts at every position, gamma 4,
  widths 1, 3 and 5, draft passes of 0.1 and 0.05 steps, a plain step for
  K = 0: the explore interval is explore_every (32) times the least power
  of two that keeps the cost model's loss within 1% of the time, the
  catch-up after plain steps included."""
  stats = sj.DecodeStats.zeros(2, 4, 3).replace(
      accepted_per_position=np.full((2, 4), 50),
      tried_per_position=np.full((2, 4), 100))
  policy = sj.AdaptiveDraftLength(prior_rate=0.5)
  costs = sj.CycleCosts.of(0.1 if best == 0 else 0.05, verify, catch_up)
  active, widths = np.ones(2, bool), (1, 3, 5)
  cost = draft_length.cycle_cost(costs, widths, 4, plain_step=True)
  goodput = sj.theory.expected_goodput(np.full((2, 4), 0.5), active, cost)
  assert int(np.argmax(goodput)) == best
  assert int(draft_length.explore_doublings(policy, goodput, cost, best,
                                            catch_up)) == doublings
  interval = 32 * 2**doublings
  for cycles in (31, interval // 2 - 1, interval - 1, 3 * interval - 1):
    if cycles >= 2**31:
      continue  # past int32: the interval is longer than any decode
    chosen = draft_length.choose(policy, stats.replace(cycles=cycles), None,
                                 active, costs, widths, 4, plain_step=True)
    explores = (cycles + 1) % interval == 0
    assert int(chosen) == (4 if explores else best), cycles
  if catch_up and best == 0:
    # A loop whose K = 0 cycles run the drafter (plain_step=False) never
    # falls behind: it explores as often as with no catch-up (C(0) = 1.1
    # moves neither K* nor the 1024-cycle interval).
    unpriced = draft_length.choose(policy, stats.replace(cycles=1023), None,
                                   active, costs, widths, 4)
    assert int(unpriced) == 4


def test_bad_policy_inputs_are_refused_before_compiling(target_and_draft):
  target, draft = target_and_draft
  padded, lengths = prompts(2)
  adaptive = sj.DecodeConfig(gamma=GAMMA, max_new_tokens=MAX_NEW,
                             verify_buckets=3,
                             adaptive=sj.AdaptiveDraftLength())
  key, drafter = jax.random.key(0), sj.ModelDrafter(draft)
  with pytest.raises(ValueError, match="one verify cost per compiled width"):
    sj.generate(key, target, drafter, padded, lengths, adaptive)
  with pytest.raises(ValueError, match=r"width \(1, 3, 5\)"):
    sj.generate(key, target, drafter, padded, lengths, adaptive,
                costs=sj.CycleCosts.of(0.2, [1.0, 2.0]))
  with pytest.raises(ValueError, match="needs a chain drafter"):
    sj.generate(key, target, sj.TreeDrafter(draft, (2, 1)), padded, lengths,
                adaptive, costs=COSTS)
  fixed = sj.DecodeConfig(gamma=GAMMA, max_new_tokens=MAX_NEW)
  with pytest.raises(ValueError, match="only the adaptive draft length"):
    sj.generate(key, target, drafter, padded, lengths, fixed, costs=COSTS)
  with pytest.raises(ValueError, match="needs a chain drafter"):
    # A tree of one child per depth has a chain's shape, but not its limit.
    sj.generate(key, target, sj.TreeDrafter(draft, (1,) * GAMMA), padded,
                lengths, adaptive, costs=COSTS)
  with pytest.raises(ValueError, match="prior_rate"):
    sj.AdaptiveDraftLength(prior_rate=1.0)
  with pytest.raises(ValueError, match="explore_every"):
    sj.AdaptiveDraftLength(explore_every=0)
  with pytest.raises(ValueError, match="explore_budget"):
    sj.AdaptiveDraftLength(explore_budget=0)
  with pytest.raises(ValueError, match="warmup_tries"):
    sj.AdaptiveDraftLength(warmup_tries=-1)
