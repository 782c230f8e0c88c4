"""The capacity-planning notebook executes end to end (quick settings)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "capacity_planning.ipynb"


def test_capacity_planning_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", startup_timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    knees = [c for c in nb.cells if c.cell_type == "code"][2]["outputs"][0]["data"]["text/plain"]
    assert "p150a" in knees and "A100" in knees
