"""The CPU kernels: the small-row product and the rotary rotation they
compute, rows independent of M, the model's use of them, and the XLA path
they fall back to."""

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


def _angles(rows, half, seed=1):
  rng = np.random.default_rng(seed)
  angles = rng.uniform(0, 500, (rows, half)).astype(np.float32)
  return jnp.cos(angles), jnp.sin(angles)


def test_rotate_matches_a_float64_rotation_and_rows_are_independent():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 6, 64), dtype=np.float32))
  cos, sin = _angles(16, 32)
  rotate = jax.jit(cpu_matmul.rotate)
  got = np.asarray(rotate(x, cos, sin))
  x64, c64, s64 = (np.asarray(a, np.float64) for a in (x, cos, sin))
  first, second = x64[..., :32], x64[..., 32:]
  c64, s64 = c64[:, None], s64[:, None]
  exact = np.concatenate([first * c64 - second * s64,
                          second * c64 + first * s64], -1)
  assert np.abs(got - exact).max() < 1e-6 * np.abs(exact).max()
  for r in (1, 3, 9):
    np.testing.assert_array_equal(
        np.asarray(rotate(x[-r:], cos[-r:], sin[-r:])), got[-r:])


def test_rotate_gradients_are_those_of_the_rotation():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 2, 16), dtype=np.float32))
  cos, sin = _angles(3, 8)
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x, cos, sin)))
  np.testing.assert_allclose(
      jax.grad(loss(cpu_matmul.rotate))(x),
      jax.grad(loss(lambda x, c, s: cpu_matmul.rotate_by_xla(x, c[:, None], s[:, None])))(x), rtol=1e-5, atol=1e-6)


# The built-in pair's family (GPT-2: learned positions), Llama's (rotary
# positions, RMSNorm, SwiGLU, GQA) and Gemma 3's (q/k norms, four norms per
# block, a sliding layer with its own rotary base).
FAMILIES = {
    "gpt2": {},
    "llama": dict(position="rope", norm="rms", mlp="swiglu", qkv_bias=False,
                  bias=False),
    "gemma3": dict(position="rope", norm="gemma_rms", mlp="geglu",
                   qk_norm=True, post_norms=True, embed_scale=True,
                   sliding_window=4, layer_types=("sliding", "full"),
                   rope_local_theta=10_000.0, rope_theta=1_000_000.0,
                   qkv_bias=False, bias=False),
}


def _rotate_half_by_xla(x, cos, sin):
  """The rotation as HF writes it, x * cos + rotate_half(x) * sin, by XLA."""
  first, second = jnp.split(x, 2, axis=-1)
  cos, sin = (jnp.concatenate([a, a], -1)[:, None] for a in (cos, sin))
  return x * cos + jnp.concatenate([-second, first], -1) * sin


def _verify_and_steps(config):
  """Logits of 9 tokens scored by one pass (a verify) and by 9 one-token
  passes (steps), after the same 5-token prefill, at batch 1 (9 rows: the
  kernel serves both)."""
  target = sj.Model.init(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 14), 0, 97)
  cache = target.init_cache(1, 32)
  _, cache = target(tokens[:, :5], cache)
  verify, _ = target(tokens[:, 5:], cache)
  steps = []
  for t in range(5, 14):
    logits, cache = target(tokens[:, t:t + 1], cache)
    steps.append(logits)
  return np.asarray(verify), np.asarray(jnp.concatenate(steps, 1))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_a_verify_gives_the_steps_logits_bit_for_bit(family, weight_dtype,
                                                     monkeypatch):
  """What the kernels are for: the target's logits at a position are the same
  whether one pass scores 9 tokens (a verify) or 9 passes score one each, so
  greedy SD emits greedy AR's tokens in bfloat16 too. Controls: XLA's dot
  (float32), and for rotary families XLA's rotation with the kernel's
  products, each differ in the last bits."""
  config = sj.TransformerConfig(vocab_size=97, d_model=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, d_ff=128,
                                max_len=64, weight_dtype=weight_dtype,
                                **FAMILIES[family])
  np.testing.assert_array_equal(*_verify_and_steps(config))
  if weight_dtype == "bfloat16":  # XLA's bfloat16 dots often agree anyway
    return
  with cpu_matmul.disabled():
    verify, steps = _verify_and_steps(config)
  np.testing.assert_allclose(verify, steps, atol=1e-4)
  assert not np.array_equal(verify, steps)
  if config.position == "rope":
    monkeypatch.setattr(cpu_matmul, "rotate", _rotate_half_by_xla)
    jax.clear_caches()
    verify, steps = _verify_and_steps(config)
    jax.clear_caches()
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
