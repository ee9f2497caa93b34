"""Trains an EAGLE head for a target; see configs/train_eagle.py."""

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import train_eagle

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config.")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Data, features, checkpoints and the head.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  train_eagle.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
