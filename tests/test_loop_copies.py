"""XLA copies every cache array that a branch of a conditional writes, on
every cycle (at batch 8 a one-token verify then cost 1.6 AR steps). The
compiled decode loop must hold no such copy: its verify switch commits the
keys and values after the branches (verification.verify_proposed)."""

import re

import jax
import jax.numpy as jnp

import spec_jax as sj
from spec_jax import decoding

_CALLS = re.compile(
    r"(?:calls|body|condition|to_apply|branch_computations)=\{?([^}\s,]+"
    r"(?:, [^}\s,]+)*)")


def copies_in_loops(compiled_text: str, shape: str) -> int:
  """How many `copy` instructions of `shape` (e.g. 'f32[2,2,40,8]') run
  inside a while loop of an optimised HLO module, fusions included."""
  bodies, calls = {}, {}
  for computation in re.split(r"\n(?=\S[^\n]*\{\n)", compiled_text):
    name = computation.split(" ", 1)[0].lstrip("%")
    if name == "ENTRY":
      name = computation.split(" ", 2)[1].lstrip("%")
    bodies[name] = computation
    calls[name] = [c.strip().lstrip("%") for group in _CALLS.findall(
        computation) for c in group.split(",")]
  in_loop = set()
  pending = [b.lstrip("%") for text in bodies.values()
             for b in re.findall(r"body=(%?[\w.\-]+)", text)]
  while pending:
    name = pending.pop()
    if name not in in_loop:
      in_loop.add(name)
      pending += calls.get(name, [])
  pattern = re.escape(shape) + r"\{[^}]*\} copy\("
  return sum(len(re.findall(pattern, bodies[n])) for n in in_loop
             if n in bodies)


def test_a_switch_that_writes_its_operand_copies_it():
  """The control: the pattern the loop avoids is seen by the same count."""
  def step(i, cache):
    write = lambda width: lambda c: jax.lax.dynamic_update_slice(
        c, jnp.ones((2, 2, width, 8)), (0, 0, i % 8, 0))
    return jax.lax.switch(i % 3, [write(w) for w in (1, 2, 3)], cache)

  loop = jax.jit(lambda c: jax.lax.fori_loop(0, 5, step, c))
  text = loop.lower(jnp.zeros((2, 2, 40, 8))).compile().as_text()
  assert copies_in_loops(text, "f32[2,2,40,8]") > 0


def test_the_decode_loop_copies_no_cache_array(pair):
  """Prompt lookup, three verify widths, three prompts refilled through two
  rows: neither the width switch nor the refill cond copies a cache."""
  target, _ = pair
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5], [6]])
  config = sj.DecodeConfig(gamma=4, max_new_tokens=8, verify_buckets=3)
  drafter = sj.NgramDrafter(target.vocab_size)
  compiled = decoding.generate_jit.lower(
      jax.random.key(0), target, drafter, prompts, lengths, config,
      2).compile().as_text()
  assert_no_cache_copies(compiled, target.config, prompts, config)


def test_the_adaptive_loop_copies_no_cache_array(pair):
  """A draft model under the adaptive draft length: the loop of plain
  target steps and the draft's catch-up passes copy neither model's cache."""
  target, draft = pair
  prompts, lengths = sj.pad_prompts([[1, 2, 3], [4, 5], [6]])
  config = sj.DecodeConfig(gamma=4, max_new_tokens=8, verify_buckets=3,
                           adaptive=sj.AdaptiveDraftLength())
  compiled = decoding.generate_jit.lower(
      jax.random.key(0), target, sj.ModelDrafter(draft), prompts, lengths,
      config, 2, sj.CycleCosts.of(0.1, [1.0, 2.0, 3.0])).compile().as_text()
  for model in target, draft:
    assert_no_cache_copies(compiled, model.config, prompts, config)


def assert_no_cache_copies(compiled: str, model_config, prompts,
                           config) -> None:
  # The cache holds the prompts, the outputs and one verify pass.
  num_slots = prompts.shape[1] + config.max_new_tokens + config.gamma + 1
  shape = (f"f32[2,{model_config.num_kv_heads},{num_slots},"
           f"{model_config.head_dim}]")
  assert shape in compiled
  assert copies_in_loops(compiled, shape) == 0
