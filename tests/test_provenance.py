"""Every results file the docs publish names the commit that wrote it.

A results file (`records.write_results`) records `code_version`, the git
commit of the checkout that produced it, with "+dirty" when that checkout
had uncommitted changes. A published number must be reproducible from a
commit of this history: so every JSON file under docs/results/ carries a
clean code version that is an ancestor of HEAD.
"""

import json
import re
import subprocess

import pytest

from conftest import REPO

RESULTS = sorted((REPO / "docs" / "results").rglob("*.json"))


def in_history(commit: str) -> bool:
  return subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"],
                        cwd=REPO, capture_output=True).returncode == 0


def provenance_error(record) -> str | None:
  """Why a results file's record cannot be traced, or None if it can."""
  if not isinstance(record, dict) or "code_version" not in record:
    return "records no code_version"
  version = record["code_version"]
  if version.endswith("+dirty"):
    return f"was written by uncommitted code ({version})"
  if not re.fullmatch(r"[0-9a-f]{40}", version):
    return f"names no commit ({version!r})"
  if not in_history(version):
    return f"names {version}, which is not a commit of this history"
  return None


@pytest.fixture(scope="module", autouse=True)
def _needs_history():
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                        capture_output=True, text=True)
  assert head.returncode == 0, "these tests read the git history"


def test_every_results_file_names_a_commit_in_the_history():
  assert RESULTS
  errors = [f"{path.relative_to(REPO)} {error}" for path in RESULTS
            if (error := provenance_error(json.loads(path.read_text())))]
  assert not errors, "\n".join(errors)


def test_untraceable_records_are_caught():
  """Positive controls: each way a record can fail is reported."""
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                        capture_output=True, text=True).stdout.strip()
  assert provenance_error({"code_version": head}) is None
  assert "uncommitted" in provenance_error({"code_version": head + "+dirty"})
  assert "not a commit" in provenance_error({"code_version": "0" * 40})
  assert "names no commit" in provenance_error({"code_version": "main"})
  assert "no code_version" in provenance_error([{"step": 1}])
