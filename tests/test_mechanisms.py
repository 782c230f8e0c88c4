"""The five mechanisms on real bytes: the receiver ends with the same bytes whichever is used,
and those equal the layout code's expected bytes; the transfer bench runs across processes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hardware import mechanisms as m
from hardware.protocol import DecodeClient, PrefillServer
from hardware.transport import make_transport
from hardware.transport.loopback import LoopbackFabric

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def run_all(req, layers):
    """Pull the request with every mechanism; return final bytes and writes per mechanism."""
    fabric = LoopbackFabric()
    p, d = make_transport("loopback", fabric=fabric), make_transport("loopback", fabric=fabric)
    server = PrefillServer(p, np.zeros(4 * MIB, np.uint8), m.MechanismSource(layers, req),
                           "tok").start()
    finals, writes = {}, {}
    try:
        for mech in m.MECHANISMS:
            sink = m.MechanismSink(mech, d, req)
            try:
                with DecodeClient(d, sink, server.address, "tok") as client:
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
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not "
                                                  "installed (pip install -e '.[transfer]')")
    cmd = [sys.executable, "-c", "import sys; from sim.cli import main; sys.exit(main())",
           "real", "transfer-bench", "--sizes", "1,2", "--repeats", "1", "--json",
           "--num-layers", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
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
