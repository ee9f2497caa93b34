"""Benchmark: fused-loop efficiency and SD vs AR tokens/s; writes JSON.

  python -m experiments.bench_loop --config=configs/bench_loop.py --workdir=DIR
"""

import os

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import spec_jax as sj
from spec_jax import benchmark, records

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write bench_loop.json.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines drown progress.
  config = _CONFIG.value
  target_key, draft_key, prompt_key, key = jax.random.split(
      jax.random.key(config.seed), 4)
  target = sj.Model.init(sj.TransformerConfig(**config.target), target_key)
  draft = sj.Model.init(sj.TransformerConfig(**config.draft), draft_key)
  print(f"target {target.num_params} params, draft {draft.num_params} params")
  rows = []
  for batch_size in config.batch_sizes:
    prompts = jax.random.randint(prompt_key, (batch_size, config.prompt_len),
                                 0, target.vocab_size)
    lengths = [config.prompt_len] * batch_size
    for gamma in config.gammas:
      decode = sj.DecodeConfig(
          gamma=gamma, max_new_tokens=config.max_new_tokens,
          sampling=sj.Sampling(temperature=config.temperature))
      row = benchmark.loop_efficiency(key, target, draft, prompts, lengths,
                                      decode, repeats=config.repeats)
      print(f"batch {batch_size} gamma {gamma}: loop efficiency "
            f"{row['loop_efficiency']:.2f} (parts "
            f"{1e3 * row['sum_of_parts_s']:.2f} ms, fused cycle "
            f"{1e3 * row['fused_cycle_s']:.2f} ms), "
            f"c={row['draft_cost_ratio_c']:.3f}, verify/target step "
            f"{row['verify_cost_ratio']:.2f}, SD {row['sd_tokens_per_s']:.0f} "
            f"tok/s, AR {row['ar_tokens_per_s']:.0f} tok/s", flush=True)
      rows.append(row)
  path = os.path.join(_WORKDIR.value, "bench_loop.json")
  records.write_json(path, {
      "code_version": records.code_version(),
      "config": config.to_dict(),
      "device": str(jax.devices()[0]),
      "target_params": target.num_params,
      "draft_params": draft.num_params,
      "rows": rows,
  })
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
