"""CPU kernels for XLA (cpu_matmul.cc), called through FFI: a small-row matmul,
the rotary rotation, and attention over the KV cache.

XLA:CPU's dots of 2-16 rows take 1.7-3x the time of its one-row product over
the same weights, and a one-row product with bfloat16 weights converts a
float32 copy of the whole kernel. The kernel reads each weight byte once per
call for up to `MAX_ROWS` rows, in float32 or bfloat16, and computes each
output row in an order that does not depend on the other rows, so a row's
product is bitwise the same in a decode step and in a verify. XLA fuses the
rotary rotation into its neighbours differently for one token and for
several, so `rotate` computes that too; and XLA's softmax over the cache sums
in an order that depends on the pass, so `attend` does (attention.py). A whole
model's logits at a position are then the same in a step and in a verify
(docs/step_benchmark.md).

`model.matmul`, `model.apply_rope` and `attention.attend` call them on the CPU
backend of a one-device process for passes of at most `MAX_ROWS` rows;
everything else (more rows, a mesh of several devices, TPU and GPU) keeps
XLA's ops.

It is compiled on first use with the system C++ compiler (`$CXX`, else `c++`)
for this CPU (-march=native: AVX-512 with its bf16 dot products where the CPU
has them, AVX2+FMA otherwise), into a cache keyed by the source, the jaxlib
version, the compiler and the CPU. Without a compiler one warning says so and
XLA's dot runs; `SPEC_JAX_CPU_KERNEL=0` turns the kernel off, and `disabled()` within a
process.
"""

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib

# The most rows the kernel takes. Over the built-in target's and SmolLM2's
# weights on a 2-core Zen 4 it is faster than XLA's dot at every M up to 64
# (1.1-1.2x at 64), and XLA's catches up at 72-96 rows with bfloat16 weights
# and at 128-192 in float32 (`matmul_crossover` in docs/step_benchmark.md).
# 64 rows serve a verify of 8 rows of up to 8 tokens and a prefill of 64.
MAX_ROWS = 64
ENV_VAR = "SPEC_JAX_CPU_KERNEL"
_SOURCE = pathlib.Path(__file__).with_suffix(".cc")
_TARGET = "spec_jax_small_row_matmul"
_ROTATE_TARGET = "spec_jax_rotate"
_ATTEND_TARGET = "spec_jax_attend"
# -w: XLA's FFI headers warn under gcc; a failed build logs its errors.
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# glibc's vector math library, for the attention's exp.
_LIBS = ("-lmvec",)
_log = logging.getLogger(__name__)
# Set by `disabled()`.
_disabled = False


def _cpu_signature() -> str:
  """What -march=native compiles for: the CPU's model and feature flags."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  wanted = ("model name", "flags")
  return "\n".join(next((l for l in lines if l.startswith(w)), "")
                   for w in wanted)


def _compile(compiler: str, path: pathlib.Path):
  """Builds the shared library at `path`, atomically: a concurrent build or an
  interrupted one never leaves a partial file under that name."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
    built = pathlib.Path(scratch) / path.name
    subprocess.run([compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}",
                    str(_SOURCE), *_LIBS, "-o", str(built)],
                   check=True, capture_output=True, text=True)
    os.replace(built, path)


@functools.cache
def _library() -> ctypes.CDLL | None:
  """The compiled kernel, registered with XLA; None where it cannot run."""
  if os.environ.get(ENV_VAR, "1") == "0":
    _log.info("%s=0: the small-row CPU kernel is off; XLA's dot runs.",
              ENV_VAR)
    return None
  if platform.machine() not in ("x86_64", "AMD64"):
    return None
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    _log.warning("No C++ compiler found (set CXX, or install g++): the "
                 "small-row CPU kernel is not built and XLA's dot runs.")
    return None
  key = hashlib.sha256("\0".join(
      (_SOURCE.read_text(), jaxlib.__version__, compiler, *_FLAGS, *_LIBS,
       _cpu_signature())).encode()).hexdigest()[:16]
  cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME",
                                      pathlib.Path.home() / ".cache"))
  path = cache / "spec_jax" / f"cpu_matmul-{key}.so"
  if not path.exists():
    try:
      _compile(compiler, path)
    except (OSError, subprocess.CalledProcessError) as error:
      detail = getattr(error, "stderr", None) or str(error)
      _log.warning("Building the small-row CPU kernel failed, XLA's dot runs "
                   "(%s=0 silences this): %s", ENV_VAR, detail[-2000:])
      return None
  try:
    library = ctypes.cdll.LoadLibrary(str(path))
    library.SmallRowMatmulIsa.restype = ctypes.c_char_p
    jax.ffi.register_ffi_target(
        _TARGET, jax.ffi.pycapsule(library.SmallRowMatmul), platform="cpu")
    jax.ffi.register_ffi_target(
        _ROTATE_TARGET, jax.ffi.pycapsule(library.Rotate), platform="cpu")
    jax.ffi.register_ffi_target(
        _ATTEND_TARGET, jax.ffi.pycapsule(library.Attend), platform="cpu")
  except (OSError, AttributeError) as error:  # a corrupt or foreign file
    _log.warning("Loading the small-row CPU kernel %s failed, XLA's dot runs "
                 "(delete the file to rebuild it): %s", path, error)
    return None
  return library


