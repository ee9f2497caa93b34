"""What one target step and one verify cost, against the memory roofline.

For each model: the read bandwidth (the faster of a jitted sum and the
small-row kernel's one-row product, over 1 GiB, timed in the same rounds as
the model's step), the weight bytes, hence the roofline of a step (weight
bytes / bandwidth: a decode step reads every weight once) and the step over
it, paired round by round; the step itself (model call and sampling, over a
filled cache, in a jitted loop as the decode loop runs it); a verify of
gamma + 1 tokens with its rejection step, for each gamma, at batch 1 and at
batch 8, as a ratio to the step at the same batch; the output layer alone;
every matmul weight times M rows by the small-row kernel and by XLA's dot,
for the M where one starts to win (`matmul_crossover`); and AR and SD
(prompt lookup) tokens/s on the same prompts, side by side.
Every time is a median over rounds in which the parts take turns
(`timing.RoundTimer`). A model with `cpu_kernel: False` runs with XLA's dot
in place of the small-row CPU kernel (`spec_jax.cpu_matmul`).

A model with `shape: NAME` (one of `NAMED_SHAPES`) has random weights of a
published model's shapes, timed as a real checkpoint's would be, on any
backend and with nothing downloaded; it has no tokenizer, so no AR/SD
columns.
"""

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.harness import compare, loading, timing
from experiments.harness import config as config_lib
from spec_jax import cpu_matmul
from spec_jax.drafting import Proposal
from spec_jax.io import hf
from spec_jax.model import Model, matmul, xla_matmul
from spec_jax.sampling import Sampling

_log = logging.getLogger(__name__)

GIB = 1 << 30

# The config.json fields that fix each model's shapes, as its Hugging Face
# repository publishes them (HuggingFaceTB/SmolLM2-135M-Instruct,
# meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, google/gemma-3-1b-it);
# `hf.config_from_hf` reads them as it reads a checkpoint's.
NAMED_SHAPES = {
    "smollm2_135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True},
    "llama3_1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True},
    "llama3_8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False},
    "gemma3_1b": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "sliding_window_pattern": 6},
}


