"""What ``hawk`` writes: strict JSON, output folders refused up front, quiet broken pipes,
``--rate-scale`` / ``--window`` for traces, and the capacity planner's numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.commands.main import main
from traces.jsonout import dumps, jsonable

REPO = Path(__file__).resolve().parents[1]


def strict_json(text: str):
    """Parse as a strict JSON reader would: bare NaN / Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: bare {name}")
    return json.loads(text, parse_constant=refuse)


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return strict_json(capsys.readouterr().out)


def write_trace(path: Path, rows, header="arrival_at,num_prompt_tokens,num_output_tokens"):
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


# --- strict JSON ---------------------------------------------------------------------------

def test_dumps_writes_null_for_nan_and_infinity():
    import numpy as np

    text = dumps({"a": float("nan"), "b": [float("inf"), np.float64(-np.inf)],
                  "c": np.int64(3), 4: np.array([1.5, np.nan])})
    assert strict_json(text) == {"a": None, "b": [None, None], "c": 3, "4": [1.5, None]}
    assert jsonable((1, 2.0)) == [1, 2.0]


def test_simulate_json_is_strict_when_no_request_finishes(tmp_path, capsys):
    # Every prompt is longer than the model's context: no TTFT exists, percentiles are NaN.
    path = write_trace(tmp_path / "long.csv", [(0.0, 10_000_000, 5), (1.0, 10_000_000, 5)])
    summary = run_json(capsys, "simulate", "--trace", str(path), "--json")
    assert summary["num_finished"] == 0 and summary["ttft_p50_s"] is None
    assert main(["simulate", "--trace", str(path), "--out", str(tmp_path / "run")]) == 0
    assert strict_json((tmp_path / "run" / "summary.json").read_text())["ttft_p90_s"] is None


def test_sweep_json_is_strict_when_no_rate_reaches_the_target(capsys):
    result = run_json(capsys, "sweep", "--rates", "50", "--num-requests", "100",
                      "--workers", "1", "--json")
    assert result["knee_rate"] is None


# --- unwritable --out ----------------------------------------------------------------------

@pytest.fixture
def no_simulation(monkeypatch):
    """Fail the test if a simulation starts."""
    import sim.engine.cluster

    def refuse(*args, **kwargs):
        raise AssertionError("the run started before --out was checked")
    monkeypatch.setattr(sim.engine.cluster, "simulate", refuse)


