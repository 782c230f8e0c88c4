"""``hawk real transfer-bench`` says up front what it will do and refuses what cannot finish
(``hardware.bench_plan``); its progress counts the MB moved as moves end; every wait it makes
after the start ends within its bound with a named error, and the peer it started is gone."""

import argparse
import socket
import subprocess
import sys
import threading
import time

import pytest

from hardware import bench_plan, transfer_bench
from hardware.mechanisms import MECHANISMS
from tests.processes import TAG_ENV, killed_after, tagged


def parse(*flags: str) -> argparse.Namespace:
    from hardware.commands import register
    parser = argparse.ArgumentParser(prog="hawk", exit_on_error=False)
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["real", "transfer-bench", *flags])


@pytest.fixture
def never_run(monkeypatch):
    """The benchmark itself must not start."""
    def run(args):
        raise AssertionError("the benchmark started")
    monkeypatch.setattr(transfer_bench, "run", run)


def test_a_huge_sizes_list_is_refused_at_once_naming_the_estimate_and_the_flag(capsys,
                                                                            never_run):
    from hardware.commands import cmd_transfer_bench
    sizes = ",".join(str(100 + i) for i in range(400))      # 400 sizes, each fits in memory
    start = time.monotonic()
    assert cmd_transfer_bench(parse("--sizes", sizes)) == 2
    assert time.monotonic() - start < 5
    out = capsys.readouterr().out
    assert out.startswith("transfer-bench: hawk real transfer-bench: 400 sizes x 5 mechanisms "
                          "x 3 repeats, ")
    assert "on this machine" in out and "past the 60.0 min limit" in out
    assert "--max-wall-s" in out and "Traceback" not in out


def test_max_wall_s_sets_the_limit(capsys, never_run):
    from hardware.commands import cmd_transfer_bench
    assert cmd_transfer_bench(parse("--sizes", "10", "--max-wall-s", "1")) == 2
    assert "past the 1 s limit" in capsys.readouterr().out


def test_a_normal_run_prints_its_estimate_before_it_starts(capsys, monkeypatch):
    from hardware.commands import cmd_transfer_bench

    def run(args):
        assert "hawk real transfer-bench:" in capsys.readouterr().err    # before it starts
        raise transfer_bench.BenchFailed("stopped here")
    monkeypatch.setattr(transfer_bench, "run", run)
    assert cmd_transfer_bench(parse("--sizes", "10,80,640")) == 1


def test_the_estimate_counts_every_move_of_every_step():
    # per size: raw socket and the two pulls repeats + 1 times, each mechanism repeats times
    line = bench_plan.estimate_line([10, 80, 640], MECHANISMS, 3)
    assert line.startswith("hawk real transfer-bench: 3 sizes x 5 mechanisms x 3 repeats, "
                           f"{730 * (3 * 4 + 5 * 3):,} MB moved, ~")
    assert line.endswith(f"~{8 * 640 * 2**20 / 1e9:.1f} GB peak")
    one, two = (bench_plan.wall_s(s, MECHANISMS, 3) for s in ([10], [10, 10]))
    assert two == pytest.approx(2 * one)
    assert bench_plan.wall_s([20], ["GN-Host"], 3) > bench_plan.wall_s([10], ["GN-Host"], 3)


def test_progress_counts_megabytes_as_moves_end(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)            # the plain lines
    todo = bench_plan.steps([10], ["GN-HAWK"], 1)   # raw, pulls, pulls with MACs: 2 moves each
    progress = bench_plan.Progress(todo)
    assert progress.total == 10 * (3 * 2 + 1)
    for step in todo:
        progress.begin(step)
        for _ in range(step.moves):
            progress.moved()
    assert capsys.readouterr().err.splitlines()[-1] == \
        "transfer-bench [60/70 MB moved] 10 MB GN-HAWK"        # the last move still running
    progress.close()
    assert capsys.readouterr().err.splitlines() == ["transfer-bench [70/70 MB moved]"]