def isa() -> str | None:
  """The instruction set the kernel was built for, or None when it is off."""
  library = _library()
  return library.SmallRowMatmulIsa().decode() if library else None


def serves(rows: int) -> bool:
  """Whether products of `rows` rows run the kernel here: at most MAX_ROWS
  of them, on one CPU device, with the kernel built and not disabled.

  Decided at trace time. On a mesh of several devices the kernel is bypassed:
  an FFI call has no sharding rule, so XLA would gather its operands.
  """
  return (rows <= MAX_ROWS and not _disabled
          and jax.default_backend() == "cpu" and jax.device_count() == 1
          and _library() is not None)


def applies(x: jax.Array, kernel: jax.Array) -> bool:
  """Whether `model.matmul(x, kernel)` runs the kernel: float32 activations,
  float32 or bfloat16 weights [N, K], and `serves(rows of x)`."""
  return (x.dtype == jnp.float32 and kernel.ndim == 2
          and kernel.dtype in (jnp.float32, jnp.bfloat16)
          and serves(math.prod(x.shape[:-1])))


@contextlib.contextmanager
def disabled():
  """XLA's dot for every product traced inside: the kernel-off side of a
  side-by-side benchmark in one process.

  The choice is made at trace time, so every JAX compilation cache in the
  process is cleared on entry and on exit: no program traced on one side runs
  on the other.
  """
  global _disabled
  before = _disabled
  jax.clear_caches()
  _disabled = True
  try:
    yield
  finally:
    _disabled = before
    jax.clear_caches()


def _require_library(check: str):
  """Raises, naming `check`, when the kernels cannot run here."""
  if _library() is None:
    raise RuntimeError(f"The CPU kernels are not available (off by "
                       f"{ENV_VAR}=0, or not built: see the log); check "
                       f"{check} before calling them.")


@jax.custom_vjp
def small_row_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [M, K] times kernel [N, K] transposed, x in the kernel's dtype: [M, N]
  float32, summed in float32."""
  _require_library("cpu_matmul.applies")
  if x.ndim != 2 or kernel.ndim != 2 or x.shape[1] != kernel.shape[1]:
    raise ValueError(f"small_row_matmul takes x [M, K] and kernel [N, K]; got "
                     f"{x.shape} and {kernel.shape}.")
  out = jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(x, kernel)


# The kernel has no derivative of its own; gradients (rarely of so few rows)
# are XLA's products of the same operands.
def _forward(x, kernel):
  return small_row_matmul(x, kernel), (x, kernel)


def _backward(residuals, grad):  # grad [M, N] float32
  x, kernel = residuals
  grad_x = jnp.einsum("mn,nk->mk", grad, kernel.astype(jnp.float32))
  grad_kernel = jnp.einsum("mn,mk->nk", grad, x.astype(jnp.float32))
  return grad_x.astype(x.dtype), grad_kernel.astype(kernel.dtype)


small_row_matmul.defvjp(_forward, _backward)


@jax.custom_vjp
def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [R, H, D] float32, each row's H heads turned by its cos, sin
  [R, D / 2]: `rotate_by_xla`'s rotation, each element computed the same way
  whatever R is (cpu_matmul.cc says why XLA's is not). Check `serves(R)`
  before calling it."""
  _require_library("cpu_matmul.serves")
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.ffi.ffi_call(_ROTATE_TARGET, out, vmap_method="sequential")(
      x, cos, sin)


def rotate_by_xla(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [..., D] turned by cos, sin [..., D / 2] (broadcast against x's
  leading axes): the "rotate half" pairing of HF checkpoints, dimension i
  turning with i + D / 2, in XLA's ops."""
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin,
                          second * cos + first * sin], -1)


# A rotation's transpose turns the other way: the gradient is the incoming
# gradient turned by -angle. cos and sin, functions of positions alone, get
# none.
def _rotate_forward(x, cos, sin):
  return rotate(x, cos, sin), (cos, sin)


def _rotate_backward(residuals, grad):
  cos, sin = residuals
  return (rotate_by_xla(grad, cos[:, None], -sin[:, None]),
          jnp.zeros_like(cos), jnp.zeros_like(sin))


rotate.defvjp(_rotate_forward, _rotate_backward)


def attend(q, keys, values, own_keys, own_values, slots, visible, scale,
           cap) -> jax.Array:
  """`attention.attend` by the kernel, float32: q [B, T, K, G, D], the cache
  keys and values [B, K, S, D], the pass's own [B, K, T, D] at slots [B, T]
  int32, visible [B, T, S] bool; scale and cap (0: none) np.float32. Each
  query head's sums run over its seen slots in slot order (cpu_matmul.cc).
  Check `serves(B * T)` before calling it."""
  _require_library("cpu_matmul.serves")
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(_ATTEND_TARGET, out, vmap_method="sequential")(
      q, keys, values, own_keys, own_values, slots, visible, scale=scale,
      cap=cap)
