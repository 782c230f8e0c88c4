"""The real-mode notebook executes end to end on reduced settings (a few requests)."""

from pathlib import Path

import pytest

from tests import needs

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra")
pytest.importorskip("torch")
needs.mooncake_engine()

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "real-mode.ipynb"


def test_real_mode_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", startup_timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outcome = [c for c in nb.cells if c.cell_type == "code"][3]["outputs"][0]["data"]["text/plain"]
    assert "'num_requests': 6" in outcome and "'num_finished': 6" in outcome