def test_unwritable_out_is_refused_before_the_run(tmp_path, capsys, no_simulation):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["simulate", "--num-requests", "10", "--out", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot write" in err and "Traceback" not in err


def test_unwritable_sweep_plot_is_refused_before_the_run(tmp_path, capsys, no_simulation):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["sweep", "--rates", "1", "--workers", "1",
                 "--plot", str(blocker / "plot.png")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_unwritable_paper_out_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import sim.paper.experiments

    monkeypatch.setattr(sim.paper.experiments, "run_paper", lambda **kw: pytest.fail("paper run started"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["paper", "--quick", "--out", str(blocker / "report")]) == 2
    assert "--out" in capsys.readouterr().err


def test_unwritable_replay_out_is_refused_before_sending(tmp_path, capsys, monkeypatch):
    import traces.replay

    monkeypatch.setattr(traces.replay, "replay", lambda *a, **k: pytest.fail("replay started"))
    trace = write_trace(tmp_path / "t.csv", [(0.0, 10, 2)])
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["replay", "--endpoint", "http://127.0.0.1:9", "--trace", str(trace),
                 "--out", str(blocker / "run")]) == 2
    assert "--out" in capsys.readouterr().err


# --- hawk ... | head ----------------------------------------------------------------------

def test_closed_stdout_exits_quietly_with_status_0():
    read_end, write_end = os.pipe()
    os.close(read_end)            # the reader is gone before anything is written (| head -0)
    try:
        done = subprocess.run([sys.executable, "-m", "sim.commands.main", "simulate", "--num-requests",
                               "20"], stdout=write_end, stderr=subprocess.PIPE, cwd=REPO,
                              timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 0
    assert b"Traceback" not in done.stderr and b"BrokenPipe" not in done.stderr


# --- what limits capacity ------------------------------------------------------------------

def test_simulate_says_what_limits_capacity(capsys):
    summary = run_json(capsys, "simulate", "--num-requests", "200", "--json")
    for name in ("prefill", "link", "decode"):
        assert 0.0 < summary[f"{name}_utilization"] <= 1.0
    assert summary["bottleneck"] in ("prefill", "link", "decode")
    stages = ("queue", "prefill", "transfer_wait", "transfer", "first_decode")
    total = sum(summary[f"ttft_{s}_mean_s"] for s in stages)
    assert total == pytest.approx(summary["ttft_mean_s"], rel=1e-9)
    assert summary["ttft_prefill_mean_s"] > 0 and summary["ttft_transfer_mean_s"] > 0
    assert main(["simulate", "--num-requests", "200"]) == 0
    out = capsys.readouterr().out
    assert "utilisation" in out and "most loaded" in out and "of batch slots" in out
    assert "TTFT queue mean/P90" in out and "TTFT first decode" in out


def test_simulate_text_names_failure_reasons(tmp_path, capsys):
    path = write_trace(tmp_path / "long.csv", [(0.0, 10_000_000, 5), (1.0, 100, 5)])
    assert main(["simulate", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rejected_prompt_too_long: 1 (prompt over the batch token budget or the model's " \
           "context)" in out


def test_sweep_says_when_the_knee_is_beyond_the_swept_range(capsys):
    assert main(["sweep", "--rates", "0.05,0.1", "--num-requests", "100", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "beyond the swept range" in out and "0.1 req/s" in out
    assert "prefill" in out.splitlines()[0] and "slots" in out.splitlines()[0]
    result = run_json(capsys, "sweep", "--rates", "0.05,0.1", "--num-requests", "100",
                      "--workers", "1", "--json")
    assert result["knee_beyond_range"] is True and result["knee_rate"] == 0.1


def test_sweep_text_names_failure_reasons(capsys, monkeypatch):
    import sim.runs.sweep

    points = _points([[1.0, 0.5]], [1, 2])
    points[1].summary["statuses"] = {"ok": 8, "failed_out_of_memory": 2}
    monkeypatch.setattr(sim.runs.sweep, "sweep", lambda *a, **k: points)
    assert main(["sweep", "--rates", "1,2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert ("failures over the sweep: failed_out_of_memory: 2 (decode side could not "
            "allocate the receive buffer)") in out


def _points(attainments_by_seed, rates):
    from sim.runs.sweep import SweepPoint

    return [SweepPoint(rate, seed, {"slo_attainment": a, "ttft_p90_s": 1.0, "tpot_p90_s": 0.1,
                                    "output_tokens_per_s": rate, "num_failed": 0,
                                    "statuses": {"ok": 10}})
            for seed, attainments in enumerate(attainments_by_seed)
            for rate, a in zip(rates, attainments)]


def test_sweep_plot_marks_the_knee_and_its_spread_across_seeds():
    from sim.runs.sweep import describe_knee, summarize_sweep, sweep_figure

    summary = summarize_sweep(_points([[1.0, 0.95, 0.92, 0.5], [1.0, 0.95, 0.88, 0.4],
                                       [1.0, 0.93, 0.91, 0.91]], [1, 2, 3, 4]))
    assert summary["knee_rate"] == 3 and summary["knee_by_seed"] == {0: 3, 1: 2, 2: 4}
    assert "3 req/s; across 3 seeds 2 to 4" in describe_knee(summary)
    ax = sweep_figure(summary).axes[0]
    knee_lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("knee")]
    assert len(knee_lines) == 1 and list(knee_lines[0].get_xdata()) == [3, 3]
    bands = [p for p in ax.patches if p.get_label().startswith("seeds' knees")]
    assert len(bands) == 1
    band = bands[0]          # a Rectangle (matplotlib >= 3.9) or a Polygon
    xs = [band.get_x(), band.get_x() + band.get_width()] if hasattr(band, "get_width") \
        else list(band.get_xy()[:, 0])
    assert (min(xs), max(xs)) == (2, 4)


def test_sweep_plot_points_past_the_range_when_the_knee_is_beyond_it():
    from sim.runs.sweep import summarize_sweep, sweep_figure

    summary = summarize_sweep(_points([[1.0, 0.99]], [1, 2]))
    assert summary["knee_beyond_range"]
    ax = sweep_figure(summary).axes[0]
    assert any("knee beyond 2 req/s" in t.get_text() for t in ax.texts)
