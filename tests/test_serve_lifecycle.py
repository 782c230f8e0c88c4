"""The real mode's processes end when they should: ``hawk real serve`` on SIGTERM and when
SIGKILLed, a worker that dies is collected (no zombie), the endpoint is announced only once
every worker is warm, a frozen worker holds no request past its deadline, and the
transfer benchmark's peer ends with the benchmark. Every test kills what it started, whatever
its outcome (``tests.processes``)."""

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.processes import TAG_ENV, killed_after, start_hawk, tagged, wait_until
from tests import needs



@pytest.fixture
def processes():
    """Skip unless the real mode's processes can run here."""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    needs.mooncake_engine()


def get(endpoint: str, path: str):
    with urllib.request.urlopen(endpoint + path, timeout=120) as r:
        return json.loads(r.read())


def start_serve(tag: str) -> tuple[subprocess.Popen, str]:
    proc = start_hawk(tag, "real", "serve", "--cpu-prefill", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()           # the cluster's start is bounded by its own timeout
    found = re.search(r"serving on (http://\S+)/v1/completions", line)
    assert found, f"no endpoint announced: {line!r} {proc.stderr.read()[-2000:] if not line else ''}"
    return proc, found.group(1)


def gone(pid: int) -> bool:
    """Exited and collected: not even a zombie is left."""
    return not Path(f"/proc/{pid}").exists()


def test_serve_announces_warm_workers_collects_a_dead_one_and_stops_on_sigterm(processes):
    with killed_after() as tag:
        proc, endpoint = start_serve(tag)
        workers = get(endpoint, "/hawk/workers")
        assert {w["role"] for w in workers} == {"prefill", "decode"}
        assert all(w["busy_s"] > 0 for w in workers), workers    # warmed before announced
        assert get(endpoint, "/hawk/requests") == []              # warm-ups are not logged
        decode = next(w["pid"] for w in workers if w["role"] == "decode")
        os.kill(decode, signal.SIGKILL)
        assert wait_until(lambda: gone(decode)), "the killed worker stayed a zombie"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "decode-0 (exit -9) exited" in proc.stderr.read()
        assert wait_until(lambda: not tagged(tag)), f"left running: {tagged(tag)}"


def test_a_sigkilled_serve_takes_its_router_and_workers_with_it(processes):
    with killed_after() as tag:
        proc, _ = start_serve(tag)
        children = [p for p in tagged(tag) if p != proc.pid]
        assert len(children) == 3, children                    # router, prefill, decode
        proc.kill()
        proc.wait(timeout=60)
        assert wait_until(lambda: not tagged(tag)), f"orphans: {tagged(tag)}"


def test_a_frozen_decode_worker_fails_its_request_by_deadline_and_health_answers(processes,
                                                                                monkeypatch,
                                                                                tmp_path):
    from hardware.serve.cluster import ClusterConfig, LocalCluster

    with killed_after() as tag:
        monkeypatch.setenv(TAG_ENV, tag)
        config = ClusterConfig(router_args=["--request-timeout-s", "20"])
        with LocalCluster(config, log_dir=tmp_path) as cluster:
            decode = next(w["pid"] for w in cluster.get("/hawk/workers")
                          if w["role"] == "decode")
            os.kill(decode, signal.SIGSTOP)
            try:
                req = urllib.request.Request(cluster.endpoint + "/v1/completions", json.dumps(
                    {"prompt": [1, 2, 3], "max_tokens": 4}).encode())
                with pytest.raises(urllib.error.HTTPError) as err:
                    urllib.request.urlopen(req, timeout=300)
                assert err.value.code == 504
                error = json.loads(err.value.read())["error"]
                assert error["hawk_status"] == "failed_timeout", error
                answered = {w["role"]: w["answered"] for w in cluster.get("/hawk/workers")}
                assert answered == {"prefill": True, "decode": False}
                (entry,) = cluster.get("/hawk/requests")
                assert entry["status"] == "failed_timeout"
            finally:
                os.kill(decode, signal.SIGCONT)


PARENT = """
import sys, tempfile, time, types
from hardware.transfer_bench import start_prefill
args = types.SimpleNamespace(transport="mooncake", device="cpu", num_layers=2, seed=0,
                             start_timeout_s=600)
proc, hello = start_prefill(1, args, "p" * 32, tempfile.TemporaryFile())
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_the_transfer_bench_peer_ends_with_a_killed_benchmark(processes):
    import sys

    from tests.processes import ROOT
    with killed_after() as tag:
        parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, start_new_session=True,
                                  env={**os.environ, TAG_ENV: tag, "PYTHONPATH": str(ROOT)})
        peer = int(parent.stdout.readline())        # serving, and idle from here on
        parent.kill()                               # as a test runner's timeout does
        parent.wait(timeout=60)
        assert wait_until(lambda: peer not in tagged(tag)), "the peer outlived its benchmark"
