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
from spec_jax import attention, cpu_matmul, kv_cache, model

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
  for m in (1, 3, 6, 7, 16, cpu_matmul.MAX_ROWS):
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
  k, n, most = 577, 37, cpu_matmul.MAX_ROWS
  x, w = _operands(most, k, n, dtype)
  product = jax.jit(cpu_matmul.small_row_matmul)
  alone = np.stack([np.asarray(product(x[i:i + 1], w))[0]
                    for i in range(most)])
  for m in (*range(1, 17), 23, 40, most):
    # Other rows than the first m of x, so each row has new neighbours.
    rows = jnp.concatenate([x[:m - 1], x[most - 1:]])
    want = np.concatenate([alone[:m - 1], alone[most - 1:]])
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
  # Both VJPs at one cotangent: a loss through the forward product would also
  # compare the two products' last bits (their sums run in other orders), and
  # through sin() those reach 1e-4 relative in a gradient on AVX2.
  x, w = _operands(3, 100, 5, jnp.float32)
  cotangent = jnp.asarray(
      np.random.default_rng(1).standard_normal((3, 5), dtype=np.float32))
  _, got = jax.vjp(cpu_matmul.small_row_matmul, x, w)
  _, want = jax.vjp(lambda x, w: x @ w.T, x, w)
  for g, e in zip(got(cotangent), want(cotangent)):
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


def _attention_operands(seed=0):
  """Two rows of 3 new tokens at slots 4-6 and 0-2 of 11, chain-causal, 2
  key/value heads of 2 query heads each, Dh 20 (a vector tail); the own slots
  of the cache hold junk, which a call that wrote its keys would replace."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  q = normal(2, 3, 2, 2, 20)
  keys, values = normal(2, 2, 11, 20), normal(2, 2, 11, 20)
  own_keys, own_values = normal(2, 2, 3, 20), normal(2, 2, 3, 20)
  slots = jnp.array([[4, 5, 6], [0, 1, 2]], jnp.int32)
  visible = model.visible_slots(slots, 11)
  return q, keys, values, own_keys, own_values, slots, visible


def _attention_in_float64(q, keys, values, own_keys, own_values, slots,
                          visible, scale, cap):
  """The softmax over each query's visible slots, own keys written first."""
  q, keys, values, own_keys, own_values = (
      np.asarray(a, np.float64) for a in (q, keys, values, own_keys,
                                           own_values))
  keys, values = keys.copy(), values.copy()
  for b, row in enumerate(np.asarray(slots)):
    keys[b][:, row], values[b][:, row] = own_keys[b], own_values[b]
  scores = np.einsum("btkgd,bksd->btkgs", q, keys) / scale
  if cap:
    scores = cap * np.tanh(scores / cap)
  scores = np.where(np.asarray(visible)[:, :, None, None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("btkgs,bksd->btkgd", weights, values)


@pytest.mark.parametrize("cap", [None, 2.0])
def test_attend_matches_a_float64_softmax_and_reads_the_own_keys(cap):
  operands = _attention_operands()
  attend = jax.jit(attention._attend_by_kernel, static_argnums=(7, 8))
  got = np.asarray(attend(*operands, 3.0, cap))
  exact = _attention_in_float64(*operands, 3.0, cap)
  np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6)
  # And what XLA's formula gives, keys written or not.
  q, keys, values, own_keys, own_values, slots, visible = operands
  written = [kv_cache.write(c, n, slots)
             for c, n in ((keys, own_keys), (values, own_values))]
  for by_xla in (attention.attend_by_xla(q, *written, visible, 3.0, cap),
                 attention._unwritten_by_xla(*operands, 3.0, cap)):
    np.testing.assert_allclose(got, by_xla, rtol=1e-5, atol=1e-6)


def test_attend_sums_each_query_alone_and_in_slot_order():
  """A query's output is bitwise the same alone and among others, and when
  its keys come from the cache instead of the own ones; a tree node seeing
  its ancestors at other slots equals the chain through them."""
  q, keys, values, own_keys, own_values, slots, visible = _attention_operands()
  attend = jax.jit(attention._attend_by_kernel, static_argnums=(7, 8))
  full = np.asarray(attend(q, keys, values, own_keys, own_values, slots,
                           visible, 3.0, None))
  written = [kv_cache.write(c, n, slots)
             for c, n in ((keys, own_keys), (values, own_values))]
  for b in range(2):
    for t in range(3):
      # Token t alone, as a step after t earlier ones were written.
      one = np.asarray(attend(q[b:b + 1, t:t + 1], written[0][b:b + 1],
                              written[1][b:b + 1],
                              own_keys[b:b + 1, :, t:t + 1],
                              own_values[b:b + 1, :, t:t + 1],
                              slots[b:b + 1, t:t + 1],
                              visible[b:b + 1, t:t + 1], 3.0, None))
      np.testing.assert_array_equal(one[0, 0], full[b, t])
  # Row 0's token 2 as a tree node whose parent is token 0 sees slots 0-3,
  # 4 and 6: the chain [0, 2] written at slots 4 and 5, the same keys in the
  # same order. Control: as token 2 of the chain it also sees token 1.
  tree = model.visible_slots(slots, 11, jnp.array([[-1, -1, 0], [-1, 0, 1]]))
  node = np.asarray(attend(q, keys, values, own_keys, own_values, slots,
                           tree, 3.0, None))[0, 2]
  order = jnp.array([0, 2, 1])
  chain = np.asarray(attend(q[:, order], keys, values, own_keys[:, :, order],
                            own_values[:, :, order], slots, visible, 3.0,
                            None))
  np.testing.assert_array_equal(node, chain[0, 1])
  assert not np.array_equal(node, full[0, 2])


def test_attend_gradients_are_those_of_xlas_formula():
  q, keys, values, own_keys, own_values, slots, visible = (
      _attention_operands())
  loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x, slots, visible, 3.0,
                                                None)))
  arrays = (q, keys, values, own_keys, own_values)
  got = jax.grad(loss(attention._attend_by_kernel), range(5))(*arrays)
  want = jax.grad(loss(attention._unwritten_by_xla), range(5))(*arrays)
  for g, e in zip(got, want, strict=True):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_model_attention_takes_the_kernel_up_to_max_rows_only():
  length = 2 * cpu_matmul.MAX_ROWS
  config = sj.TransformerConfig(vocab_size=97, d_model=32, num_layers=1,
                                num_heads=2, d_ff=64, max_len=length)
  target = sj.Model.init(config, jax.random.key(0))
  lowered = lambda t: jax.jit(target.__call__).lower(
      jnp.zeros((1, t), jnp.int32), target.init_cache(1, length)).as_text()
  assert "spec_jax_attend" in lowered(cpu_matmul.MAX_ROWS)
  assert "spec_jax_attend" not in lowered(cpu_matmul.MAX_ROWS + 1)


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


