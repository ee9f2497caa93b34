"""The adaptive draft length: each cycle drafts the number of tokens that
maximises the batch's expected output per unit of time.

Before cycle n every row b has counts from its own earlier cycles: a_{b,i},
the cycles that accepted draft i, and t_{b,i}, those that tried it
(proposed it with drafts 1..i-1 accepted; `DecodeStats`). The policy drafts

  K* = argmax_{K in 0..G}  sum_b active_b E_b(K) / C(K)

  E_b(K) = 1 + sum_{i=1..K} prod_{j=1..i} r_{b,j}          expected tokens
  r_{b,i} = (a_{b,i} + w m_i) / (t_{b,i} + w)              row estimate
  m_i = (sum_b' a_{b',i} + w m_{i-1}) / (sum_b' t_{b',i} + w)  pooled, draft i
  m_0 = m = (sum_b',j a_{b',j} + w r0) / (sum_b',j t_{b',j} + w)  all drafts
  C(K) = K c + V(K) + o for K >= 1, C(0) = 1               cost, in steps

where c is a draft pass, V(K) the verify pass of the narrowest compiled
width that holds K drafts (`verification.verify_widths`) and o the loop's
own work in a cycle that drafts (emitting and counting the tokens, rolling
the caches back, choosing K; 0.0-0.2 steps for the built-in pair at batch 1
to 16), all measured at this batch size and passed in as data
(`CycleCosts`), and r0, w the prior
(`AdaptiveDraftLength`). The pools are the counts of every row and of every
prompt already decoded (an empirical-Bayes prior), so a refilled row starts
at what the pair has shown, not at r0. Each row's estimate shrinks toward
m_i, m_i toward the draft before it, m_{i-1}, and m_1 toward m, the i.i.d.
model's acceptance rate. Drafts past K* are tried only in explore cycles,
so their few counts need a prior that the pair has shown: r0 would price
them at 0.6 long after the pair has shown 0.8 (the built-in pair at T = 1),
and m, which the first drafts' many counts weigh most, would price them at
the first drafts' rate, while a draft whose predecessors were all accepted
sits in an easy stretch and is accepted more often (the built-in pair at
T = 0: 0.78 at the first draft, 0.94-1.00 from the sixth; gamma sweep). The
nearest draft tried is the closest evidence. The pools hold the row's own
counts too, so they weigh a little more than w pseudo-counts would let
them.

A cycle that drafts nothing is a plain target step, the autoregressive
loop's: no draft pass and no rejection step, so that where no draft pays the
loop costs what AR does. A draft model's cache falls one token behind per
such step and catches up in passes of 8 tokens (7 new each) in the next
cycle that drafts (`drafting.propose`), u steps per plain step behind
(`CycleCosts.catch_up`, about a draft pass per 7 plain steps). C(0) leaves u
out: a decode that drafts nothing from here on never pays it, and one that
drafts in every cycle never falls behind. An explore cycle after K* = 0 pays
it for every plain step since the last draft (below). A row refilled during
plain steps starts with an empty draft cache, its prompt fed in the same
passes (a few more of them, which u leaves out), not in a one-row draft
prefill that a decode drafting nothing more would never read. (A drafter
that cannot catch up, the EAGLE head, which reads the target's features of
every token, runs K = 0 as a cycle of one draft pass and a verify of width
1, with C(0) = c + V(1) + o.) Every row drafts K*: a cycle's passes have
fixed shapes, so its cost is set by the longest proposal, and once that is K
a row drafting fewer saves nothing (`theory`). Every explore_every-th cycle
drafts gamma tokens, or every 2^k explore_every-th where that loses more
than a budget of the time (`AdaptiveDraftLength`, `explore_doublings`).
Where K* = 0, the catch-up before an explore cycle grows with the interval,
so it costs a share u of the time at any spacing; where u alone exceeds the
budget the decode stops exploring (the built-in pair's u is 0.010-0.011 steps
at batch 1 and 0.02-0.04 at batch 8 and 32, against a budget of 0.01). The
decode's first cycles, until its first draft has been tried warmup_tries
times, draft max(K*, 1): a prior that prices drafting below a plain step
would otherwise start the decode at K = 0, which tries no draft, so that no
count would ever move it (the built-in pair at T = 0 accepts 0.85 of its
drafts and drafted nothing). Not gamma: the first draft's counts move the
pooled rate m, which prices the drafts past it, so the warm-up need not try
them, and a warm-up of gamma drafts is dear in a short decode (in the gamma
sweep's rows each prompt is a decode of 96 tokens, about 24 cycles at T = 1,
of which 8 warm-up cycles of gamma = 10 drafts would be 11-token verifies).

Why the output law is the target's: K* is a function of the counts (the
rows' and the decoded prompts') and of the cycle's number, which are
functions of earlier cycles' tokens and randomness only, never of this
cycle's target probabilities or uniforms. Given the past, cycle n is an
ordinary speculative cycle with K* drafts, and every such cycle emits tokens
with the target's law given the past, whatever K is (K = 0 samples the
target directly, with or without the drafter). So the whole output has the
target's law; a policy that looked at the current p (say, drafting more
where the target is confident) would not. The Monte Carlo law test runs the
loop with this policy, with costs that make it change K during the run.
"""

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import theory
from spec_jax.stats import DecodeStats


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveDraftLength:
  """The prior of the acceptance estimates: r0 = prior_rate, worth
  prior_weight cycles, first for the decode's pooled rate, which is then
  the prior of each row's own (module docstring). A decode with no history
  drafts as if each draft were accepted with probability r0; the counts
  take over as they grow.

  explore_every: every explore_every-th cycle drafts gamma tokens (an
  explore cycle). A cycle tries only the drafts it proposes, so without it
  counts that once made K* small would never be tested at the positions
  past K* again, and rows whose drafts became good (a repetitive stretch
  for prompt lookup, or a prior below the pair's acceptance) would never be
  seen to be.

  explore_budget: where an explore cycle costs more than K*'s would for
  what it emits, exploring runs every 2^k explore_every-th cycle instead,
  for the least k that keeps its loss, by the cost model, at most this
  share of the decode's time (`explore_doublings`). Where drafting does not
  pay, gamma drafts can cost several plain steps more than they emit, and
  every 32nd cycle would lose over 10% of AR's speed. Where K* = 0, a draft
  model's catch-up before each explore cycle takes its share first
  (`explore_doublings`).

  warmup_tries: the decode's first cycles draft at least one token until its
  rows (and the prompts it has decoded) have tried their first draft this
  many times, so that the counts, not the prior, choose K from then on. It
  takes warmup_tries cycles at batch 1 and one at a batch of warmup_tries
  rows, and differs from K* only in its cycles where K* is 0.
  """

  prior_rate: float = 0.6
  prior_weight: float = 4.0
  explore_every: int = 32
  explore_budget: float = 0.01
  warmup_tries: int = 8

  def __post_init__(self):
    if (not 0 < self.prior_rate < 1 or self.prior_weight <= 0
        or self.explore_every < 1 or not self.explore_budget > 0
        or self.warmup_tries < 0):
      raise ValueError(
          f"AdaptiveDraftLength(prior_rate={self.prior_rate}, prior_weight="
          f"{self.prior_weight}, explore_every={self.explore_every}, "
          f"explore_budget={self.explore_budget}, warmup_tries="
          f"{self.warmup_tries}): need 0 < prior_rate < 1, prior_weight > 0, "
          "explore_every >= 1, explore_budget > 0 and warmup_tries >= 0.")


