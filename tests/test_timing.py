"""The component timers: slopes, medians, a filled cache, and the cycle."""

import jax.numpy as jnp
import pytest

import spec_jax as sj
from conftest import tiny_pair
from experiments.harness import timing
from spec_jax.decoding import DecodeConfig


class FakeClock:
  """time.perf_counter for the timers, advanced only by `sleep`: timing
  tests then check the arithmetic exactly, whatever the machine's load."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now

  def sleep(self, seconds: float) -> None:
    self.now += seconds


@pytest.fixture
def clock(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(timing.time, "perf_counter", clock)
  return clock


def test_round_timer_slope_removes_the_fixed_cost(clock):
  # fn(n) takes 20 ms + 2 ms per step: the slope is 2 ms whatever the
  # fixed cost, and a call is timed whole.
  step = lambda n: clock.sleep(0.02 + 0.002 * int(n))
  call = lambda: clock.sleep(0.01)
  timer = timing.RoundTimer({"step": step}, {"call": call})
  assert timer.longs["step"] >= 40  # lengthened to >= 100 ms
  for _ in range(3):
    timer.time_round()
  seconds = timer.seconds()
  assert seconds["step"] == pytest.approx(0.002, rel=1e-9)
  assert seconds["call"] == pytest.approx(0.01, rel=1e-9)


def test_round_timer_keeps_the_median_not_the_mean(clock):
  # The first call is the warm-up; then one slow run of three.
  sleeps = iter([0.0, 0.01, 0.3, 0.01])
  timer = timing.RoundTimer({}, {"call": lambda: clock.sleep(next(sleeps))})
  for _ in range(3):
    timer.time_round()
  assert timer.seconds()["call"] == pytest.approx(0.01)  # the mean: 0.107


def test_context_cache_holds_the_context_keys():
  target, _ = tiny_pair()
  tokens, lengths, full, cache, hidden = timing._context(target, 2, 40, (0, 2))
  assert tokens.shape == (2, 40) and (full == 40).all()
  assert (cache.lengths == lengths - 1).all()
  # Every slot holds keys: attention then costs what it does mid-decode.
  assert (jnp.abs(cache.keys[0]).sum(-1) > 0).all()
  # The hidden states of the same pass, for feature-reading drafters.
  assert [h.shape for h in hidden] == [(2, 40, target.config.d_model)] * 2


@pytest.mark.slow  # compiles four loops; the sweep smoke run uses both timers
def test_cycle_and_target_timers_give_positive_times():
  target, draft = tiny_pair()
  config = DecodeConfig(gamma=3, max_new_tokens=8)
  cycle = timing.CycleTimer(target, sj.ModelDrafter(draft), 1, 8, 24,
                            config, cycles=4)
  target_timer = timing.TargetTimer(target, 1, 8, 24, config.sampling)
  for _ in range(3):
    cycle.time_round()
    target_timer.time_round()
  times = {**cycle.seconds(), **target_timer.seconds()}
  assert set(times) == {"draft_step_s", "verify_s", "cycle_s",
                        "draft_prefill_s", "target_step_s", "target_prefill_s"}
  assert all(t > 0 for t in times.values()), times


def test_costs_are_the_parts_over_a_target_step():
  costs = timing.Costs(draft_step_s=0.5e-3, verify_s=3e-3, cycle_s=6e-3,
                       draft_prefill_s=1e-3, target_step_s=2e-3,
                       target_prefill_s=5e-3)
  assert costs.draft_cost_ratio == pytest.approx(0.25)
  assert costs.verify_cost_ratio == pytest.approx(1.5)
  assert costs.cycle_cost_ratio == pytest.approx(3.0)
  row = costs.as_row()
  assert row == {"draft_cost_ratio": costs.draft_cost_ratio,
                 "verify_cost_ratio": costs.verify_cost_ratio,
                 "cycle_cost_ratio": costs.cycle_cost_ratio,
                 "draft_step_s": 0.5e-3, "verify_s": 3e-3, "cycle_s": 6e-3,
                 "draft_prefill_s": 1e-3, "target_step_s": 2e-3,
                 "target_prefill_s": 5e-3}
  # A step and a verify alone, as bench_step times them.
  assert timing.Costs(verify_s=3e-3,
                      target_step_s=2e-3).verify_cost_ratio == 1.5


def test_speedup_over_ar_uses_the_ar_time_given():
  # AR decoded 200 tokens in 2 s (the pooled time, not the run's own 1 s);
  # SD ran at 250 tokens/s.
  run = {"ar": {"new_tokens": 200, "wall_s": 1.0},
         "sd": {"tokens_per_s": 250.0}}
  assert timing.speedup_over_ar(run, 2.0) == {"ar_tokens_per_s": 100.0,
                                              "speedup": 2.5}


def test_calibrated_cycle_costs_price_each_compiled_width():
  """One cost per width the adaptive loop compiles, in target steps: a
  width-1 pass is about a step, and each is positive. A draft model's
  catch-up after plain steps costs something (its four passes of 8 tokens
  take longer than none); prompt lookup's costs nothing."""
  target, draft = tiny_pair()
  config = DecodeConfig(gamma=4, verify_buckets=3,
                        adaptive=sj.AdaptiveDraftLength())
  costs = timing.calibrate_cycle_costs(target, sj.ModelDrafter(draft), 2, 48,
                                       config, rounds=2)
  assert costs.verify.shape == (3,)  # widths 1, 3 and 5
  assert float(costs.draft_step) > 0 and (costs.verify > 0).all()
  assert 0.3 < float(costs.verify[0]) < 3
  assert float(costs.catch_up) > 0
  lookup = timing.calibrate_cycle_costs(
      target, sj.NgramDrafter(target.vocab_size), 2, 48, config, rounds=1)
  assert float(lookup.catch_up) == 0


