"""The config schema: bad fields, renamed fields and bad values are refused
before anything loads."""

import os
import subprocess
import sys

import jax
import pytest

import spec_jax as sj
from experiments.harness import loading, records
from configs import gamma_sweep as sweep_configs
from configs import quickstart as quickstart_configs
from experiments.harness import config as config_lib
from conftest import REPO, run_module


def test_unwritable_workdir_is_refused(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(PermissionError, match="workdir"):
    records.check_writable(str(blocker / "results"))


def test_compilation_cache_follows_jax_variables(tmp_path):
  """The entry points' --compilation_cache is JAX_COMPILATION_CACHE_DIR where
  set (the tests set it, so the processes they start never write to the
  user's cache), else ~/.cache/spec_jax/xla; JAX's threshold for what it
  caches stays its own variable's (the tests cache every program)."""
  code = ("from absl import flags; import jax, experiments.harness; "
          "flags.FLAGS(['x']); experiments.harness.setup(); "
          "print(flags.FLAGS.compilation_cache, "
          "jax.config.jax_persistent_cache_min_compile_time_secs)")
  def cache_settings(env):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True,
                          check=True).stdout.split()
  unset = {k: v for k, v in os.environ.items()
           if not k.startswith("JAX_")}
  assert cache_settings({
      **unset, "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}) == [
          str(tmp_path), "0.0"]
  assert cache_settings(unset) == [
      os.path.expanduser("~/.cache/spec_jax/xla"), "1.0"]


@pytest.mark.parametrize("module, config, flag, message", [
    # A misspelt field names itself.
    ("run", "quickstart", "--config.gama=3", "gama"),
    # A renamed field says the new spelling.
    ("run", "quickstart", "--config.temperature=0", '"temperatures"'),
    ("run", "quickstart", "--config.drafter=medusa", "choose one of"),
    # Bad gammas fail before any loading.
    ("gamma_sweep", "gamma_sweep", "--config.gammas=0,2", "gammas >= 1"),
    ("run", "quickstart", "--config.policy=greedy", "fixed or adaptive"),
])
def test_bad_config_is_refused_with_what_to_change(tmp_path, module, config,
                                                   flag, message):
  result = run_module(f"experiments.{module}",
                      f"--config=configs/{config}.py",
                      f"--workdir={tmp_path}", flag)
  assert result.returncode != 0 and message in result.stderr


def test_old_gamma_range_string_still_works():
  config = sweep_configs.get_config()
  config.gammas = ("1-3",)  # what --config.gammas=1-3 gives a tuple field
  assert config_lib.gammas(config) == (1, 2, 3)


def test_tree_config_builds_a_tree_drafter():
  config = quickstart_configs.get_config()
  config.tree = (3, 2, 1, 1)
  drafter = loading.make_drafter(config, None, sj.Model.init(
      sj.TransformerConfig(vocab_size=17, d_model=16, num_layers=1,
                           num_heads=2, d_ff=32, max_len=64),
      jax.random.key(0)))
  assert drafter.template == sj.TreeTemplate((3, 2, 1, 1))
  config.drafter = "ngram"
  with pytest.raises(ValueError, match="drafter=model"):
    config_lib.check(config)


def test_adaptive_policy_config_gives_the_decode_its_policy():
  config = quickstart_configs.get_config()
  assert config_lib.decode_config(config, 0.0).adaptive is None
  config.policy = "adaptive"
  decode = config_lib.decode_config(config, 0.0)
  assert decode.adaptive == sj.AdaptiveDraftLength()
  # 6 widths at gamma 8 (1, 2, 4, 5, 7, 9); at gamma 2, all 3.
  assert decode.verify_buckets == 6
  assert sj.verification.verify_widths(8, decode.verify_buckets) == (
      1, 2, 4, 5, 7, 9)
  assert sj.verification.verify_widths(2, decode.verify_buckets) == (1, 2, 3)
  config.tree = (2, 1)
  with pytest.raises(ValueError, match="Unset --config.tree"):
    config_lib.check(config)