@flax.struct.dataclass
class CycleCosts:
  """What the parts of a cycle cost at the decode's batch size, in target
  steps: data, so that measured costs need no recompilation."""

  draft_step: jax.Array  # [] float32, a draft pass.
  # [W] float32, a verify pass and its rejection step at each compiled
  # width (`verification.verify_widths`, narrowest first).
  verify: jax.Array
  # [] float32, u: what the drafter's catch-up costs later per plain target
  # step it missed; 0 for one that reads only the tokens or the target's
  # cache (prompt lookup, layer skip).
  catch_up: jax.Array
  # [] float32, o: the loop's own work in a cycle that drafts, beyond its
  # passes: emitting the tokens, counting them, rolling the caches back and
  # choosing K.
  overhead: jax.Array

  @classmethod
  def of(cls, draft_step: float, verify, catch_up: float = 0.0,
         overhead: float = 0.0) -> "CycleCosts":
    return cls(jnp.float32(draft_step), jnp.asarray(verify, jnp.float32),
               jnp.float32(catch_up), jnp.float32(overhead))


def cycle_cost(costs: CycleCosts, widths: tuple[int, ...], gamma: int,
               plain_step: bool) -> jax.Array:
  """C(K) for K = 0..gamma: [gamma + 1]. plain_step: a cycle of no drafts
  is a target step, which costs 1; otherwise a draft pass, a verify of
  width 1 and the loop's overhead."""
  # The narrowest compiled width that holds K drafts and the last token.
  width_index = [next(i for i, w in enumerate(widths) if w >= k + 1)
                 for k in range(gamma + 1)]
  drafts = jnp.maximum(jnp.arange(gamma + 1), 1)
  cost = (drafts * costs.draft_step + costs.verify[jnp.array(width_index)]
          + costs.overhead)
  return cost.at[0].set(1.0) if plain_step else cost


