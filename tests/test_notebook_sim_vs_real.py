"""The sim-vs-real notebook executes end to end on reduced settings: a quick profile, the fit,
and a validation of a few requests per load against real worker processes."""

from pathlib import Path

import pytest

from tests import needs

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra")
pytest.importorskip("torch")
pytest.importorskip("aiohttp")
needs.mooncake_engine()

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "sim-vs-real.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def test_sim_vs_real_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", startup_timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not any("sim.commands" in c.source for c in code)     # the API, not the command line
    validate = next(c for c in code if c.source.startswith("print(format_result(result))"))
    text = _text(validate)
    for load in ("light load", "knee load"):
        assert load in text
    assert "8 requests paired by id" in text and "ttft_p50_s" in text
    image = next(c for c in code if c.source.startswith("Image("))
    assert "image/png" in image.outputs[0]["data"]
    stages = next(c for c in code if "mean sim - real" in c.source)
    assert "transfer_time_diff" in _text(stages)
