"""What training a draft optimises: optax objectives and one update step.

The draft can learn from the data (cross-entropy) or from the target's own
next-token laws (DistillSpec, Zhou et al. 2023): forward KL, or total
variation distance, which directly maximises alpha = 1 - TVD(p, q). The
resumable loop around `train_step` (data, checkpoints, progress) is the
harness's, in experiments/harness/train.py.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from spec_jax.model import Model, score

DISTILL_LOSSES = ("", "kl", "tvd")


def make_optimizer(*, learning_rate: float, warmup_steps: int, num_steps: int,
                   grad_clip: float, weight_decay: float):
  """AdamW with linear warmup, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(num_steps, warmup_steps + 1),
      end_value=learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(grad_clip),
      optax.adamw(schedule, weight_decay=weight_decay))


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
  raise ValueError(f"distill={kind!r}: use one of {DISTILL_LOSSES}.")


def loss(model: Model, windows: jax.Array, teacher: Model | None = None,
         distill: str = "") -> jax.Array:
  """Cross-entropy on the data, or the divergence from a teacher."""
  if teacher is None:
    return cross_entropy(model, windows)
  return distillation_loss(model, teacher, windows, distill)


@functools.partial(jax.jit, static_argnames=("optimizer", "distill"))
def train_step(model: Model, opt_state, windows: jax.Array, optimizer,
               teacher: Model | None = None, distill: str = ""):
  """One optimizer update on windows [B, T+1]; returns the updated model,
  optimizer state and the loss before the update."""
  value, grads = jax.value_and_grad(
      lambda params: loss(model.replace(params=params), windows, teacher,
                          distill))(model.params)
  updates, opt_state = optimizer.update(grads, opt_state, model.params)
  return (model.replace(params=optax.apply_updates(model.params, updates)),
          opt_state, value)