def test_round_timer_ratios_pair_each_round(clock):
  """A slow spell (1.5x) over round 0 and the reference's part of round 1:
  the reference's median run is a slow one and the wide pass's is not, so
  the ratio of medians is 1.33; each round's own ratio is 2, 1.33 and 2,
  and their median the true 2."""
  factors = iter([1.0] * 4 + [1.5] * 6 + [1.0] * 6)

  def pass_of(seconds_per_step):
    return lambda n: clock.sleep(next(factors)
                                 * (0.01 + seconds_per_step * int(n)))

  timer = timing.RoundTimer({"reference": pass_of(0.005),
                             "wide": pass_of(0.01)})
  assert timer.longs == {"reference": 24, "wide": 24}  # no lengthening
  for _ in range(3):
    timer.time_round()
  seconds = timer.seconds()
  assert seconds["wide"] / seconds["reference"] == pytest.approx(4 / 3)
  assert timer.ratios("reference") == pytest.approx(
      {"reference": 1.0, "wide": 2.0})


def test_round_timer_pairs_a_call_with_a_step_round_by_round(clock):
  """A read (a call) and a step slowed alike in round 1, as when the
  machine's bandwidth halves: each round's step over its read is the same,
  and per_round gives each round's own values."""
  slow = iter([1, 1, 1, 2, 2, 2, 1, 1, 1])  # per round: short, long, read
  timer = timing.RoundTimer(
      {"step": lambda n: clock.sleep(next(slow) * 0.01 * int(n))},
      {"read": lambda: clock.sleep(next(slow) * 0.5)})
  slow = iter([1, 1, 1, 2, 2, 2, 1, 1, 1])  # the constructor's calls done
  for _ in range(3):
    timer.time_round()
  assert timer.per_round("step") == pytest.approx([0.01, 0.02, 0.01])
  assert timer.per_round("read") == pytest.approx([0.5, 1.0, 0.5])
  assert timer.per_round("step") / timer.per_round("read") == pytest.approx(
      [0.02] * 3)


def test_interleave_reverses_the_turns_every_other_repeat(clock):
  calls = []
  decoders = {name: (lambda name: lambda x: calls.append((name, x)))(name)
              for name in ("ar", "sd", "adaptive")}
  timing.interleave(decoders, [(0,), (1,)], repeats=2)
  assert calls == [("ar", 0), ("sd", 0), ("adaptive", 0),
                   ("ar", 1), ("sd", 1), ("adaptive", 1),
                   ("adaptive", 0), ("sd", 0), ("ar", 0),
                   ("adaptive", 1), ("sd", 1), ("ar", 1)]