def test_a_raw_sender_that_never_answers_is_a_named_error_within_its_bound():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never sends a byte
        start = time.monotonic()
        with pytest.raises(transfer_bench.BenchFailed, match="not received within 0.5 s"):
            transfer_bench.raw_socket_s(silent.getsockname()[1], 1 << 20, 1, 0.5)
    assert time.monotonic() - start < 10


SILENT_PEER = """
import json, socket, time
raw, control = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
print(json.dumps({"address": list(control.getsockname()), "raw_port": raw.getsockname()[1],
                  "nbytes": 1 << 20}), flush=True)
time.sleep(600)
"""


def test_a_peer_that_never_answers_ends_the_size_with_a_named_error_and_is_collected(
        monkeypatch, tmp_path):
    import os
    started = []

    def start_prefill(size_mb, args, token, log):
        env = {**os.environ, TAG_ENV: tag}
        started.append(transfer_bench.spawn([sys.executable, "-c", SILENT_PEER], env, 60, log,
                                            "silent peer"))
        return started[-1]
    monkeypatch.setattr(transfer_bench, "start_prefill", start_prefill)
    monkeypatch.setattr(bench_plan, "wait_s", lambda size_mb, what="GN-Host": 0.5)
    args = argparse.Namespace(num_layers=2, seed=0, repeats=1, mechanisms=["GN-HAWK"])
    progress = bench_plan.Progress(bench_plan.steps([1.0], args.mechanisms, 1))
    with killed_after() as tag:
        start = time.monotonic()
        with pytest.raises(transfer_bench.BenchFailed, match="raw sender on port .* not "
                                                             "received within 0.5 s"):
            transfer_bench.bench_size(1.0, args, None, progress)
        assert time.monotonic() - start < 60
        proc = started[0][0]
        assert proc.returncode is not None              # killed and collected by bench_size
        assert tagged(tag) == []


def test_a_transport_that_does_not_close_is_a_named_error_within_the_bound():
    release = threading.Event()

    class Stuck:
        name = "mooncake"

        def close(self):
            release.wait(60)
    start = time.monotonic()
    try:
        with pytest.raises(transfer_bench.BenchFailed, match="mooncake transport did not "
                                                             "close within 0.3 s"):
            transfer_bench.close_within(Stuck(), 0.3)
        assert time.monotonic() - start < 10
    finally:
        release.set()


def test_a_peer_that_outlives_sigkill_is_a_named_error():
    class Unkillable:                      # a process in uninterruptible sleep, say
        pid = 4242

        def kill(self):
            pass

        def wait(self, timeout):
            raise subprocess.TimeoutExpired("peer", timeout)
    with pytest.raises(transfer_bench.BenchFailed, match=r"peer \(pid 4242\) did not exit "
                                                         r"within 0.1 s of SIGKILL"):
        transfer_bench.stop(Unkillable(), "peer", 0.1)


def test_a_peer_that_prints_noise_then_hangs_is_stopped_at_the_start_timeout(tmp_path):
    code = "import time; print('warming up', flush=True); time.sleep(600)"
    with open(tmp_path / "log", "w+b") as log, pytest.raises(
            transfer_bench.BenchFailed,
            match=r"did not start serving within 3 s \(it printed \['warming up'\]\)"):
        transfer_bench.spawn([sys.executable, "-I", "-S", "-c", code], {}, 3, log, "prefill")


def test_a_peer_that_closes_its_output_but_lives_on_is_stopped(monkeypatch):
    monkeypatch.setattr(transfer_bench, "TEARDOWN_S", 0.5)
    code = "import os, time; os.close(1); time.sleep(600)"
    with open("/dev/null", "w+b") as log, pytest.raises(transfer_bench.BenchFailed,
                                                         match="exited with its output closed before "
                                                               "serving"):
        transfer_bench.spawn([sys.executable, "-c", code], {}, 60, log, "prefill")
