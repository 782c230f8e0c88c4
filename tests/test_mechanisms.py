"""The five mechanisms on real bytes: the receiver ends with the same bytes whichever is used,
and those equal the layout code's expected bytes; the transfer bench runs across processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hardware import mechanisms as m
from hardware.protocol import DecodeClient, PrefillServer
from hardware.transport import make_transport
from hardware.transport.loopback import LoopbackFabric
from tests import needs

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def run_all(req, layers):
    """Pull the request with every mechanism; return final bytes and writes per mechanism."""
    fabric = LoopbackFabric()
    p, d = make_transport("loopback", fabric=fabric), make_transport("loopback", fabric=fabric)
    server = PrefillServer(p, np.zeros(4 * MIB, np.uint8), m.MechanismSource(layers, req),
                           "mechanism-test-token").start()
    finals, writes = {}, {}
    try:
        for mech in m.MECHANISMS:
            sink = m.MechanismSink(mech, d, req)
            try:
                with DecodeClient(d, sink, server.address, "mechanism-test-token") as client:
                    writes[mech] = client.pull(f"{mech}/0").num_writes
                finals[mech] = sink.final_bytes()
                assert not sink.held
            finally:
                sink.close()
        assert not server.reserved()
    finally:
        server.stop()
        leaks = p.live_regions() + d.live_regions()
        p.close(), d.close()
    assert not leaks, f"regions left registered: {leaks}"
    return finals, writes


@pytest.mark.parametrize("tt_dtype, order, size", [
    ("bfloat16", "NHD", 1 * MIB), ("bfloat8_b", "NHD", 1 * MIB + 4096),
    ("bfloat16", "HND", 600 * 1024),
])
def test_receiver_bytes_identical_across_mechanisms(tt_dtype, order, size):
    req = m.make_request(size, num_layers=2, num_kv_heads=2, tt_dtype=tt_dtype, seed=3)
    if order == "HND":
        import dataclasses
        gpu = dataclasses.replace(req.gpu, order="HND")
        req = dataclasses.replace(req, gpu=gpu)
    layers = m.make_layers(req, seed=3)
    finals, writes = run_all(req, layers)
    npu = m.expected_bytes(layers, req, to_npu=True)
    gpu_tokens = m.expected_bytes(layers, req, to_npu=False)
    for mech, got in finals.items():
        want = npu if mech.startswith("GN") else gpu_tokens
        assert got == want, f"{mech}: receiver bytes differ from the layout code's"
    assert any(b for b in npu), "a non-trivial cache"
    assert writes["GN-HAWK"] <= req.num_tensors * req.tt.dram.num_banks
    assert writes["GG-Direct"] == writes["GN-Direct"] == req.num_tensors


def test_unknown_mechanism_is_refused():
    t = make_transport("loopback", fabric=LoopbackFabric())
    with pytest.raises(ValueError, match="'GN-Magic': allowed GG-Host, GN-Host"):
        m.MechanismSink("GN-Magic", t, None)
    t.close()


def test_transfer_bench_json_across_processes():
    needs.mooncake_engine()
    cmd = [sys.executable, "-c", "import sys; from sim.commands.main import main; sys.exit(main())",
           "real", "transfer-bench", "--sizes", "1,2", "--repeats", "1", "--json",
           "--num-layers", "2"]
    from tests.processes import TAG_ENV, killed_after
    with killed_after() as tag:              # the benchmark's peer too, if the run times out
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, TAG_ENV: tag})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert "hawk real transfer-bench: 2 sizes x 5 mechanisms x 1 repeat, 33 MB moved, ~" in \
        out.stderr                                  # its estimate, before it starts
    rows = report["rows"]
    assert {(r["size_mb"], r["mechanism"]) for r in rows} == {
        (s, mech) for s in (1.0, 2.0) for mech in m.MECHANISMS}
    assert all(r["latency_s"] > 0 for r in rows)
    assert report["raw_socket_gb_per_s"] > 0 and report["transport_gb_per_s"] > 0


def test_transfer_bench_on_cuda_needs_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; run `hawk real transfer-bench --device cuda`")
    from hardware.commands import cmd_transfer_bench
    import argparse
    assert cmd_transfer_bench(argparse.Namespace(device="cuda")) == 2


def bench_parser():
    import argparse
    from hardware.commands import register
    parser = argparse.ArgumentParser(prog="hawk", exit_on_error=False)
    register(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "repeats 0: need >= 1"),
    (["--sizes", "10,-4"], "need one or more sizes > 0 MB"),
    (["--mechanisms", "GN-HAWK,GX-Fast"], "allowed GG-Host, GN-Host"),
])
def test_transfer_bench_flags_name_the_bad_value(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["real", "transfer-bench", *flags])
    assert message in capsys.readouterr().err


def test_transfer_bench_table_has_figure_9_shape():
    from hardware.transfer_bench import format_table
    lat = {"GG-Host": 0.2, "GN-Host": 0.5, "GG-Direct": 0.1, "GN-Direct": 0.4, "GN-HAWK": 0.05}
    rows = [{"size_mb": s, "mechanism": mech, "latency_s": s * v / 10}
            for s in (10.0, 40.0) for mech, v in lat.items()]
    per_size = {"size_mb": 40.0, "nbytes": 40 * MIB, "raw_socket_gb_per_s": 2.0,
                "transport_gb_per_s": 1.0, "raw_socket_cpu_s_per_gb": 0.5,
                "transport_cpu_s_per_gb": 1.5}
    report = {"rows": rows, "transport": "mooncake", "device": "cpu", "repeats": 2,
              "raw_socket_gb_per_s": 2.0, "transport_gb_per_s": 1.0,
              "transport_to_raw_socket": 0.5, "largest_size_mb": 40.0,
              "largest_raw_socket_gb_per_s": 2.0, "largest_transport_gb_per_s": 1.0,
              "per_size": [per_size]}
    lines = format_table(report).splitlines()
    assert lines[1].split()[:2] == ["size", "MB"]
    assert [w for w in lines[1].split() if w.startswith(("GG-", "GN-")) and "/" not in w] == \
        list(m.MECHANISMS)
    assert lines[2].split() == ["10", "200.00", "500.00", "100.00", "400.00", "50.00",
                                "2.50x", "50.00%", "25.00%"]
    assert "ratio 0.50x" in lines[4]
    assert "transport 3.00x the raw socket's CPU per GB" in lines[5]


@pytest.mark.parametrize("flags, message", [
    (["--num-layers", "0"], "num-layers 0: need >= 1"),
    (["--num-layers", "two"], "num-layers 'two': a whole number"),
    (["--sizes", "10,inf"], "need one or more sizes > 0 MB"),
    (["--start-timeout", "-1"], "start-timeout -1: seconds > 0"),
])
def test_transfer_bench_refuses_bad_layers_sizes_and_timeouts(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["real", "transfer-bench", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--sizes", "0.001", "--num-layers", "80"], "smaller than one token's KV cache over 80"),
    (["--sizes", "1e9"], "needs about"),
])
def test_transfer_bench_refuses_impossible_runs_before_starting(flags, message, capsys):
    from hardware.commands import cmd_transfer_bench
    args = bench_parser().parse_args(["real", "transfer-bench", *flags])
    assert cmd_transfer_bench(args) == 2
    out = capsys.readouterr().out
    assert message in out and "Traceback" not in out


def test_a_failing_prefill_process_shows_its_own_error(tmp_path):
    from hardware.transfer_bench import BenchFailed, spawn
    code = "import sys; print('loading', file=sys.stderr); raise SystemExit('no KV cache: boom')"
    with open(tmp_path / "log", "w+b") as log, \
            pytest.raises(BenchFailed, match=r"exited with 1 before serving:\n  loading\n  no KV "
                                             r"cache: boom"):
        spawn([sys.executable, "-c", code], {}, 60, log, "prefill process")


def test_a_silent_prefill_process_is_stopped_after_the_start_timeout(tmp_path):
    from hardware.transfer_bench import BenchFailed, spawn
    with open(tmp_path / "log", "w+b") as log, \
            pytest.raises(BenchFailed, match="did not start serving within 0.5 s"):
        spawn([sys.executable, "-c", "import time; time.sleep(600)"], {}, 0.5, log, "prefill")
