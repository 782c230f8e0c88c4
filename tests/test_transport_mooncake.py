"""Mooncake Transfer Engine between two processes on loopback (TCP), and its RDMA fallback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hardware.plan import TransferPlan
from hardware.transport import (
    PeerLost, PlanOutOfBounds, Region, TransportUnavailable, make_transport,
)
from hardware.transport import verbs

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not "
                                              "installed (pip install -e '.[transfer]')")

ROOT = Path(__file__).resolve().parent.parent
NUM_BANKS, BANK_BYTES = 4, 1 << 20

# The peer: registers banks, prints its endpoint and regions, then answers "sum" / "quit".
PEER = textwrap.dedent(f"""
    import json, sys, zlib
    import numpy as np
    from hardware.transport import make_transport
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    banks = [np.zeros({BANK_BYTES}, np.uint8) for _ in range({NUM_BANKS})]
    regions = [t.register_buffer(b).to_wire() for b in banks]
    print(json.dumps({{"endpoint": t.endpoint(), "regions": regions}}), flush=True)
    for line in sys.stdin:
        if line.strip() == "crc":
            print(json.dumps([zlib.crc32(b.tobytes()) for b in banks]), flush=True)
        else:
            break
    t.close()
""")


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-c", PEER], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        hello = json.loads(proc.stdout.readline())
        yield proc, hello["endpoint"], [Region.from_wire(r) for r in hello["regions"]]
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def local():
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    yield t
    leaks = t.live_regions()
    t.close()
    assert not leaks, f"regions left registered: {leaks}"


def striped_plan(total, num_banks, chunk):
    """Chunk i of the source goes to bank i % num_banks, packed from offset 0."""
    n = total // chunk
    i = np.arange(n)
    return TransferPlan("striped", i * chunk, i % num_banks, (i // num_banks) * chunk,
                        np.full(n, chunk), total, (BANK_BYTES,) * num_banks)


def test_batch_of_writes_is_byte_exact_across_processes(peer, local):
    import zlib
    proc, endpoint, banks = peer
    src = np.random.default_rng(0).integers(0, 256, 2 * BANK_BYTES, dtype=np.uint8)
    rs = local.register_buffer(src)
    plan = striped_plan(src.nbytes, NUM_BANKS, 4096)       # 512 writes, one batch
    local.submit(plan, rs, banks, op="write", timeout_s=20)
    expected = [np.zeros(BANK_BYTES, np.uint8) for _ in banks]
    for s, r, d, n in zip(plan.src_offset, plan.dst_region, plan.dst_offset, plan.nbytes):
        expected[r][d:d + n] = src[s:s + n]
    proc.stdin.write("crc\n"), proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == [zlib.crc32(e.tobytes()) for e in expected]
    local.release(rs)


def test_read_pulls_from_the_peer(peer, local):
    proc, endpoint, banks = peer
    dst = np.full(8192, 7, np.uint8)
    rd = local.register_buffer(dst)
    plan = TransferPlan("pull", [0], [0], [0], [8192], BANK_BYTES, (8192,))
    local.submit(plan, banks[2], [rd], op="read", timeout_s=20)
    assert not dst.any(), "peer banks are zero, so the pulled bytes must be zero"
    local.release(rd)


def test_more_writes_than_one_engine_batch(peer, local):
    proc, endpoint, banks = peer
    src = np.ones(BANK_BYTES, np.uint8)
    rs = local.register_buffer(src)
    local.submit(striped_plan(src.nbytes, NUM_BANKS, 256), rs, banks, timeout_s=30)  # 4096
    local.release(rs)


def test_out_of_bounds_write_is_rejected_before_posting(peer, local):
    proc, endpoint, banks = peer
    src = np.ones(4096, np.uint8)
    rs = local.register_buffer(src)
    bad = TransferPlan("bad", [0], [3], [BANK_BYTES - 100], [4096], 4096, ())
    with pytest.raises(PlanOutOfBounds, match=r"write 0 writes region 3 bytes"):
        local.post(bad, rs, banks)
    proc.stdin.write("crc\n"), proc.stdin.flush()
    import zlib
    assert json.loads(proc.stdout.readline())[3] == zlib.crc32(bytes(BANK_BYTES))
    local.release(rs)


def test_killed_peer_is_peer_lost(peer, local):
    proc, endpoint, banks = peer
    src = np.ones(4096, np.uint8)
    rs = local.register_buffer(src)
    proc.kill(), proc.wait(timeout=10)
    plan = TransferPlan("one", [0], [0], [0], [4096], 4096, ())
    with pytest.raises(PeerLost, match=f"peer {endpoint['id']} is gone"):
        local.submit(plan, rs, banks, timeout_s=20)
    local.release(rs)


def test_rdma_request_detects_silent_tcp_fallback():
    """Mooncake asked for rdma without an HCA uses TCP without saying so: we must say so."""
    if verbs.rdma_devices():
        t = make_transport("mooncake", host="127.0.0.1", protocol="rdma")
        try:
            assert t.hcas, "an RDMA device exists, so the engine must report an HCA"
        finally:
            t.close()
        return
    with pytest.raises(TransportUnavailable, match="silently fall back to TCP"):
        make_transport("mooncake", host="127.0.0.1", protocol="rdma")
