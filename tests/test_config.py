"""The config schema: bad fields, renamed fields and bad values are refused
before anything loads."""

import jax
import pytest

import spec_jax as sj
from experiments.harness import loading, records
from configs import gamma_sweep as sweep_configs
from configs import quickstart as quickstart_configs
from experiments.harness import config as config_lib
from conftest import run_module


def test_unwritable_workdir_is_refused(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(PermissionError, match="workdir"):
    records.check_writable(str(blocker / "results"))


def test_unknown_config_field_is_refused(tmp_path):
  result = run_module("experiments.run", "--config=configs/quickstart.py",
                      f"--workdir={tmp_path}", "--config.gama=3")
  assert result.returncode != 0 and "gama" in result.stderr


def test_gamma_sweep_refuses_bad_gammas_before_loading(tmp_path):
  result = run_module("experiments.gamma_sweep",
                      "--config=configs/gamma_sweep.py", f"--workdir={tmp_path}",
                      "--config.gammas=0,2")
  assert result.returncode != 0 and "gammas >= 1" in result.stderr


def test_renamed_field_says_the_new_spelling(tmp_path):
  result = run_module("experiments.run", "--config=configs/quickstart.py",
                      f"--workdir={tmp_path}", "--config.temperature=0")
  assert result.returncode != 0 and '"temperatures"' in result.stderr


def test_old_gamma_range_string_still_works():
  config = sweep_configs.get_config()
  config.gammas = ("1-3",)  # what --config.gammas=1-3 gives a tuple field
  assert config_lib.gammas(config) == (1, 2, 3)


def test_unknown_drafter_is_refused(tmp_path):
  result = run_module("experiments.run", "--config=configs/quickstart.py",
                      f"--workdir={tmp_path}", "--config.drafter=medusa")
  assert result.returncode != 0 and "choose one of" in result.stderr


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
