"""hawk paper on quick settings: JSON keys, orderings, the report, and the notebook runs."""

import copy
import json
import math
from pathlib import Path

import pytest

from sim import paper
from sim.report import comparison_rows, write_report

CONFIGS = ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK", "GGH-Direct")


@pytest.fixture(scope="module")
def result():
    return paper.run_paper(quick=True, workers=2)


def test_json_has_every_key(result, tmp_path, capsys):
    from sim.cli import main

    assert main(["paper", "--quick", "--json", "--out", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    for workload in ("chatbot", "summarization"):
        assert set(CONFIGS) <= set(data["knees"][workload])
        assert set(CONFIGS) <= set(data["throughput_at_knee"][workload])
        assert {"power_ratio", "cost_ratio", "power_ratio_vs_ggh",
                "cost_ratio_vs_ggh"} <= set(data["efficiency"][workload])
    assert {"size_mb", "mechanism", "latency_s", "normalized"} <= set(data["fig9"][0])
    assert {"prefill_ratio", "decode_ratio", "decode_power_ratio",
            "decode_cost_ratio"} <= set(data["table1"])
    assert (tmp_path / "report.md").exists() and (tmp_path / "fig9_transfer.png").exists()


def test_figure9_orderings(result):
    for size in paper.FIG9_SIZES_MB:
        lat = {r["mechanism"]: r["latency_s"] for r in result["fig9"] if r["size_mb"] == size}
        assert lat["GG-Direct"] <= lat["GN-HAWK"] < lat["GG-Host"] < lat["GN-Host"]


def test_table1_directions(result):
    t = result["table1"]
    assert t["prefill_ratio"] > 1 and t["decode_ratio"] > 1      # A100 faster in both
    assert t["decode_power_ratio"] > 1 and t["decode_cost_ratio"] > 1   # NPU more efficient


def test_serving_orderings(result):
    knees = result["knees"]["chatbot"]
    value = {k: (0.0 if v is None or math.isnan(v) else v) for k, v in knees.items()}
    assert value["GG-Direct"] >= value["GN-HAWK"] >= value["GG-Host"] >= value["GN-Host"]
    eff = result["efficiency"]["chatbot"]
    assert eff["power_ratio"] > 1 and eff["cost_ratio"] > 1


def test_report_puts_paper_numbers_beside_ours(result, tmp_path):
    path = write_report(result, tmp_path)
    text = path.read_text()
    assert "| quantity | ours | paper | rel. error |" in text
    rows = {what: err for what, _, _, err in comparison_rows(result)}
    assert abs(rows["Table 1 decode_ratio"]) < 0.15


def test_checks_cover_every_claim_and_fitted_targets_hold(result):
    rows = {r["check"]: r for r in result["checks"]}
    assert len(rows) == len(result["checks"])
    for r in rows.values():
        assert {"ours", "paper", "tolerance", "holds", "fitted"} <= set(r)
    for name in ("GG-Host", "GG-Direct", "GN-HAWK"):
        assert f"chatbot knee {name}" in rows
    assert "chatbot GN-Host never reaches 90% attainment" in rows
    assert "chatbot Table 8 cost_ratio" in rows and not rows["chatbot Table 8 cost_ratio"]["fitted"]
    # the transfer and Table 1 claims do not depend on sweep settings: they hold on quick ones
    for what, r in rows.items():
        if what.startswith(("Fig 9", "Table 1")):
            assert r["holds"], what


def test_checks_fail_when_the_numbers_do(result):
    from sim.paper_checks import checks

    bent = copy.deepcopy(result)
    bent["knees"]["chatbot"].update({"GG-Host": 0.6, "GN-Host": 0.3})
    bent["table1"]["decode_ratio"] = 1.16 * 1.2
    bent["sweeps"]["summarization"]["GN-Direct"]["num_failed_out_of_memory"] = 0
    bent["sweeps"]["chatbot"]["GN-Direct"]["num_failed_out_of_memory"] = 0
    rows = {r["check"]: r["holds"] for r in checks(bent)}
    assert not rows["chatbot knee GG-Host"]
    assert not rows["chatbot GN-Host never reaches 90% attainment"]
    assert not rows["Table 1 decode_ratio"]
    assert not rows["single buffer (GN-Direct) fails requests out of memory under serving load"]


def test_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "notebooks" / "paper.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", startup_timeout=180,
                            resources={"metadata": {"path": str(root)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2
