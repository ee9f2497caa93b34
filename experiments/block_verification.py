"""Block verification against the token rule on the built-in pair; writes
block_verification.json.

  python -m experiments.block_verification --config=configs/block_verification.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import harness
from experiments.harness import block_verification
from experiments.harness import config as config_lib
from experiments.harness import loading, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write the results.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  config_lib.check(config)
  records.check_writable(_WORKDIR.value)
  loaded, prompts = loading.load_experiment(config)
  print(f"{loaded.describe()}, {len(prompts.texts)} prompts", flush=True)
  rows = block_verification.compare_rules(config, loaded, prompts)
  print(block_verification.format_table(rows))
  path = os.path.join(_WORKDIR.value, "block_verification.json")
  records.write_results(path, config, {"rows": rows})
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
