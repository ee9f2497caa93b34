"""Training an EAGLE head for a target, resumable at every stage.

  1. features  the target's features and top logits over its training
               sequences, cached on disk (eagle_data.FeatureCache): its own
               replies to instructions, recorded as it generates them
               (self-distillation; a chat model's instructions are partly
               its own requests), or one pass over corpus windows;
  2. training  training-time test (spec_jax.eagle_training) with optax and
               orbax checkpoints; the held-out greedy acceptance by draft
               position is logged and written to learning_curve.json (and
               learning_curve.png at the end);
  3. the head  written to workdir/head in SpecForge's layout
               (spec_jax.save_eagle3), which vLLM, SGLang and SpecForge
               load, and `--config.drafter=eagle3 --config.eagle=DIR/head`.

A stage whose output is on disk is skipped, so an interrupted run picks up
where it stopped: inside stage 1 at the next batch, inside stage 2 at the
last checkpoint.
"""

import dataclasses
import json
import logging
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from experiments.harness import eagle_data, loading, plots, records
from experiments.harness.train import make_optimizer, resume
from spec_jax import eagle, eagle_training, theory
from spec_jax.io import eagle3
from spec_jax.io.bundle import ModelBundle

_log = logging.getLogger(__name__)


def _prompts(config: ml_collections.ConfigDict, bundle: ModelBundle,
             workdir: pathlib.Path) -> list[list[int]]:
  """What the target replies to (self-distillation): for a chat model,
  user_request_fraction of num_sequences requests it writes itself and the
  rest made from the corpus; for a base model, windows of the corpus."""
  if bundle.chat_template is None:
    return eagle_data.corpus_prompts(bundle.tokenizer, config.num_sequences,
                                     config.prompt_tokens, config.seed,
                                     config.corpus)
  own = round(config.user_request_fraction * config.num_sequences)
  requests = eagle_data.instructions(config.num_sequences - own, config.seed,
                                     config.corpus)
  if own:
    requests += eagle_data.user_requests(
        bundle, own, workdir / "user_requests",
        max_tokens=config.request_tokens,
        batch_size=config.generate_batch_size, seed=config.seed)
  return eagle_data.chat_prompts(bundle, requests)


def features(config: ml_collections.ConfigDict, bundle: ModelBundle,
             layers: tuple[int, ...],
             workdir: pathlib.Path) -> eagle_data.FeatureCache:
  """The feature cache at workdir/features, made on the first run."""
  path = workdir / "features"
  if path.exists():
    return eagle_data.FeatureCache.open(path, layers)
  if config.data == "corpus":
    return eagle_data.extract_features(
        bundle.model, eagle_data.corpus_sequences(
            bundle.tokenizer, config.num_sequences, config.seq_len,
            config.seed, config.corpus),
        path, layers=layers, length=config.seq_len, top_k=config.top_k,
        batch_size=config.feature_batch_size)
  if config.data == "self_distill":
    return eagle_data.distill_features(
        bundle, _prompts(config, bundle, workdir), path, layers=layers,
        length=config.seq_len, top_k=config.top_k,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.generate_batch_size,
        temperature=config.generate_temperature, seed=config.seed)
  raise ValueError(f"data={config.data!r}: use 'corpus' or 'self_distill'.")


def reduced_vocabulary(cache: eagle_data.FeatureCache, size: int,
                       vocab_size: int, rows) -> np.ndarray:
  """[size] int32: the tokens most often the target's argmax in `rows`
  (where the head is trained: from loss_from)."""
  counts = np.zeros(vocab_size, np.int64)
  for row in rows:
    argmax = np.asarray(
        cache.top_ids[row, cache.loss_from[row]:cache.lengths[row], 0])
    counts += np.bincount(argmax, minlength=vocab_size)
  return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def _evaluate(params, config, head_config, target, cache, rows, vocab_ids):
  """Mean held-out loss and greedy acceptance [ttt_steps] by draft."""
  results = []
  for first in range(0, len(rows), config.batch_size):
    batch = cache.batch(rows[first:first + config.batch_size])
    results.append(eagle_training.evaluate(
        params, head_config, target, batch, vocab_ids, config.ttt_steps)[1])
  top1 = np.mean([np.asarray(r["top1"]) for r in results], 0)
  loss = np.mean([np.asarray(r["loss"]) for r in results], 0)
  return loss, top1


class _Curve:
  """The learning curve: one record per evaluation, in a results file (with
  the code version and config) that a resumed run truncates to its
  checkpoint."""

  def __init__(self, path: pathlib.Path, config, start: int):
    self.path, self.config = path, config
    self.records = []
    if path.exists():
      self.records = [r for r in json.loads(path.read_text())["evaluations"]
                      if r["step"] <= start]

  def add(self, record: dict) -> None:
    self.records.append(record)
    records.write_results(str(self.path), self.config,
                          {"evaluations": self.records})


def _head_config(config, target) -> eagle.EagleConfig:
  return eagle.EagleConfig.for_target(
      target.config, tuple(config.feature_layers) or None,
      config.reduced_vocab or None, config.fc_norm)


@dataclasses.dataclass(frozen=True)
class _Data:
  """What the training steps read: the target, the head's settings, and the
  feature cache with its training and held-out rows."""

  target: object  # spec_jax.Model
  head_config: eagle.EagleConfig
  cache: eagle_data.FeatureCache
  train_rows: np.ndarray  # [N_train] row indices into the cache.
  heldout: np.ndarray  # [N_eval]
  vocab_ids: jax.Array | None  # [V_draft] the reduced vocabulary, if any.


