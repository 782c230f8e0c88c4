"""``hawk`` refuses what it cannot do in reason, and says what long work it starts: each
command's estimate (requests, wall time, memory) against ``--max-wall-s``; nonsense flags
(``--seeds 0``, ``--target 2``, ``--workers 0``, ``--seed -1``) named up front; no
abbreviated flags; an error that lists every command; and a summary a planner reads right."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.commands.main import COMMANDS, main


def refused(capsys, *argv) -> str:
    """Run ``hawk argv``; it must exit 2 (a ``ConfigError`` returned, or argparse's exit)
    before doing any work. The error text."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def write_trace(path: Path, rows) -> Path:
    path.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n"
                    + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


# --- estimates and --max-wall-s -----------------------------------------------------------

def test_a_hundred_million_requests_are_refused_at_once_with_the_estimate(capsys):
    err = refused(capsys, "simulate", "--num-requests", "100000000")
    assert "100,000,000 simulated requests would take about" in err
    assert "past the 60.0 min limit" in err and "--max-wall-s" in err


def test_max_wall_s_lowers_the_limit_of_a_run_in_memory(capsys):
    err = refused(capsys, "simulate", "--num-requests", "200000", "--no-stream",
                  "--max-wall-s", "1")
    assert "200,000 simulated requests" in err and "past the 1 s limit" in err


def test_cells_are_estimated_per_worker(capsys):
    err = refused(capsys, "simulate", "--num-requests", "400000", "--cells", "4",
                  "--cell-instances", "per-cell", "--workers", "2", "--max-wall-s", "2")
    assert "400,000 simulated requests, 2 at a time" in err


def test_a_sweep_counts_points_times_requests_over_its_workers(capsys):
    err = refused(capsys, "sweep", "--rates", "0.1:2:0.1", "--num-requests", "100000",
                  "--workers", "2", "--max-wall-s", "10")
    assert "the sweep of 20 points: 2,000,000 simulated requests, 2 at a time" in err
    assert "--max-wall-s" in err


@pytest.mark.parametrize("argv, what", [
    (("plan", "--rate", "1", "--num-requests", "100000", "--workers", "1"), "the plan's"),
    (("paper", "--workers", "1"), "the paper's"),
    (("validate", "--profile", "nowhere", "--workload", "chatbot", "--num-requests",
      "1000000"), "the simulated side"),
])
def test_every_simulating_command_takes_max_wall_s(capsys, argv, what):
    err = refused(capsys, *argv, "--max-wall-s", "1")
    assert what in err and "--max-wall-s" in err


def test_compare_estimates_both_arms(tmp_path, capsys):
    for name, fairness in (("a", "fcfs"), ("b", "weighted_fair")):
        (tmp_path / f"{name}.toml").write_text(f'[cluster.policies]\nfairness = "{fairness}"\n')
    err = refused(capsys, "compare", "--baseline", str(tmp_path / "a.toml"), "--candidate",
                  str(tmp_path / "b.toml"), "--workload", "chatbot", "--num-requests",
                  "100000", "--repeats", "3", "--workers", "1", "--max-wall-s", "1")
    assert "the comparison's 6 runs: 600,000 simulated requests" in err


def test_a_long_estimate_is_announced_in_one_line(capsys):
    from sim.commands.args import announce

    announce("hawk simulate", 5_000_000, None, peak_bytes=400e6)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("hawk simulate: about 5,000,000 requests, ~")
    assert "on this machine, ~400 MB peak" in err
    announce("hawk simulate", 1000, None)                   # well under ANNOUNCE_AFTER_S
    assert capsys.readouterr().err == ""


def test_long_commands_announce_before_they_start(capsys, monkeypatch):
    from sim.bench import speed

    monkeypatch.setattr(speed, "run", lambda **kw: (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        main(["bench"])
    # 100,000 requests, 9 simulated runs a repeat (3 P/D, and for each of the 2 aggregated
    # clusters 2 runs and a P/D baseline), 3 repeats
    assert "hawk bench: about 2,700,000 requests" in capsys.readouterr().err


# --- nonsense refused by the flag's name ----------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (("sweep", "--rates", "0.1", "--seeds", "0"), "--seeds 0: must be >= 1"),
    (("sweep", "--rates", "0.1", "--target", "2"), "--target 2: must be in (0, 1]"),
    (("sweep", "--rates", "0.1", "--target", "0"), "--target 0: must be in (0, 1]"),
    (("plan", "--rate", "1", "--target", "1.5"), "--target 1.5: must be in (0, 1]"),
    (("sweep", "--rates", "0.1", "--workers", "0"), "--workers 0: must be >= 1"),
    (("plan", "--rate", "1", "--workers", "0"), "--workers 0: must be >= 1"),
    (("paper", "--workers", "0"), "--workers 0: must be >= 1"),
    (("compare", "--baseline", "a.toml", "--candidate", "b.toml", "--workers", "0"),
     "--workers 0: must be >= 1"),
    (("simulate", "--cells", "2", "--workers", "0"), "--workers 0: must be >= 1"),
    (("plan", "--rate", "1", "--max-knees", "0"), "--max-knees 0: must be >= 1"),
    (("simulate", "--max-wall-s", "0"), "--max-wall-s 0: must be > 0"),
    (("real", "transfer-bench", "--seed", "-1"), "--seed -1: need >= 0"),
])
def test_nonsense_is_refused_naming_the_flag(capsys, argv, message):
    assert message in refused(capsys, *argv)


def test_transfer_bench_checks_its_seed_before_any_child_starts(monkeypatch):
    import argparse

    from hardware import transfer_bench

    started = []
    monkeypatch.setattr(transfer_bench, "bench_size", lambda *a: started.append(a))
    args = argparse.Namespace(seed=-1, sizes=[2.0], num_layers=4, mechanisms=["GN-HAWK"],
                              transport="mooncake")
    with pytest.raises(transfer_bench.BenchFailed, match="--seed -1"):
        transfer_bench.run(args)
    assert started == []


# --- CLI habits ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ("simulate", "--num-req", "50"),
    ("sweep", "--rate", "0.1"),                             # --rates
    ("replay", "--endpoint", "http://x", "--trace", "t.csv", "--rat", "2"),
    ("real", "transfer-bench", "--size", "2"),              # --sizes
])
def test_flags_are_never_abbreviated(capsys, argv):
    assert "unrecognized arguments" in refused(capsys, *argv)


