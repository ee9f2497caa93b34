"""The small-row CPU kernel: the product it computes, rows independent of M,
the model's use of it, and the XLA path it falls back to."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import cpu_matmul, model

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    cpu_matmul.isa() is None, reason="the small-row CPU kernel is not built "
    "here (no C++ compiler, not x86-64, or SPEC_JAX_CPU_KERNEL=0)")

# K with a vector tail (577, 100) and N with a panel tail (37): every path of
# the kernel's loops runs.
SHAPES = [(577, 37), (1536, 64), (100, 5)]
DTYPES = [jnp.float32, jnp.bfloat16]


def _operands(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
  w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)).astype(dtype)
  return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_matches_a_float64_product(k, n, dtype):
  for m in (1, 3, 6, 7, 16):
    x, w = _operands(m, k, n, dtype)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(jax.jit(cpu_matmul.small_row_matmul)(x, w))
    assert got.dtype == np.float32 and got.shape == (m, n)
    # Relative to the largest output: float32 sums over k carry about
    # sqrt(k) * 6e-8 of it.
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert error < 1e-5, (m, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_bitwise_independent_of_m_and_of_the_other_rows(dtype):
  k, n = 577, 37
  x, w = _operands(16, k, n, dtype)
  product = jax.jit(cpu_matmul.small_row_matmul)
  alone = np.stack([np.asarray(product(x[i:i + 1], w))[0] for i in range(16)])
  for m in range(1, 17):
    # Other rows than the first m of x, so each row has new neighbours.
    rows = jnp.concatenate([x[:m - 1], x[15:16]]) if m > 1 else x[15:16]
    want = np.concatenate([alone[:m - 1], alone[15:16]])
    np.testing.assert_array_equal(np.asarray(product(rows, w)), want,
                                  err_msg=f"M={m}")


def test_a_control_with_the_order_changed_is_not_bitwise_equal():
  """The bitwise test above can fail: summing k in another order (XLA's dot
  over all 16 rows at once) does change last bits."""
  x, w = _operands(16, 1536, 64, jnp.float32)
  kernel = np.asarray(cpu_matmul.small_row_matmul(x, w))
  xla = np.asarray(jnp.einsum("mk,nk->mn", x, w))
  assert not np.array_equal(kernel, xla)
  np.testing.assert_allclose(kernel, xla, rtol=1e-4, atol=1e-4)


def test_it_runs_inside_while_loop_cond_and_switch():
  x, w = _operands(4, 577, 37, jnp.bfloat16)
  want = cpu_matmul.small_row_matmul(x, w)

  @jax.jit
  def looped(x, w):
    def body(carry):
      i, acc = carry
      y = jax.lax.cond(i % 2 == 0, cpu_matmul.small_row_matmul,
                       lambda x, w: -cpu_matmul.small_row_matmul(x, w), x, w)
      y = jax.lax.switch(i % 3, [lambda y: y, lambda y: 2 * y, lambda y: y],
                         y)
      return i + 1, acc + y
    return jax.lax.while_loop(lambda c: c[0] < 4, body,
                              (0, jnp.zeros_like(want)))[1]

  # i = 0..3: +y, -2y, +y, -y.
  np.testing.assert_array_equal(looped(x, w), want - 2 * want + want - want)


def test_gradients_are_those_of_the_product():
  x, w = _operands(3, 100, 5, jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  got = jax.grad(loss(cpu_matmul.small_row_matmul), (0, 1))(x, w)
  want = jax.grad(loss(lambda x, w: x @ w.T), (0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_model_matmul_takes_the_kernel_up_to_max_rows_only():
  w = jnp.zeros((8, 32), jnp.bfloat16)
  small = jnp.zeros((2, cpu_matmul.MAX_ROWS // 2, 32), jnp.float32)
  large = jnp.zeros((cpu_matmul.MAX_ROWS + 1, 32), jnp.float32)
  assert cpu_matmul.applies(small, w)
  assert not cpu_matmul.applies(large, w)
  assert not cpu_matmul.applies(small.astype(jnp.bfloat16), w)
  lowered = lambda x: jax.jit(model.matmul).lower(x, w).as_text()
  assert "spec_jax_small_row_matmul" in lowered(small)
  assert "spec_jax_small_row_matmul" not in lowered(large)


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_a_verify_gives_the_steps_logits_bit_for_bit(weight_dtype):
  """What the kernel is for: the target's logits at a position are the same
  whether one pass scores 9 tokens (a verify) or 9 passes score one each, so
  greedy SD emits greedy AR's tokens in bfloat16 too. With XLA's dot (the
  control, float32) they differ in the last bits."""
  # The built-in pair's family (GPT-2: learned positions). With rotary
  # positions the logits still differ in the last bits: XLA fuses the
  # rotation into its neighbours differently for one and for 9 tokens.
  config = sj.TransformerConfig(vocab_size=97, d_model=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, d_ff=128,
                                max_len=64, weight_dtype=weight_dtype)
  target = sj.Model.init(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 14), 0, 97)

  def verify_and_steps():
    cache = target.init_cache(1, 32)
    _, cache = target(tokens[:, :5], cache)
    verify, _ = target(tokens[:, 5:], cache)
    steps = []
    for t in range(5, 14):
      logits, cache = target(tokens[:, t:t + 1], cache)
      steps.append(logits)
    return np.asarray(verify), np.asarray(jnp.concatenate(steps, 1))

  np.testing.assert_array_equal(*verify_and_steps())
  with cpu_matmul.disabled():
    verify, steps = verify_and_steps()
  np.testing.assert_allclose(verify, steps, atol=1e-4)
  if weight_dtype == "float32":  # here XLA's bfloat16 dots happen to agree
    assert not np.array_equal(verify, steps)


def _run(code, **env):
  """`code` in a fresh interpreter with `env` added; its stdout and stderr."""
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                        capture_output=True, env={**os.environ, **env},
                        timeout=300, check=True)
  return done.stdout + done.stderr


_USES_KERNEL = """
import jax.numpy as jnp
from spec_jax import cpu_matmul
print("applies", cpu_matmul.applies(jnp.zeros((1, 8)), jnp.zeros((4, 8))))
"""


def test_the_environment_variable_turns_it_off():
  assert "applies False" in _run(_USES_KERNEL, SPEC_JAX_CPU_KERNEL="0")


def test_without_a_compiler_one_warning_and_the_xla_path(tmp_path):
  out = _run(_USES_KERNEL, CXX=str(tmp_path / "no-such-compiler"),
             XDG_CACHE_HOME=str(tmp_path))
  assert "applies False" in out
  assert out.count("small-row CPU kernel") == 1, out
  assert not list(tmp_path.glob("spec_jax/*.so"))


@pytest.mark.slow  # four builds of the kernel, 4-5 s each
@pytest.mark.parametrize("march", ["native", "x86-64-v3",
                                   "x86-64-v4 -mno-avx512bf16", "x86-64"])
def test_every_instruction_set_variant_computes_the_same_product(tmp_path,
                                                                 march):
  """The AVX2, AVX-512 without bf16 and scalar variants, which this machine
  would not pick, against a float64 product and bitwise row by row."""
  binary = tmp_path / "isa_check"
  subprocess.run(["c++", "-O2", *f"-march={march}".split(), "-std=c++17", "-w",
                  f"-I{jax.ffi.include_dir()}",
                  str(REPO / "tests" / "cpu_matmul_isa_check.cc"),
                  "-o", str(binary)], check=True, timeout=300)
  done = subprocess.run([str(binary)], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stdout
  assert done.stdout.count(": ok") == 6, done.stdout