@flax.struct.dataclass
class Plan:
  """The policy's choice for as long as its inputs stand: they are the
  counts and the active rows, which a plain target step leaves as they
  are, so a loop of plain steps need not choose again until a row finishes
  or an explore cycle falls due (`decoding._plain_steps`)."""

  drafts: jax.Array  # [] int32, K* (at least 1 in the warm-up).
  # [] int32, k: explore cycles fall where the cycle's number is a multiple
  # of explore_every 2^k (`explore_doublings`).
  doublings: jax.Array

  def explores(self, policy: AdaptiveDraftLength,
               cycle: jax.Array) -> jax.Array:
    """[] bool: whether the cycle-th cycle (counted from 1) drafts gamma. A
    longer interval's explore cycles are among a shorter one's, so the
    spacing holds as the interval moves."""
    return ((cycle % policy.explore_every == 0)
            & ((cycle // policy.explore_every)
               % jnp.left_shift(1, self.doublings) == 0))

  def drafts_at(self, policy: AdaptiveDraftLength, cycle: jax.Array,
                gamma: int) -> jax.Array:
    """K for the cycle-th cycle, [] int32: gamma in an explore cycle."""
    return jnp.where(self.explores(policy, cycle), gamma,
                     self.drafts).astype(jnp.int32)


def plan(policy: AdaptiveDraftLength, stats: DecodeStats,
         decoded: DecodeStats | None, active, costs: CycleCosts,
         widths: tuple[int, ...], gamma: int,
         plain_step: bool = False) -> Plan:
  """K* and the explore interval from the counts (see the module
  docstring).

  stats: the rows' counters; decoded: the counters of the prompts already
  decoded (`refill.Queue.stats`; None without a queue). A row's counters
  move there when its prompt is done and restart at 0, so no cycle is
  pooled twice. plain_step: the loop runs a cycle of no drafts as a plain
  target step (`cycle_cost`).
  """
  pooled = lambda name: sum(
      getattr(s, name).sum(0) for s in (stats, decoded) if s is not None)
  accepted, tried = pooled("accepted_per_position"), pooled(
      "tried_per_position")  # [G], [G]
  estimate = functools.partial(theory.conditional_acceptance_estimate,
                               prior_weight=policy.prior_weight)
  rate = estimate(accepted.sum(), tried.sum(), policy.prior_rate)  # []
  pooled_rate = [rate]  # m_0 = m, then m_1 .. m_G
  for i in range(accepted.shape[0]):
    pooled_rate.append(estimate(accepted[i], tried[i], pooled_rate[-1]))
  pooled_rate = jnp.stack(pooled_rate[1:])  # [G]
  conditional = estimate(stats.accepted_per_position,
                         stats.tried_per_position, pooled_rate)  # [B, G]
  cost = cycle_cost(costs, widths, gamma, plain_step)
  # The choice the brute-force test checks (`theory`); the goodput by K
  # prices an explore cycle.
  best = theory.goodput_optimal_draft_length(conditional, active, cost)
  goodput = theory.expected_goodput(conditional, active, cost)  # [G+1]
  doublings = explore_doublings(policy, goodput, cost, best,
                                costs.catch_up if plain_step else 0.0)
  # The warm-up drafts K*, but at least one token, so that a prior that
  # prices drafting below a plain step still gets counts.
  warmup = tried[0] < policy.warmup_tries
  return Plan(drafts=jnp.where(warmup, jnp.maximum(best, 1),
                               best).astype(jnp.int32),
              doublings=doublings)


def choose(policy: AdaptiveDraftLength, stats: DecodeStats,
           decoded: DecodeStats | None, active, costs: CycleCosts,
           widths: tuple[int, ...], gamma: int,
           plain_step: bool = False) -> jax.Array:
  """K for the next cycle, an int32 scalar: `plan`'s, gamma in an explore
  cycle."""
  return plan(policy, stats, decoded, active, costs, widths, gamma,
              plain_step).drafts_at(policy, stats.cycles + 1, gamma)


def explore_doublings(policy: AdaptiveDraftLength, goodput, cost, best,
                      catch_up=0.0) -> jax.Array:
  """k, [] int32: explore cycles run every 2^k explore_every-th cycle, for
  the least k at which they lose at most policy.explore_budget of the
  time. An explore cycle takes C(G) and emits what the best K emits in
  C(G) g(G) / g(K*), g being the goodput [G+1]; the rest is lost, in cycles
  of K*: loss = C(G) (1 - g(G) / g(K*)) / C(K*). Where K* = 0 runs plain
  steps, the catch-up u per plain step (`CycleCosts.catch_up`) loses a
  share u / C(0) at any interval, and the rest of the budget pays the
  explore cycles: k = ceil(log2(loss / ((budget - u / C(0)) explore_every))),
  at least 0, and 30 (no explore cycle in any decode, for int32) where u
  leaves nothing of the budget."""
  share = goodput[-1] / jnp.maximum(goodput[best], 1e-30)
  loss = cost[-1] * (1 - share) / cost[best]
  room = policy.explore_budget - jnp.where(best == 0, catch_up / cost[0], 0.0)
  ratio = loss / (room * policy.explore_every)
  # NaN (costs of 0) reads as 1: explore every explore_every-th cycle.
  ratio = jnp.where(room > 0, jnp.where(ratio > 1, ratio, 1.0), jnp.inf)
  return jnp.minimum(jnp.ceil(jnp.log2(ratio)), 30).astype(jnp.int32)
