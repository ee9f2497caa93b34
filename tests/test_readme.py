"""The README's example runs as written, and its links resolve."""

import re
import subprocess
import sys

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()


@pytest.mark.slow  # about 25 s: two decode loops compile
def test_readme_example_runs():
  (example,) = re.findall(r"```python\n(.*?)```", README, re.S)
  result = subprocess.run([sys.executable, "-c", example], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "tokens_per_cycle" in result.stdout


def test_links_in_the_readme_and_docs_resolve():
  pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
  broken = []
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      path = target.split("#")[0]
      if path and not re.match(r"[a-z]+:", path) and not (
          page.parent / path).exists():
        broken.append(f"{page.relative_to(REPO)}: {target}")
  assert not broken
  assert len(README.splitlines()) <= 300  # an entry point, not a results page
