"""What ``hawk`` writes: strict JSON, output folders refused up front, quiet broken pipes,
``--rate-scale`` / ``--window`` for traces, and the capacity planner's numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cli import main
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
    import sim.cluster

    def refuse(*args, **kwargs):
        raise AssertionError("the run started before --out was checked")
    monkeypatch.setattr(sim.cluster, "simulate", refuse)


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
    import sim.paper

    monkeypatch.setattr(sim.paper, "run_paper", lambda **kw: pytest.fail("paper run started"))
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
        done = subprocess.run([sys.executable, "-m", "sim.cli", "simulate", "--num-requests",
                               "20"], stdout=write_end, stderr=subprocess.PIPE, cwd=REPO,
                              timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 0
    assert b"Traceback" not in done.stderr and b"BrokenPipe" not in done.stderr