def _row_config(config: ml_collections.ConfigDict,
                model_config) -> ml_collections.ConfigDict:
  """The config with one model's overrides (an entry of config.models)."""
  run_config = ml_collections.ConfigDict(config.to_dict())
  run_config.update(model_config)
  return run_config


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, before anything is measured, on a model that cannot
  run: its settings, a `shape` that NAMED_SHAPES lacks, or a named shape
  with a draft model (random weights come with none)."""
  for name, model_config in config.models.items():
    run_config = _row_config(config, model_config)
    config_lib.check(run_config)
    loading.check_drafter(run_config)
    shape = run_config.get("shape")
    if shape is not None and shape not in NAMED_SHAPES:
      raise ValueError(f"models.{name}.shape={shape!r}: choose one of "
                       f"{tuple(NAMED_SHAPES)}.")
    if shape is not None and run_config.drafter == "model":
      raise ValueError(f"models.{name}: a named shape has no draft model; "
                       "set its drafter to ngram or layer_skip.")


def synthetic_model(shape: str, weight_dtype: str | None) -> Model:
  """Random weights of NAMED_SHAPES[shape], matmul weights in weight_dtype
  (None: float32)."""
  config = hf.config_from_hf(NAMED_SHAPES[shape])
  config = dataclasses.replace(config, weight_dtype=weight_dtype)
  return Model.init(config, jax.random.key(0))


@jax.jit
def _sum(x):
  return x.sum()


@jax.jit
def _one_row_product(x):
  """x [N, K] read by the small-row kernel as the weights of a one-row
  product: a streaming read with a little arithmetic per byte."""
  return cpu_matmul.small_row_matmul(jnp.ones((1, x.shape[1]), x.dtype), x)


def read_calls() -> dict:
  """{read name: fn()} over a 1 GiB float32 array: a jitted sum, and (where
  it runs) the small-row kernel's one-row product; the roofline takes the
  faster. Each model times them in the rounds of its step: this machine's
  bandwidth moves by half within an hour, with its neighbours."""
  data = jnp.ones((GIB // 4 // 1024, 1024), jnp.float32)
  reads = {"sum": _sum}
  if cpu_matmul.serves(1):
    reads["kernel"] = _one_row_product
  return {f"read_{name}": functools.partial(read, data)
          for name, read in reads.items()}


@jax.jit
def _output_layer_steps(embedding, x, num_steps):
  """num_steps products of x [B, D] with the output layer [V, D]."""
  def step(_, x):
    logits = matmul(x, embedding)  # as the model multiplies, in its dtypes
    # Feeding every logit back keeps the compiler from hoisting the product
    # or computing only part of it.
    return x + logits.sum(-1, keepdims=True) * 1e-9
  return jax.lax.fori_loop(0, num_steps, step, x)


def _kernel_product(x, kernel):
  return cpu_matmul.small_row_matmul(x.astype(kernel.dtype), kernel)


def matmul_crossover(params, rows, rounds: int) -> dict:
  """{M: {"kernel_s", "xla_s"}}: every matmul weight of `params` (its 2-D
  leaves) times M float32 rows, by the small-row kernel and by XLA's dot, in
  one jitted call each; the rows take turns within each round."""
  weights = [w for w in jax.tree.leaves(params) if w.ndim == 2]
  calls = {}
  for m in rows:
    inputs = {k: jnp.ones((m, k), jnp.float32)
              for k in {w.shape[1] for w in weights}}
    for name, product in (("kernel", _kernel_product), ("xla", xla_matmul)):
      products = jax.jit(lambda ws, xs, product=product: [
          product(xs[w.shape[1]], w) for w in ws])
      calls[m, name] = functools.partial(products, weights, inputs)
  timer = timing.RoundTimer({}, calls)
  for _ in range(rounds):
    timer.time_round()
  seconds = timer.seconds()
  return {str(m): {"kernel_s": seconds[m, "kernel"], "xla_s": seconds[m, "xla"]}
          for m in rows}


def full_width_proposal(draft_tokens, vocab_size: int, cache) -> Proposal:
  """Every row proposing all of draft_tokens [B, gamma]: the full-width
  pass, whatever token the timing loop feeds back as the first draft. Uniform
  q proposes every token; a one-hot q of the first drafts would leave the
  fed-back token unproposed, and a drafter with several verify widths would
  then time the one-token width. A chain's verify never reads the drafter's
  state."""
  probs = jnp.full(draft_tokens.shape + (vocab_size,), 1.0 / vocab_size)
  return Proposal(draft_tokens, probs, state=None, target_cache=cache)


def _timers(config: ml_collections.ConfigDict, target, drafter,
            batch_size: int, gammas, max_len: int) -> dict:
  """{name: fn(num_steps)}: the step, each gamma's verify (as the decode
  loop runs it with this drafter) and the output layer, at one batch size,
  over a filled cache."""
  sampling = Sampling(temperature=0.0)
  key = jax.random.key(0)
  tokens, lengths, _, cache, _ = timing._context(target, batch_size, max_len)  # pylint: disable=protected-access
  steps = {"step": lambda n: timing._decode_steps(  # pylint: disable=protected-access
      target, cache, tokens[:, 0], key, n, sampling)}
  for gamma in gammas:
    proposal = full_width_proposal(tokens[:, :gamma], target.vocab_size,
                                   cache)
    decode_config = config_lib.decode_config(config, 0.0, gamma=gamma)
    steps[f"verify_{gamma}"] = functools.partial(
        timing._verify_steps, target, drafter, proposal, tokens, lengths,  # pylint: disable=protected-access
        key, config=decode_config)
  embedding = target.output_kernel
  x = jnp.ones((batch_size, target.config.d_model), target.config.dtype)
  steps["output_layer"] = lambda n: _output_layer_steps(embedding, x, n)
  return steps


def measure_model(config: ml_collections.ConfigDict, model_config) -> dict:
  """One model's row of bench_step.json."""
  run_config = _row_config(config, model_config)
  with (contextlib.nullcontext() if run_config.get("cpu_kernel", True)
        else cpu_matmul.disabled()):
    return _measure(config, run_config)


