"""The notebooks run top to bottom, in their small mode, so they cannot rot."""

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]'")
nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[test]'")

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart", "gamma_ablation"])
def test_notebook_runs_top_to_bottom(name, monkeypatch):
  monkeypatch.setenv("SPEC_JAX_NOTEBOOK_SMOKE", "1")
  notebook = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
  # The kernel inherits this environment and starts in the repository root,
  # as a clone on Colab would.
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(REPO)}}).execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == "code"
             for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  if name == "gamma_ablation":
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3