@pytest.mark.parametrize("argv", [("simulate", "--bogus"), ("bogus",)])
def test_an_unknown_flag_or_command_names_every_command(capsys, argv):
    err = refused(capsys, *argv)
    assert len(COMMANDS) == 13                       # profile --endpoint joined the twelve
    assert all(name in err for name, _, _ in COMMANDS)
    assert "hawk --help" in err


# --- what a planner reads -------------------------------------------------------------------

def test_busy_share_and_decode_load_are_labelled_apart():
    from sim.commands.simulate import _capacity_rows

    summary = {"prefill_utilization": 0.4, "link_utilization": 0.02,
               "decode_utilization": 1.0, "decode_occupancy": 1.08, "bottleneck": "decode"}
    rows = dict(_capacity_rows(summary))
    assert rows["utilisation"] == "prefill 40% / link 2% / decode 100% busy (share of the " \
                                  "time working)"
    assert rows["decode load"].startswith("108% of batch slots (requests past their first "
                                          "token per slot; over 100%: a queue waits")
    assert rows["most loaded"].startswith("decode (the highest of prefill busy, link busy "
                                          "and decode load)")


def test_a_stage_zero_by_construction_says_so(capsys):
    assert main(["simulate", "--num-requests", "100"]) == 0
    out = capsys.readouterr().out
    assert "TTFT first decode mean/P90" not in out
    assert "TTFT first decode" in out and "the first token arrives with the KV cache" in out
    assert "most loaded" in out and "decode load" in out


