"""The capacity-planning notebook executes end to end (quick settings), its decode options
reach knees that differ where their hardware does, it says what binds each, plans the cheapest
cluster for a load, maps where disaggregation pays off and compares two policies on a bursty
multi-customer workload, through the package's functions (``sim.runs``), not the command
line."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the test extra")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the test extra")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "capacity_planning.ipynb"


def test_capacity_planning_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", startup_timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    knees = code[1]["outputs"][0]["data"]["text/plain"]
    assert "p150a" in knees and "A100" in knees
    binds = code[2]["outputs"][0]["data"]["text/plain"]
    assert "binds" in binds and "slo_missed_past_knee" in binds
    text = {c.source: "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                              for o in c["outputs"]) for c in code}
    picks = next(t for s, t in text.items() if s.startswith("{pick: planned[pick]"))
    assert "'cheapest': '" in picks, "the plan names a cheapest configuration"
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]
               if c.source.startswith("plan_figure("))
    winners = next(t for s, t in text.items() if s.startswith("pd.DataFrame(rows)"))
    assert "aggregated" in winners and "code" in winners     # the map's table, every workload
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]
               if c.source.startswith("map_figure("))
    effects = next(t for s, t in text.items() if "compare(runs," in s)
    assert "ttft_p90_s[quiet-1,quiet-2,quiet-3]" in effects and "ci_low" in effects
    assert "'keep': '" in text["result['verdict']"]
    assert list(tmp_path.iterdir()) == []           # the notebook writes no files


def test_decode_options_differ_where_hardware_does_and_binding_is_named():
    """Behind a prefill tier that does not bind, one and two p150a instances and a 4x A100
    instance reach different knees, each with a named binding; behind the paper's single
    prefill instance, prefill binds."""
    from sim.paper.experiments import serving_config
    from sim.paper.report import what_binds
    from sim.runs.sweep import summarize_sweep, sweep
    from traces.workloads import WORKLOADS

    rates = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0]
    tier = {"cluster.prefill.num_instances": 16, "workload.num_requests": 400}
    options = {
        "p150a": serving_config("GN-HAWK", "summarization").replace(**tier),
        "2x p150a": serving_config("GN-HAWK", "summarization").replace(
            **tier, **{"cluster.decode.num_instances": 2}),
        "a100": serving_config("GG-Direct", "summarization").replace(**tier),
        "one prefill": serving_config("GN-HAWK", "summarization").replace(
            **{"workload.num_requests": 400}),
    }
    spec = WORKLOADS["summarization"]
    out = {name: what_binds(summarize_sweep(sweep(config, rates, workers=1, progress=False)),
                            spec.ttft_slo_s, spec.tpot_slo_s)
           for name, config in options.items()}
    assert out["p150a"]["knee_rate"] < out["2x p150a"]["knee_rate"] < out["a100"]["knee_rate"]
    assert out["one prefill"]["binds"].startswith("prefill")
    assert not out["p150a"]["binds"].startswith("prefill")
