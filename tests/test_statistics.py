"""The tests' own checks, with positive controls: the chi-square every law
test uses rejects what it must, and a skipped test fails a run that requires
the optional packages."""

import os
import subprocess
import sys

import numpy as np

from conftest import REPO, chi_square_p_value, detectable_total_variation


def test_chi_square_accepts_draws_from_the_law():
  rng = np.random.default_rng(0)
  law = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
  counts = np.bincount(rng.choice(5, 20_000, p=law), minlength=5)
  assert chi_square_p_value(counts, law) > 1e-3
  # Expected counts instead of probabilities: the same test.
  assert chi_square_p_value(counts, 20_000 * law) == chi_square_p_value(
      counts, law)


def test_chi_square_rejects_an_impossible_draw():
  """One draw where the law is 0 fails the test, however many others fit."""
  law = np.array([0.5, 0.5, 0.0])
  assert chi_square_p_value(np.array([10_000, 10_000, 1]), law) == 0.0


def test_chi_square_rejects_a_law_off_by_a_little():
  """20,000 draws tell a total-variation distance of 0.03 apart."""
  rng = np.random.default_rng(1)
  law = np.array([0.4, 0.3, 0.2, 0.1])
  wrong = np.array([0.43, 0.3, 0.17, 0.1])
  counts = np.bincount(rng.choice(4, 20_000, p=wrong), minlength=4)
  assert chi_square_p_value(counts, law) < 1e-3


def test_chi_square_pools_rare_cells():
  """Cells expected below 5 are pooled: a rare cell drawn a little too often
  does not fail the test alone, but the pooled tail still counts."""
  law = np.array([0.5, 0.4999, 0.0001])
  assert chi_square_p_value(np.array([5000, 4998, 2]), law) > 1e-3
  assert chi_square_p_value(np.array([4900, 4900, 200]), law) < 1e-6


def test_a_skip_fails_the_run_when_optional_packages_are_required(tmp_path):
  """SPEC_JAX_REQUIRE_OPTIONAL=1 (set by .ci/run) turns a skip for a missing
  package into a failed run; without it the run passes with the skip."""
  (tmp_path / "test_needs_a_package.py").write_text(
      "import pytest\n"
      "def test_needs_it():\n"
      "  pytest.importorskip('a_package_that_is_not_installed')\n"
      "def test_runs():\n  pass\n")
  def run(require):
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"),
           "SPEC_JAX_REQUIRE_OPTIONAL": require}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest",
         "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300)
  assert run("0").returncode == 0
  required = run("1")
  assert required.returncode == 1, required.stdout[-2000:]
  assert "a_package_that_is_not_installed" in required.stdout


def test_detectable_total_variation_is_detected():
  """Any law d away is rejected with probability >= 0.9; here one with mass
  d moved between two cells is, in 200 repeats of 20,000 draws, and one d/2
  away is rejected far less often: the bound has the right size."""
  law = np.array([0.4, 0.3, 0.2, 0.1])
  counts = 20_000 * law
  d = detectable_total_variation(counts, law, 1e-3, power=0.9)
  assert 0.005 < d < 0.05
  wrong = law + d * np.array([1, -1, 0, 0])
  rng = np.random.default_rng(2)
  rejected = [chi_square_p_value(np.bincount(rng.choice(4, 20_000, p=wrong),
                                             minlength=4), law) < 1e-3
              for _ in range(200)]
  assert np.mean(rejected) >= 0.9
  # Half the distance is detected far less often.
  wrong = law + d / 2 * np.array([1, -1, 0, 0])
  rejected = [chi_square_p_value(np.bincount(rng.choice(4, 20_000, p=wrong),
                                             minlength=4), law) < 1e-3
              for _ in range(200)]
  assert np.mean(rejected) < 0.5