def _verify_and_steps(config):
  """Logits of 9 tokens scored by one pass that writes its keys (a verify),
  by one that leaves them unwritten (the loop's width switch), and by 9
  one-token passes (steps), after prefills of 5 and 3 tokens, at batch 2
  (a verify of 18 rows, a step of 2, the rows at two pointers)."""
  target = sj.Model.init(config, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 14), 0, 97)
  cache = target.init_cache(2, 32)
  _, cache = target(tokens[:, :5], cache)
  cache = cache.rollback(jnp.array([5, 3]))
  positions = cache.lengths[:, None] + jnp.arange(9)
  written, _ = target(tokens[:, 5:], cache, positions)
  unwritten, _, _ = target.forward(tokens[:, 5:], cache, positions,
                                   write=False)
  steps = []
  for t in range(9):
    logits, cache = target(tokens[:, 5 + t:6 + t], cache, positions[:, t:t + 1])
    steps.append(logits)
  return [np.asarray(written), np.asarray(unwritten),
          np.asarray(jnp.concatenate(steps, 1))]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_a_verify_gives_the_steps_logits_bit_for_bit(family, weight_dtype,
                                                     monkeypatch):
  """What the kernels are for: the target's logits at a position are the same
  whether one pass scores 9 tokens (a verify, its keys written or not) or 9
  passes score one each, so greedy SD emits greedy AR's tokens in bfloat16
  too. Controls (float32): XLA's dot, and XLA's attention with the kernel's
  products, each make them differ in the last bits."""
  config = sj.TransformerConfig(vocab_size=97, d_model=64, num_layers=2,
                                num_heads=4, num_kv_heads=2, d_ff=128,
                                max_len=64, weight_dtype=weight_dtype,
                                **FAMILIES[family])
  written, unwritten, steps = _verify_and_steps(config)
  np.testing.assert_array_equal(written, steps)
  np.testing.assert_array_equal(unwritten, steps)
  if weight_dtype == "bfloat16":  # XLA's bfloat16 dots often agree anyway
    return
  with cpu_matmul.disabled():
    written, unwritten, steps = _verify_and_steps(config)
  np.testing.assert_allclose(written, steps, atol=1e-4)
  assert not np.array_equal(written, steps)
  assert not np.array_equal(unwritten, steps)
  monkeypatch.setattr(attention, "_attend_by_kernel",
                      attention._unwritten_by_xla)
  jax.clear_caches()
  written, unwritten, steps = _verify_and_steps(config)
  jax.clear_caches()
  np.testing.assert_allclose(unwritten, steps, atol=1e-4)
  assert not np.array_equal(written, steps)
  assert not np.array_equal(unwritten, steps)


