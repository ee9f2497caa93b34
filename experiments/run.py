"""The main job: AR and SD on held-out prompts; prints a table, writes JSON.

  python -m experiments.run --config=configs/quickstart.py --workdir=DIR

On many processes (hosts), run the same command on each, adding
--coordinator_address=HOST0:PORT --num_processes=N --process_id=I (or
--distributed alone where JAX detects them: TPU pod slices, Slurm). The mesh
spans every process's devices; only process 0 writes files.
"""

import os
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from experiments import harness
from experiments.harness import compare, loading, plots, records
from spec_jax import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write results.json.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0, for many processes.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "This process's index, 0..num_processes-1.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Initialize jax.distributed even without the flags "
    "above, which JAX then detects (TPU pod slices, Slurm, Open MPI).")
flags.mark_flags_as_required(["config", "workdir"])


def _join_processes() -> None:
  """Starts jax.distributed when the flags ask for many processes."""
  if _DISTRIBUTED.value or any(flag.value is not None for flag in (
      _COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)):
    # CPU processes need collectives that cross process boundaries.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)


def _print_runs(runs: list[dict], tokenizer) -> None:
  """The table, compile times, categories and two completions per run."""
  print(compare.format_table(runs))
  for run in runs:
    print(f"compile seconds (first call less a timed one): AR "
          f"{run['compile_s']['ar']:.1f}, SD {run['compile_s']['sd']:.1f}")
    if "by_category" in run:
      print(compare.format_category_table(run))
  for run in runs:
    for sample in run["samples"][:2]:
      print(f"\n--- T={run['temperature']:g} prompt ---\n{sample['prompt']}"
            f"\n--- SD continuation ---\n"
            f"{tokenizer.decode(sample['sd_tokens'])}")


def main(argv):
  del argv
  harness.setup()
  config = _CONFIG.value
  _join_processes()
  lead = jax.process_index() == 0
  if lead:
    records.check_writable(_WORKDIR.value)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=config.mesh.data,
                                                model=config.mesh.model))
  sharding.check_batch(config.batch_size, mesh)
  start = time.perf_counter()
  loaded = loading.load_models(config, mesh)
  load_s = time.perf_counter() - start
  # With chat questions of several turns, this decodes the earlier replies.
  prompts = loading.load_prompt_set(config, loaded)
  prompts_s = time.perf_counter() - start - load_s
  param_bytes, param_bytes_per_device = sharding.param_bytes(
      loaded.target.model.params)
  if lead:
    print(f"{loaded.describe()}, {len(prompts.texts)} prompts, mesh data="
          f"{mesh.shape['data']} x model={mesh.shape['model']} over "
          f"{jax.process_count()} process(es), models loaded in {load_s:.1f}"
          f" s, prompts in {prompts_s:.1f} s",
          flush=True)
  runs = compare.compare(config, loaded, prompts, mesh)
  if not lead:
    return
  _print_runs(runs, loaded.target.tokenizer)
  path = os.path.join(_WORKDIR.value, "results.json")
  records.write_results(path, config, {
      "mesh": {"data": mesh.shape["data"], "model": mesh.shape["model"]},
      "num_processes": jax.process_count(),
      "target_param_bytes": param_bytes,
      "target_param_bytes_per_device": param_bytes_per_device,
      "load_s": load_s,
      "prompts_s": prompts_s,
      "runs": runs,
  })
  print(f"\nwrote {path}")
  if prompts.categories is not None:
    plots.save_figures(runs, _WORKDIR.value,
                       {"categories.png": plots.categories_figure})
    print(f"wrote {os.path.join(_WORKDIR.value, 'categories.png')}")


if __name__ == "__main__":
  app.run(main)