def _prepare(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> _Data:
  """Loads the target, makes (or reads) the feature cache and splits it."""
  bundle = loading.load(config.target, name="target")
  target = bundle.model
  head_config = _head_config(config, target)
  cache = features(config, bundle, head_config.feature_layers, workdir)
  # Held out at random: the cache's rows are in the order they were made
  # (self-distillation batches prompts by length).
  order = np.random.default_rng(config.seed).permutation(len(cache.lengths))
  heldout = np.sort(order[:config.eval_sequences])
  train_rows = np.sort(order[config.eval_sequences:])
  vocab_ids = None
  if config.reduced_vocab:
    vocab_ids = jnp.asarray(reduced_vocabulary(
        cache, config.reduced_vocab, target.vocab_size, train_rows))
  return _Data(target, head_config, cache, train_rows, heldout, vocab_ids)


def _tokens_per_step(config: ml_collections.ConfigDict) -> int:
  return config.batch_size * config.seq_len


class _Progress:
  """Training seconds and throughput, logged every config.log_every steps;
  evaluations are left out of both."""

  def __init__(self, config: ml_collections.ConfigDict, start: int,
               seconds: float):
    self.config, self.last, self.seconds = config, start, seconds
    self.clock = time.perf_counter()

  def step_done(self, done: int, metrics) -> None:
    config = self.config
    if done % config.log_every and done != config.num_steps:
      return
    jax.block_until_ready(metrics)  # steps run ahead of Python otherwise
    elapsed = time.perf_counter() - self.clock
    self.seconds += elapsed
    rate = (done - self.last) / elapsed
    _log.info("step %d/%d  loss %.3f  top1 %s  %.0f tokens/s  ETA %.0f s",
              done, config.num_steps, float(metrics["loss"][0]),
              np.round(np.asarray(metrics["top1"]), 3),
              rate * _tokens_per_step(config),
              (config.num_steps - done) / rate)
    self.clock, self.last = time.perf_counter(), done

  def restart_clock(self) -> None:
    self.clock = time.perf_counter()


def _evaluation(config, data: _Data, params, done: int,
                seconds: float) -> dict:
  """The learning curve's record at step `done`, logged."""
  loss, top1 = _evaluate(params, config, data.head_config, data.target,
                         data.cache, data.heldout, data.vocab_ids)
  record = {"step": done, "tokens_seen": done * _tokens_per_step(config),
            "train_hours": seconds / 3600, "loss": loss.tolist(),
            "top1": top1.tolist(),
            "greedy_tau_gamma4": float(
                theory.tokens_per_cycle_from_conditional_acceptance(top1,
                                                                    4))}
  _log.info("eval step %d  tokens %d  held-out loss %s  greedy "
            "acceptance by draft %s  (tau at gamma 4 about %.2f)", done,
            record["tokens_seen"], np.round(loss, 3), np.round(top1, 3),
            record["greedy_tau_gamma4"])
  return record


def _train_steps(config, data: _Data, params, workdir: pathlib.Path):
  """Trains from the last checkpoint to config.num_steps, evaluating and
  checkpointing as configured. Returns (final state, learning curve)."""
  optimizer = make_optimizer(config)
  state = {"params": params, "opt_state": optimizer.init(params),
           "seconds": np.zeros((), np.float64)}
  manager, start, state = resume(workdir, config.checkpoint_every, state)
  curve = _Curve(workdir / "learning_curve.json", config, start)
  progress = _Progress(config, start, float(state["seconds"]))
  for step in range(start, config.num_steps):
    # Batches depend only on (seed, step), so a resumed run sees the same data.
    rows = np.random.default_rng([config.seed, step]).choice(
        data.train_rows, config.batch_size, replace=False)
    params, opt_state, metrics = eagle_training.train_step(
        state["params"], state["opt_state"], data.head_config, data.target,
        data.cache.batch(rows), data.vocab_ids, optimizer, config.ttt_steps)
    done = step + 1
    progress.step_done(done, metrics)
    state = {"params": params, "opt_state": opt_state,
             "seconds": np.asarray(progress.seconds, np.float64)}
    if done % config.eval_every == 0 or done == config.num_steps:
      curve.add(_evaluation(config, data, params, done, progress.seconds))
      progress.restart_clock()  # train_hours and tokens/s leave it out
    manager.save(done, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  return state, curve


def train(config: ml_collections.ConfigDict, workdir) -> eagle.EagleDrafter:
  """Runs every stage (see the module docstring); returns the head."""
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  data = _prepare(config, workdir)
  params = eagle.init_params(data.head_config, jax.random.key(config.seed),
                             data.target, data.vocab_ids)
  _log.info("%d training sequences, %d held out; %s", len(data.train_rows),
            len(data.heldout), eagle.EagleDrafter(
                data.target, params, data.head_config,
                data.vocab_ids).describe())
  state, curve = _train_steps(config, data, params, workdir)
  drafter = eagle.EagleDrafter(data.target, state["params"], data.head_config,
                               data.vocab_ids)
  metadata = {"code_version": records.code_version(),
              "target": config.target, "data": config.data,
              "sequences": len(data.train_rows),
              "tokens_seen": config.num_steps * _tokens_per_step(config),
              "train_hours": float(state["seconds"]) / 3600,
              "device": jax.devices()[0].device_kind,
              "final": curve.records[-1] if curve.records else None,
              "config": config.to_dict()}
  eagle3.save_eagle3(drafter, workdir / "head",
                     config.storage_dtype or "float32", metadata)
  if curve.records:
    plots.save_figures(curve.records, str(workdir),
                       {"learning_curve.png": plots.learning_curve_figure})
  _log.info("wrote %s", workdir / "head")
  return drafter