@pytest.mark.parametrize("norm", ["rms", "gemma_rms", "layer"])
def test_a_norm_is_bitwise_the_same_over_one_token_and_over_nine(
    norm, monkeypatch):
  """Every norm's mean is a sum by halving (`model.row_mean`), so a token's
  normed vector is the same in a step and in a verify, with the kernel on
  or off. Control: the same norms with XLA's reduction (`jnp.mean`), which
  over SmolLM2's width (576) sums 9 rows in another order than one, which
  made bfloat16 SD differ from AR on SmolLM2."""
  config = sj.TransformerConfig(vocab_size=97, d_model=576, num_layers=1,
                                num_heads=4, d_ff=128, max_len=16, norm=norm)
  module = model._norm(config, "norm")  # pylint: disable=protected-access
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 9, 576)) * 3,
                  jnp.float32)
  params = module.init(jax.random.key(0), x)
  params = jax.tree.map(lambda w: w + jnp.linspace(0.5, 1.5, w.size), params)

  def together_and_alone():
    apply = jax.jit(module.apply)
    return (np.asarray(apply(params, x)), np.concatenate(
        [np.asarray(apply(params, x[:, t:t + 1])) for t in range(9)], 1))

  np.testing.assert_array_equal(*together_and_alone())
  with cpu_matmul.disabled():
    np.testing.assert_array_equal(*together_and_alone())
  monkeypatch.setattr(model, "row_mean", lambda x: jnp.mean(
      x.astype(jnp.float32), -1, keepdims=True))
  together, alone = together_and_alone()
  np.testing.assert_allclose(together, alone, atol=1e-5)
  assert not np.array_equal(together, alone)


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


def _cpu_flags():
  try:
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  lines = [l for l in cpuinfo.splitlines() if l.startswith("flags")]
  return set(lines[0].split(":", 1)[1].split()) if lines else set()


# What each -march variant's binary executes beyond baseline x86-64.
_MARCH_NEEDS = {"native": set(), "x86-64": set(),
                "x86-64-v3": {"avx2", "fma"},
                "x86-64-v4 -mno-avx512bf16": {"avx512f", "avx512bw",
                                              "avx512vl"}}


@pytest.mark.slow  # four builds of the kernel, 4-5 s each
@pytest.mark.parametrize("march", list(_MARCH_NEEDS))
def test_every_instruction_set_variant_computes_the_same_product(tmp_path,
                                                                 march):
  """The AVX2, AVX-512 without bf16 and scalar variants, which this machine
  would not pick, against a float64 product and bitwise row by row, and
  their attention against a float64 softmax."""
  missing = _MARCH_NEEDS[march] - _cpu_flags()
  if missing:  # its binary would die of an illegal instruction
    pytest.skip(f"this CPU cannot run the variant's instructions "
                f"({', '.join(sorted(missing))})")
  binary = tmp_path / "isa_check"
  subprocess.run(["c++", "-O2", *f"-march={march}".split(), "-std=c++17", "-w",
                  f"-I{jax.ffi.include_dir()}",
                  str(REPO / "tests" / "cpu_matmul_isa_check.cc"),
                  "-lmvec", "-o", str(binary)], check=True, timeout=300)
  done = subprocess.run([str(binary)], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stdout
  assert done.stdout.count(": ok") == 9, done.stdout
