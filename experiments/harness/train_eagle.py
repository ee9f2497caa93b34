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
  3. the head  written to workdir/head (spec_jax.eagle.save_head), which
               `--config.drafter=eagle --config.eagle=DIR/head` loads.

A stage whose output is on disk is skipped, so an interrupted run picks up
where it stopped: inside stage 1 at the next batch, inside stage 2 at the
last checkpoint.
"""

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
from spec_jax import eagle, eagle_training
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
    return eagle_data.FeatureCache.open(path)
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


def greedy_tokens_per_cycle(top1: np.ndarray, gamma: int) -> float:
  """1 + a_1 + a_1 a_2 + ...: tau if draft k is accepted with the held-out
  rate top1[k - 1] given the drafts before it were (the last rate past the
  trained steps)."""
  rates = np.concatenate([top1, np.repeat(top1[-1:], max(0, gamma - len(top1)))])
  return float(1 + np.cumprod(rates[:gamma]).sum())


class _Curve:
  """The learning curve: one record per evaluation, in a JSON file that a
  resumed run truncates to its checkpoint."""

  def __init__(self, path: pathlib.Path, start: int):
    self.path = path
    self.records = []
    if path.exists():
      self.records = [r for r in json.loads(path.read_text())
                      if r["step"] <= start]

  def add(self, record: dict) -> None:
    self.records.append(record)
    records.write_json(self.path, self.records)


def _head_config(config, target) -> eagle.EagleConfig:
  return eagle.EagleConfig.for_target(
      target.config, tuple(config.feature_layers) or None,
      config.reduced_vocab)


def train(config: ml_collections.ConfigDict, workdir) -> eagle.EagleDrafter:
  """Runs every stage (see the module docstring); returns the head."""
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  bundle = loading.load(config.target, name="target")
  target = bundle.model
  head_config = _head_config(config, target)
  cache = features(config, bundle, head_config.feature_layers, workdir)
  num = len(cache.lengths)
  # Held out at random: the cache's rows are in the order they were made
  # (self-distillation batches prompts by length).
  order = np.random.default_rng(config.seed).permutation(num)
  heldout = np.sort(order[:config.eval_sequences])
  train_rows = np.sort(order[config.eval_sequences:])
  vocab_ids = None
  if config.reduced_vocab:
    vocab_ids = jnp.asarray(reduced_vocabulary(
        cache, config.reduced_vocab, target.vocab_size, train_rows))
  tokens_per_step = config.batch_size * config.seq_len
  optimizer = make_optimizer(config)
  params = eagle.init_params(head_config, jax.random.key(config.seed), target,
                             vocab_ids)
  _log.info("%d training sequences, %d held out; %s", len(train_rows),
            len(heldout), eagle.EagleDrafter(target, params, head_config,
                                             vocab_ids).describe())
  state = {"params": params, "opt_state": optimizer.init(params),
           "seconds": np.zeros((), np.float64)}
  manager, start, state = resume(workdir, config.checkpoint_every, state)
  curve = _Curve(workdir / "learning_curve.json", start)
  clock, last = time.perf_counter(), start
  seconds = float(state["seconds"])
  for step in range(start, config.num_steps):
    # Batches depend only on (seed, step), so a resumed run sees the same data.
    rows = np.random.default_rng([config.seed, step]).choice(
        train_rows, config.batch_size, replace=False)
    params, opt_state, metrics = eagle_training.train_step(
        state["params"], state["opt_state"], head_config, target,
        cache.batch(rows), vocab_ids, optimizer, config.ttt_steps)
    done = step + 1
    if done % config.log_every == 0 or done == config.num_steps:
      jax.block_until_ready(metrics)  # steps run ahead of Python otherwise
      elapsed = time.perf_counter() - clock
      seconds += elapsed
      rate = (done - last) / elapsed
      _log.info("step %d/%d  loss %.3f  top1 %s  %.0f tokens/s  ETA %.0f s",
                done, config.num_steps, float(metrics["loss"][0]),
                np.round(np.asarray(metrics["top1"]), 3),
                rate * tokens_per_step, (config.num_steps - done) / rate)
      clock, last = time.perf_counter(), done
    state = {"params": params, "opt_state": opt_state,
             "seconds": np.asarray(seconds, np.float64)}
    if done % config.eval_every == 0 or done == config.num_steps:
      loss, top1 = _evaluate(params, config, head_config, target, cache,
                             heldout, vocab_ids)
      record = {"step": done, "tokens_seen": done * tokens_per_step,
                "train_hours": seconds / 3600, "loss": loss.tolist(),
                "top1": top1.tolist(),
                "greedy_tau_gamma4": greedy_tokens_per_cycle(top1, 4)}
      curve.add(record)
      _log.info("eval step %d  tokens %d  held-out loss %s  greedy "
                "acceptance by draft %s  (tau at gamma 4 about %.2f)", done,
                record["tokens_seen"], np.round(loss, 3), np.round(top1, 3),
                record["greedy_tau_gamma4"])
      clock = time.perf_counter()  # train_hours and tokens/s leave it out
    manager.save(done, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()

  drafter = eagle.EagleDrafter(target, state["params"], head_config,
                               vocab_ids)
  metadata = {"target": config.target, "data": config.data,
              "sequences": len(train_rows),
              "tokens_seen": config.num_steps * tokens_per_step,
              "train_hours": float(state["seconds"]) / 3600,
              "final": curve.records[-1] if curve.records else None,
              "config": config.to_dict()}
  eagle.save_head(workdir / "head", drafter, metadata,
                  config.storage_dtype or None)
  if curve.records:
    plots.save_figures(curve.records, str(workdir),
                       {"learning_curve.png": plots.learning_curve_figure})
  _log.info("wrote %s", workdir / "head")
  return drafter