def test_a_trace_run_shows_its_offered_rate_and_why_it_fails(tmp_path, capsys):
    rows = [(0.01 * k, 2000, 50) for k in range(400)]       # 100 req/s, far past capacity
    path = write_trace(tmp_path / "fast.csv", rows)
    assert main(["simulate", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "offered load" in out and "400 requests over 3.99 s = 100 req/s" in out
    assert "past this cluster's capacity" in out


def test_a_trace_within_capacity_gets_no_hint(tmp_path, capsys):
    path = write_trace(tmp_path / "slow.csv", [(10.0 * k, 200, 20) for k in range(20)])
    assert main(["simulate", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "20 requests over 190 s" in out and "capacity" not in out


def test_the_sweep_plot_draws_the_target_and_the_slos_and_says_where(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    assert main(["sweep", "--rates", "0.2,0.4", "--num-requests", "40", "--workers", "1",
                 "--plot", str(plot)]) == 0
    assert f"plot written to {plot}" in capsys.readouterr().out and plot.is_file()
    from sim.runs.sweep import summarize_sweep, sweep, sweep_figure
    from sim.config import RunConfig

    config = RunConfig().replace(**{"workload.num_requests": 40})
    fig = sweep_figure(summarize_sweep(sweep(config, [0.2], workers=1, progress=False)),
                       slo=(2.0, 0.2))
    labels = [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]
    assert "target 90%" in labels and "TTFT SLO 2 s" in labels and "TPOT SLO 200 ms" in labels


def test_a_transfer_fitted_faster_than_memory_is_warned(tmp_path, capsys):
    from tests.test_profile_dir import make_profile_dir

    prof = make_profile_dir(tmp_path / "p")
    rows = (prof / "transfer.csv").read_text().splitlines()
    flat = [",".join(r.split(",")[:2] + ["0.003"] + r.split(",")[3:]) if "GN-HAWK" in r else r
            for r in rows]                                  # GN-HAWK's time flat in size
    (prof / "transfer.csv").write_text("\n".join(flat) + "\n")
    assert main(["calibrate", "--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "warning: transfer GN-HAWK: fitted bandwidth" in out
    assert "above the measuring machine's memory bandwidth" in out
    assert "warning: transfer GG-Direct" not in out


# --- a trace file estimated before it is read ---------------------------------------------

def big_trace(path: Path, rows: int, good_rows: int) -> Path:
    """A CSV of ``rows`` rows whose rows past ``good_rows`` are bad: a run that reads past
    them fails naming a line, so a refusal that names the estimate read none of them."""
    body = "".join(f"{0.01 * k:.2f},200,20\n" for k in range(good_rows))
    bad = "x,y,z\n" * (rows - good_rows)
    path.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n" + body + bad)
    return path


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_a_long_trace_file_is_refused_before_it_is_read(tmp_path, capsys, mode):
    path = big_trace(tmp_path / "day.csv", 150_000, 60_000)
    err = refused(capsys, "simulate", "--trace", str(path), mode, "--max-wall-s", "2")
    assert "day.csv (about 1" in err and "rows by its size" in err
    assert ("read twice" if mode == "--stream" else "read once") in err
    assert "simulated requests would take about" in err and "--max-wall-s" in err
    assert "line" not in err                                # no row was checked


def test_a_streamed_trace_is_announced_before_its_scan(tmp_path, capsys, monkeypatch):
    from traces import trace_stream

    seen = []

    def scan_stops(spec):
        seen.append(capsys.readouterr().err)
        raise SystemExit(0)

    monkeypatch.setattr(trace_stream, "scan", scan_stops)
    path = big_trace(tmp_path / "day.csv", 150_000, 150_000)
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(path), "--stream"])
    assert len(seen) == 1 and seen[0].count("\n") == 1
    assert seen[0].startswith("hawk simulate --trace day.csv (about 1")
    assert "read twice): about 1" in seen[0] and "on this machine" in seen[0]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_trace_rows_are_estimated_from_the_size(tmp_path, suffix):
    import pandas as pd

    from traces.trace_stream import estimate_rows

    for rows in (7, 200_000):                               # under, then far over the sample
        frame = pd.DataFrame({"arrival_at": [0.5 * k for k in range(rows)],
                              "num_prompt_tokens": 300, "num_output_tokens": 30})
        path = tmp_path / f"t{rows}{suffix}"
        if suffix == ".csv":
            frame.to_csv(path, index=False)
        elif suffix == ".jsonl":
            frame.to_json(path, orient="records", lines=True)
        else:
            frame.to_parquet(path)
        got = estimate_rows(path)
        assert got == rows if rows < 1000 or suffix == ".parquet" else \
            abs(got - rows) < 0.1 * rows


# --- the standalone entry points refuse abbreviations too -----------------------------------

class _Parsed(Exception):
    pass


def standalone_parser(monkeypatch, module: str):
    """The parser ``python -m module`` builds, caught as its ``main`` parses (nothing runs)."""
    import argparse
    import importlib

    def catch(self, args=None, namespace=None):
        raise _Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(_Parsed) as caught:
            importlib.import_module(module).main([])
    return caught.value.args[0]


@pytest.mark.parametrize("module, argv, abbreviation", [
    ("hardware.model.hf_dir", ["--out", "x"], "--se"),                    # --seed
    ("hardware.serve.worker", ["--role", "prefill", "--router", "127.0.0.1:1"], "--max-batch-t"),
    ("hardware.serve.profile_measure", ["--model", "m", "--lengths", "8:1"], "--serve"),
    ("hardware.serve.speed", [], "--num-req"),
    ("hardware.layout_kernel", ["--build"], "--wait"),
    ("hardware.layout_bench", [], "--tok"),
    ("hardware.transfer_bench", [], "--size"),                           # --size-bytes
    ("traces.stub_server", [], "--ttf"),
    ("hardware.serve.router", [], "--request-time"),                     # --request-timeout-s
])
def test_standalone_parsers_never_abbreviate(monkeypatch, capsys, module, argv, abbreviation):
    parser = standalone_parser(monkeypatch, module)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv, abbreviation, "1"])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {abbreviation} 1" in capsys.readouterr().err


# --- a trace with its own column names, from the command line -----------------------------

COLUMNS = "arrival_at=ts,num_prompt_tokens=in,num_output_tokens=out,time_unit=ms"


def own_columns(path: Path) -> Path:
    path.write_text("ts,in,out\n" + "".join(f"{1500 * k},{100 + k},{5 + k}\n"
                                            for k in range(12)))
    return path


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_simulate_reads_a_trace_by_its_own_column_names(tmp_path, capsys, mode):
    import json

    path = own_columns(tmp_path / "own.csv")
    assert main(["simulate", "--trace", str(path), "--columns", COLUMNS, mode, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trace"]["num_simulated"] == 12
    assert 16.5 <= summary["simulated_time_s"] < 30     # 11 gaps of 1,500 ms, read as ms
    assert refused(capsys, "simulate", "--trace", str(path), mode).count("--columns") == 1


def test_compare_reads_a_trace_by_its_own_column_names(tmp_path, capsys):
    for name, fairness in (("a", "fcfs"), ("b", "weighted_fair")):
        (tmp_path / f"{name}.toml").write_text(f'[cluster.policies]\nfairness = "{fairness}"\n')
    path = own_columns(tmp_path / "own.csv")
    assert main(["compare", "--baseline", str(tmp_path / "a.toml"), "--candidate",
                 str(tmp_path / "b.toml"), "--trace", str(path), "--columns", COLUMNS,
                 "--workers", "1"]) == 0
    assert "(12 requests)" in capsys.readouterr().out


# --- a transport test that skips says how to get what it needs -----------------------------

@pytest.mark.parametrize("error, says", [
    ("libibverbs.so.1: cannot open shared object file", "bash scripts/install-rdma-packages.sh"),
    ("No module named 'mooncake'", "pip install -e '.[transfer]'"),
])
def test_a_missing_transport_skips_naming_the_step(monkeypatch, error, says):
    import importlib

    from tests import needs

    def missing(name):
        raise ImportError(error)

    monkeypatch.setattr(importlib, "import_module", missing)
    for need, want in ((needs.mooncake_engine, says),
                       (needs.pyverbs, "python3-pyverbs not installed or not visible to this "
                                       "interpreter: bash scripts/install-rdma-packages.sh")):
        with pytest.raises(pytest.skip.Exception) as skipped:
            need()
        assert want in skipped.value.msg


def test_a_streamed_trace_run_shows_the_offered_rate_the_loaded_one_shows(tmp_path, capsys):
    import json

    path = write_trace(tmp_path / "fast.csv", [(0.01 * k, 2000, 50) for k in range(400)])
    shown = {}
    for mode in ("--stream", "--no-stream"):
        argv = ["simulate", "--trace", str(path), mode, "--window", "1:2", "--rate-scale", "2"]
        assert main(argv + ["--json"]) == 0
        shown[mode] = json.loads(capsys.readouterr().out)["trace"]["offered"]
        assert main(argv) == 0
        assert "100 requests over 0.495 s = 200 req/s" in capsys.readouterr().out
    assert shown["--stream"] == shown["--no-stream"] == {"num_requests": 100,
                                                         "span_s": pytest.approx(0.495),
                                                         "rate": pytest.approx(200.0)}