def _measure(config, run_config) -> dict:
  shape = run_config.get("shape")
  if shape is None:
    loaded = loading.load_models(run_config)
    target, drafter = loaded.target.model, loaded.drafter
  else:
    target = synthetic_model(shape, run_config.weight_dtype or None)
    drafter = loading.make_drafter(run_config, target)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
  gammas = config_lib.gammas(config)
  read_timer = timing.RoundTimer({}, read_calls())
  timers = {batch_size: timing.RoundTimer(_timers(
      run_config, target, drafter, batch_size, gammas, config.cache_length))
            for batch_size in config.batch_sizes}
  one = timers[config.batch_sizes[0]]
  for _ in range(config.rounds):
    # The reads in the same rounds as the one-row step, just before it: this
    # machine's bandwidth moves by half within an hour with its neighbours,
    # and a step and a read seconds apart see the same machine. The untimed
    # step after them brings back weights that fit the caches (the built-in
    # target's), which a 1 GiB read evicts.
    read_timer.time_round()
    jax.block_until_ready(one.steps["step"](one.short))
    for timer in timers.values():
      timer.time_round()
  reads = {name: GIB / read_timer.per_round(name)  # [rounds] bytes/s
           for name in read_timer.calls}
  bandwidth = np.max(list(reads.values()), axis=0)  # [rounds] the faster read
  step = one.per_round("step")  # [rounds]
  row = {
      "weight_bytes": int(weight_bytes),
      "bandwidth_gb_s": float(np.median(bandwidth)) / 1e9,
      "bandwidth_reads_gb_s": {name.removeprefix("read_"):
                               float(np.median(read)) / 1e9
                               for name, read in reads.items()},
      "step_s": one.seconds()["step"],
      "roofline_s": weight_bytes / float(np.median(bandwidth)),
      # Paired within each round, then the median.
      "step_over_roofline": float(np.median(step * bandwidth / weight_bytes)),
      "output_layer_s": one.seconds()["output_layer"]}
  if shape is None:  # a real model, with a tokenizer and prompts
    run = compare.compare_at(run_config, loaded,
                             loading.load_prompt_set(run_config, loaded), 0.0)
    row.update(ar_tokens_per_s=run["ar"]["tokens_per_s"],
               sd_tokens_per_s=run["sd"]["tokens_per_s"],
               sd_tokens_per_cycle=run["sd"]["tokens_per_cycle"],
               sd_width_cycles=run["sd"]["width_cycles"])
  # Not under cpu_matmul.disabled() (a cpu_kernel: False row): serves says no.
  if config.crossover_rows and cpu_matmul.serves(1):
    row["matmul_crossover"] = matmul_crossover(
        target.params, config.crossover_rows, config.rounds)
  for batch_size, timer in timers.items():
    times = timer.seconds()
    suffix = "" if batch_size == config.batch_sizes[0] else (
        f"_batch{batch_size}")
    row["verify_cost_ratio" + suffix] = {
        str(g): timing.Costs(verify_s=times[f"verify_{g}"],
                             target_step_s=times["step"]).verify_cost_ratio
        for g in gammas}
    row["step_s" + suffix] = times["step"]
  return row


def bench_step(config: ml_collections.ConfigDict) -> dict:
  """{"models": {name: row}} for every installed model of config.models."""
  check_config(config)
  models = {}
  for name, model_config in config.models.items():
    try:
      models[name] = measure_model(config, model_config)
    except loading.NotInstalled as error:  # an optional real model
      _log.info("%s skipped: %s", name, error)
      continue
    row = models[name]
    _log.info("%s: step %.1f ms = %.2fx the roofline (%.1f GB/s); "
              "verify/step %s; AR, SD tok/s %s", name, 1e3 * row["step_s"],
              row["step_over_roofline"], row["bandwidth_gb_s"],
              row["verify_cost_ratio"],
              [round(row[k], 1) for k in ("ar_tokens_per_s", "sd_tokens_per_s")
               if k in row] or "-")
  return {"models": models, "cpu_kernel": cpu_matmul.isa()}


def format_table(report: dict) -> str:
  tokens_per_s = lambda row, key: (f"{row[key]:>8.1f}" if key in row
                                   else f"{'-':>8}")
  lines = [f"{'model':<12} {'step ms':>7} {'/roof':>5} {'out ms':>6}  "
           f"verify/step (b1)          verify/step (b8)          "
           f"{'AR tok/s':>8} {'SD tok/s':>8}"]
  for name, row in report["models"].items():
    ratios = lambda key: " ".join(  # pylint: disable=cell-var-from-loop
        f"{g}:{r:.2f}" for g, r in row.get(key, {}).items())
    lines.append(
        f"{name:<12} {1e3 * row['step_s']:>7.1f} "
        f"{row['step_over_roofline']:>5.2f} "
        f"{1e3 * row['output_layer_s']:>6.2f}  "
        f"{ratios('verify_cost_ratio'):<25} "
        f"{ratios('verify_cost_ratio_batch8'):<25} "
        f"{tokens_per_s(row, 'ar_tokens_per_s')} "
        f"{tokens_per_s(row, 'sd_tokens_per_s')}")
  return "\n".join(lines)
