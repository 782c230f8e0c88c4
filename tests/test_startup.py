"""Start-up of ``hawk simulate``: what it imports before its first event, and how bench reports it."""

import subprocess
import sys

import numpy as np
import pytest

from sim.bench import speed as bench

# Imported to register other commands, or heavy libraries a simulation does not need before
# it starts (pandas comes later, for the records).
HEAVY = ("pandas", "matplotlib", "scipy", "pyarrow", "torch", "ray")
NOT_BEFORE_FIRST_EVENT = ("hardware.mechanisms", "hardware.transfer_bench", "sim.paper.calibrate",
                          "sim.paper.fit", "traces.loaders", "traces.formats", "traces.shaping",
                          "numpy.ma",       # np.unique imports it: Trace's id check sorts instead
                          "sim.commands.sweep", "sim.commands.validate", "traces.commands",
                          "hardware.commands") + HEAVY


def modules_at_first_event() -> set[str]:
    script = bench.STARTUP_SCRIPT.replace(
        "print(time.process_time(), time.perf_counter() - wall, time.time())",
        "import sys; print(' '.join(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_simulate_imports_no_other_commands_or_heavy_libraries_before_its_first_event():
    loaded = modules_at_first_event()
    assert "sim.engine.cluster" in loaded and "simpy" in loaded          # it did reach the event
    assert not loaded & set(NOT_BEFORE_FIRST_EVENT), sorted(loaded & set(NOT_BEFORE_FIRST_EVENT))


def commands(parser) -> set[str]:
    return {name for action in parser._subparsers._group_actions for name in action.choices}


def test_other_commands_are_still_registered():
    from sim.commands.main import COMMANDS, build_parser

    names = {name for name, _, _ in COMMANDS}
    assert {"simulate", "replay", "real", "paper", "calibrate"} <= names
    assert commands(build_parser()) == names == commands(build_parser(load={"simulate"}))


def test_bench_measures_startup_in_a_fresh_interpreter():
    cpu_s, wall_s = bench.startup_seconds()
    assert cpu_s > 0 and wall_s > 0
    report = dict(num_requests=10, rate=0.5, slo_attainment=1.0, repeats=1, wall_s=1.0,
                  simulated_requests_per_s=10.0, bare_simpy_events_per_s=100.0,
                  requests_per_bare_event=0.1, decode_wakeups_per_request=0.9,
                  long_output_rate=0.05, long_output_wall_ratio=1.1, long_output_wall_s=1.1,
                  long_output_same_rate_wall_ratio=3.0, long_output_same_rate_wall_s=3.0,
                  long_output_same_rate_preemptions_per_request=1.4,
                  startup_s=cpu_s, startup_wall_s=wall_s, memory_requests=1000,
                  peak_rss_mb=150.0, peak_rss_mb_streamed=120.0)
    text = bench.format_report(report)
    assert f"start-up to first event  {cpu_s:>12.3f} s CPU" in text
    # the goals, printed beside the figures
    assert "target >= 0.06" in text and "target < 2x" in text and "target < 0.5 s" in text
    assert "150 MB in memory, 120 MB streamed" in text


def test_importing_the_command_line_imports_no_heavy_library():
    done = subprocess.run([sys.executable, "-c", "import sys, sim.commands.main; print(' '.join("
                           "sorted(sys.modules)))"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in done.stdout.split()}
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_memory_probe_reports_its_own_peak_not_the_process_that_started_it():
    # Linux carries ru_maxrss over fork and exec: a probe started by a process holding
    # 600 MB reported those 600 MB whatever it used itself.
    held = bytearray(600 * 2**20)
    held[::4096] = b"\1" * len(range(0, len(held), 4096))      # touch every page
    assert bench.own_peak_rss_kb() >= 600 * 1024                 # this process: it is there
    probe_mb = bench.peak_memory_mb(100, 0.5, stream=True)
    assert 10 < probe_mb < 450, probe_mb                        # a 100-request run's own
    del held


def test_startup_bench_times_each_kind_in_fresh_processes_and_reports_ratios():
    import os

    from sim.bench import startup

    walls = startup.one_round(dict(os.environ))
    assert set(walls) == set(startup.KINDS) and min(walls.values()) > 0
    report = {"runs": 3, "bytecode": "cached", "python": "3.11.7",
              "bare_s": 0.04, "help_s": 0.06, "first_event_s": 0.2, "floor_s": 0.16,
              **{f"{k}_range_s": [0.01, 0.5] for k in startup.KINDS}}
    report.update(help_per_bare=1.5, first_event_per_bare=5.0, floor_per_bare=4.0)
    text = startup.format_report(report)
    assert "hawk --help                       0.060" in text and "1.50  target < 0.3 s" in text
    assert "5.00  target < 0.25 s" in text and "median of 3 fresh processes" in text


def test_startup_bench_refuses_no_runs():
    from sim.bench import startup

    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        startup.measure(runs=0)


@pytest.mark.parametrize("ids, unique", [([2, 0, 1], True), ([5], True), ([], True),
                                         ([3, 1, 3], False), ([7, 7], False)])
def test_trace_ids_must_be_unique_in_any_order(ids, unique):
    from traces.trace import Trace

    n = len(ids)
    make = lambda: Trace.from_columns(np.arange(n, dtype=float), [10] * n, [5] * n, ids)
    if unique:
        assert list(make().request_id) == ids
    else:
        with pytest.raises(ValueError, match="request_id values must be unique"):
            make()
