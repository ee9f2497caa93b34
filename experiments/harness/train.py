"""Training a target or a draft on the corpus, resumable through orbax.

The objectives and the update step are the engine's (spec_jax.training); this
is the loop around them: data, evaluation, checkpoints and progress.
"""

import logging
import math
import pathlib
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from experiments.harness import data
from spec_jax import training
from spec_jax.io import checkpoint
from spec_jax.model import Model, TransformerConfig

_log = logging.getLogger(__name__)


def make_optimizer(config: ml_collections.ConfigDict):
  return training.make_optimizer(
      learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
      num_steps=config.num_steps, grad_clip=config.grad_clip,
      weight_decay=config.weight_decay)


def _corpus(config: ml_collections.ConfigDict):
  """(tokenizer, train tokens, held-out tokens)."""
  train_texts, heldout_texts = data.split_texts(
      data.corpus_files(config.corpus), config.heldout_percent)
  if config.tokenizer:
    tokenizer = checkpoint.load_tokenizer(config.tokenizer)
  else:
    tokenizer = data.train_tokenizer(train_texts, config.vocab_size)
  train_tokens = data.encode_corpus(tokenizer, train_texts)
  heldout_tokens = data.encode_corpus(tokenizer, heldout_texts)
  _log.info("corpus: %d train texts (%d tokens), %d held-out texts (%d "
            "tokens)", len(train_texts), len(train_tokens),
            len(heldout_texts), len(heldout_tokens))
  return tokenizer, train_tokens, heldout_tokens


def _models(config: ml_collections.ConfigDict, tokenizer):
  """(the model to train, the teacher or None)."""
  if config.init_from:  # Fine-tune, e.g. distil a draft trained on data.
    model, init_tokenizer = checkpoint.load_model(config.init_from)
    if init_tokenizer.to_str() != tokenizer.to_str():
      raise ValueError(f"init_from={config.init_from!r} has another tokenizer.")
  else:
    model = Model.init(
        TransformerConfig(vocab_size=tokenizer.get_vocab_size(),
                          **config.model), jax.random.key(config.seed))
  teacher = None
  if config.distill:
    teacher, teacher_tokenizer = checkpoint.load_model(config.teacher)
    if teacher_tokenizer.to_str() != tokenizer.to_str():
      raise ValueError("the teacher's tokenizer differs from this model's; "
                       f"set tokenizer={config.teacher!r}.")
  _log.info("model: %d parameters", model.num_params)
  return model, teacher


class _Progress:
  """Logs loss, tokens/s and the ETA every log_every steps."""

  def __init__(self, config, start: int):
    self.config, self.clock, self.last_step = config, time.perf_counter(), start

  def step(self, done: int, loss) -> None:
    config = self.config
    if done % config.log_every and done != config.num_steps:
      return
    rate = (done - self.last_step) / (time.perf_counter() - self.clock)
    _log.info("step %d/%d  loss %.3f  %.0f tokens/s  ETA %.0f s", done,
              config.num_steps, float(loss),
              rate * config.batch_size * config.seq_len,
              (config.num_steps - done) / rate)
    self.clock, self.last_step = time.perf_counter(), done


def resume(workdir: pathlib.Path, every: int, state):
  """(orbax manager of workdir/checkpoints saving every `every` steps, the
  step to start from, the state to start from: the latest checkpoint's, or
  `state` when there is none)."""
  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                           save_interval_steps=every))
  start = manager.latest_step() or 0
  if start:
    state = manager.restore(start, args=ocp.args.StandardRestore(state))
    _log.info("resumed from step %d", start)
  return manager, start, state


def train(config: ml_collections.ConfigDict, workdir: str) -> Model:
  """Trains a model and writes it to workdir/model; resumes if interrupted.

  Returns the trained model.
  """
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  tokenizer, train_tokens, heldout_tokens = _corpus(config)
  model, teacher = _models(config, tokenizer)
  optimizer = make_optimizer(config)
  state = {"params": model.params, "opt_state": optimizer.init(model.params)}
  eval_windows = np.split(data.random_windows(
      heldout_tokens, config.eval_batches * config.batch_size,
      config.seq_len + 1, np.random.default_rng(0)), config.eval_batches)
  eval_loss = jax.jit(training.cross_entropy)

  manager, start, state = resume(workdir, config.checkpoint_every, state)
  progress = _Progress(config, start)
  for step in range(start, config.num_steps):
    # Batches depend only on (seed, step), so a resumed run sees the same data.
    windows = data.random_windows(train_tokens, config.batch_size,
                                  config.seq_len + 1,
                                  np.random.default_rng([config.seed, step]))
    trained, opt_state, loss = training.train_step(
        model.replace(params=state["params"]), state["opt_state"], windows,
        optimizer, teacher, config.distill)
    state = {"params": trained.params, "opt_state": opt_state}
    done = step + 1
    progress.step(done, loss)
    if done % config.eval_every == 0 or done == config.num_steps:
      heldout = float(np.mean([eval_loss(trained, w) for w in eval_windows]))
      _log.info("step %d  eval loss %.3f nats, %.3f bits per token", done,
                heldout, heldout / math.log(2))
    manager.save(done, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()

  model = model.replace(params=state["params"])
  checkpoint.save_model(workdir / "model", model, tokenizer,
                        storage_dtype=config.storage_dtype or None)
  _log.info("wrote %s", workdir / "model")
  return model
