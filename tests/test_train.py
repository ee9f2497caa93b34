"""The draft/target trainer on the project's own source."""

import logging

import jax
import optax

import spec_jax as sj
from experiments.harness import train
from spec_jax import training
from conftest import tiny_train_config


def test_one_training_step_lowers_the_loss():
  config = tiny_train_config()
  model = sj.Model.init(sj.TransformerConfig(
      vocab_size=50, d_model=32, num_layers=1, num_heads=2, d_ff=64,
      max_len=32), jax.random.key(0))
  windows = jax.random.randint(jax.random.key(1), (4, 17), 0, 50)
  config.warmup_steps = 0
  optimizer = train.make_optimizer(config)
  loss_fn = lambda params: training.cross_entropy(
      model.replace(params=params), windows)

  @jax.jit  # Eagerly, op by op, the optimizer's update alone took 7 s.
  def losses(params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return loss, loss_fn(optax.apply_updates(params, updates))

  before, after = losses(model.params)
  assert after < before


def test_training_resumes_after_interruption(tmp_path, caplog):
  caplog.set_level(logging.INFO, logger="experiments")
  train.train(tiny_train_config(num_steps=10), tmp_path)
  caplog.clear()
  train.train(tiny_train_config(num_steps=20), tmp_path)
  out = caplog.text
  assert "resumed from step 10" in out
  assert "step 20/20" in out and "bits per token" in out
