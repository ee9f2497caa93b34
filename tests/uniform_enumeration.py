"""The exact law of a verification rule, computed by running the library's
own code on every cell of its uniform draws.

Each rule's `outcome(uniform, ...)` (in `spec_jax.rules`) is the rule with
its acceptance draws as an input: uniform [R, U] -> (num_accepted, ...,
next_probs [R, V]). Uniform j enters only through one comparison u_j < t_j,
where the threshold t_j depends on the row and on u_1..u_{j-1}; `resample`,
`resample_block` and `resample_tree` draw u from their key and then one
token from next_probs. So over u, the outcome is a step function with one
step per draw, and its law is a finite sum over cells.

`law_over_uniforms` finds each step by bisection on the grid jax's float32
uniforms actually take (k / 2^23, k in [0, 2^23)), so it gives the exact
probability of each cell under `jax.random.uniform`, without reading any
threshold from the rule: a rule that computed a wrong threshold, or a wrong
next_probs, shows up in the law. It walks the draws in order, holding the
later ones at the top of the grid, where they fail: a draw the outcome does
not depend on there (an untried node, or a block position above a certain
one) is given one cell.
"""

import jax
import jax.numpy as jnp
import numpy as np

GRID = 2**23  # jax.random.uniform's float32 draws are k / GRID.
TOP = (GRID - 1) / GRID  # The largest draw: it fails every threshold < 1.
CHUNK = 8192  # Rows per call: one compiled program serves every call.


def law_over_uniforms(outcome, inputs, num_uniforms):
  """Every cell of the uniform draws, with its probability and outcome.

  Args:
    outcome: (uniform [H, U] float32, *inputs [H, ...]) -> pytree of
      [H, ...] arrays, deterministic.
    inputs: arrays [R, ...], one row per input of the rule.
    num_uniforms: U.

  Returns:
    index [H] (the input row of each cell), weight [H] float64 (the cell's
    probability given its row; each row's weights sum to 1) and the
    outcome's leaves, each [H, ...].
  """
  run_chunk = jax.jit(outcome)

  def run(index, uniform):
    parts = []
    for start in range(0, len(index), CHUNK):
      rows, draws = index[start:start + CHUNK], uniform[start:start + CHUNK]
      pad = CHUNK - len(rows)
      rows = np.pad(rows, (0, pad))
      draws = np.pad(draws, ((0, pad), (0, 0)), constant_values=TOP)
      leaves = jax.tree.leaves(run_chunk(
          jnp.asarray(draws), *(jnp.asarray(x[rows]) for x in inputs)))
      parts.append([np.asarray(leaf)[:CHUNK - pad] for leaf in leaves])
    return [np.concatenate(leaf) for leaf in zip(*parts)]

  index = np.arange(len(inputs[0]))
  weight = np.ones(len(index))
  uniform = np.full((len(index), num_uniforms), TOP, np.float32)
  for j in range(num_uniforms):
    low = uniform.copy()
    low[:, j] = 0.0
    at_zero = run(index, low)
    depends = ~_same(at_zero, run(index, uniform))
    # Bisection for the number of grid points whose outcome is the one at 0:
    # k / GRID gives it for k < passes, the one at TOP for k >= passes.
    below = np.zeros(len(index), np.int64)
    passes = np.full(len(index), GRID - 1, np.int64)
    probe = uniform.copy()
    for _ in range(23):
      mid = (below + passes) // 2
      probe[:, j] = mid / GRID
      as_at_zero = _same(run(index, probe), at_zero)
      below = np.where(as_at_zero, mid, below)
      passes = np.where(as_at_zero, passes, mid)
    pass_prob = np.where(depends, passes / GRID, 1.0)
    # A draw the outcome does not depend on keeps one cell.
    keep_pass, keep_fail = pass_prob > 0, depends & (pass_prob < 1)
    index = np.concatenate([index[keep_pass], index[keep_fail]])
    weight = np.concatenate([weight[keep_pass] * pass_prob[keep_pass],
                             weight[keep_fail] * (1 - pass_prob[keep_fail])])
    uniform = np.concatenate([low[keep_pass], uniform[keep_fail]])
  return index, weight, run(index, uniform)


def _same(a, b):
  """[H] bool: every leaf of outcomes a and b agrees, row by row."""
  same = np.ones(len(a[0]), bool)
  for x, y in zip(a, b):
    same &= (x == y).reshape(len(x), -1).all(1)
  return same


def emitted_law(input_probs, index, weight, prefixes, next_probs):
  """{accepted tokens + (emitted token,): probability} over every cell.

  input_probs [R]: each input row's probability (the law of its drafts);
  prefixes [H]: each cell's accepted tokens, a tuple; next_probs [H, V].
  """
  law = {}
  for h in np.flatnonzero(weight > 0):
    mass = input_probs[index[h]] * weight[h]
    for x in np.flatnonzero(next_probs[h]):
      key = prefixes[h] + (int(x),)
      law[key] = law.get(key, 0.0) + mass * float(next_probs[h, x])
  return law
