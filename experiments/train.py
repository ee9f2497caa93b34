"""Trains a target or draft model; see configs/train.py for the commands."""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from spec_jax import training

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and the model.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines drown progress.
  training.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
