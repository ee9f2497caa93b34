"""Training a target or a draft with optax, resumable through orbax.

The draft can learn from the data (cross-entropy) or from the target's own
next-token laws (DistillSpec, Zhou et al. 2023): forward KL, or total
variation distance, which directly maximises alpha = 1 - TVD(p, q).
"""

import math
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from spec_jax import checkpoint, data
from spec_jax.model import Model, TransformerConfig, score


def make_optimizer(config: ml_collections.ConfigDict):
  """AdamW with linear warmup, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=config.warmup_steps,
      decay_steps=max(config.num_steps, config.warmup_steps + 1),
      end_value=config.learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, weight_decay=config.weight_decay))


def cross_entropy(model: Model, windows: jax.Array) -> jax.Array:
  """Mean next-token loss in nats of windows [B, T+1]."""
  logits = score(model, windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, windows[:, 1:]).mean()


def distillation_loss(model: Model, teacher: Model, windows: jax.Array,
                      kind: str) -> jax.Array:
  """Divergence of the student's laws q from the teacher's p, per position."""
  inputs = windows[:, :-1]
  p = jax.nn.softmax(jax.lax.stop_gradient(score(teacher, inputs)))
  log_q = jax.nn.log_softmax(score(model, inputs))
  if kind == "kl":
    return optax.kl_divergence(log_q, p).mean()
  if kind == "tvd":
    return 0.5 * jnp.abs(p - jnp.exp(log_q)).sum(-1).mean()
  raise ValueError(f"distill={kind!r}: use '', 'kl' or 'tvd'.")


def train(config: ml_collections.ConfigDict, workdir: str) -> Model:
  """Trains a model and writes it to workdir/model; resumes if interrupted.

  Returns the trained model.
  """
  workdir = pathlib.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  train_texts, heldout_texts = data.split_texts(
      data.corpus_files(config.corpus), config.heldout_percent)
  if config.tokenizer:
    tokenizer = checkpoint.load_tokenizer(config.tokenizer)
  else:
    tokenizer = data.train_tokenizer(train_texts, config.vocab_size)
  train_tokens = data.encode_corpus(tokenizer, train_texts)
  heldout_tokens = data.encode_corpus(tokenizer, heldout_texts)
  print(f"corpus: {len(train_texts)} train texts ({len(train_tokens)} tokens),"
        f" {len(heldout_texts)} held-out texts ({len(heldout_tokens)} tokens)",
        flush=True)

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
  print(f"model: {model.num_params} parameters", flush=True)

  optimizer = make_optimizer(config)
  state = {"params": model.params, "opt_state": optimizer.init(model.params)}

  def loss_fn(params, windows):
    student = model.replace(params=params)
    if teacher is None:
      return cross_entropy(student, windows)
    return distillation_loss(student, teacher, windows, config.distill)

  @jax.jit
  def train_step(state, windows):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], windows)
    updates, opt_state = optimizer.update(grads, state["opt_state"],
                                          state["params"])
    return {"params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss

  eval_windows = data.random_windows(
      heldout_tokens, config.eval_batches * config.batch_size,
      config.seq_len + 1, np.random.default_rng(0))
  eval_loss = jax.jit(lambda params, w: cross_entropy(
      model.replace(params=params), w))

  def evaluate(params) -> float:
    losses = [eval_loss(params, batch) for batch in
              np.split(eval_windows, config.eval_batches)]
    return float(np.mean(losses))

  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(
          max_to_keep=2, save_interval_steps=config.checkpoint_every))
  start = 0
  if manager.latest_step() is not None:
    start = manager.latest_step()
    state = manager.restore(start, args=ocp.args.StandardRestore(state))
    print(f"resumed from step {start}", flush=True)

  tokens_per_step = config.batch_size * config.seq_len
  clock, last_step = time.perf_counter(), start
  for step in range(start, config.num_steps):
    # Batches depend only on (seed, step), so a resumed run sees the same data.
    rng = np.random.default_rng([config.seed, step])
    windows = data.random_windows(train_tokens, config.batch_size,
                                  config.seq_len + 1, rng)
    state, loss = train_step(state, windows)
    done = step + 1
    if done % config.log_every == 0 or done == config.num_steps:
      elapsed = time.perf_counter() - clock
      rate = (done - last_step) / elapsed
      print(f"step {done}/{config.num_steps}  loss {float(loss):.3f}  "
            f"{rate * tokens_per_step:.0f} tokens/s  "
            f"ETA {(config.num_steps - done) / rate:.0f} s", flush=True)
      clock, last_step = time.perf_counter(), done
    if done % config.eval_every == 0 or done == config.num_steps:
      heldout = evaluate(state["params"])
      print(f"step {done}  eval loss {heldout:.3f} nats, "
            f"{heldout / math.log(2):.3f} bits per token", flush=True)
    manager.save(done, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()

  model = model.replace(params=state["params"])
  checkpoint.save_model(workdir / "model", model, tokenizer,
                        storage_dtype=config.storage_dtype or None)
  print(f"wrote {workdir / 'model'}", flush=True)
  return model
