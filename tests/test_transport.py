"""The transport interface on the in-process double, and the pyverbs plan translation."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hardware.transfer_plan import TransferPlan
from hardware.transport import (
    PeerLost, PlanOutOfBounds, Region, RegistrationError, TransferFailed, TransferTimeout,
    TransportUnavailable, make_transport,
)
from hardware.transport.loopback import LoopbackFabric
from hardware.transport import verbs
from tests import needs

ROOT = Path(__file__).resolve().parent.parent

def make_plan(writes, src_size, region_sizes, kind="test"):
    """writes: (src_offset, dst_region, dst_offset, nbytes) rows."""
    cols = np.array(writes, dtype=np.int64).reshape(-1, 4)
    return TransferPlan(kind, cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], src_size,
                        tuple(region_sizes))


@pytest.fixture
def pair():
    """Two loopback endpoints; at the end nothing may stay registered."""
    fabric = LoopbackFabric()
    a, b = make_transport("loopback", fabric=fabric), make_transport("loopback", fabric=fabric)
    yield a, b
    leaks = [(t.id, r) for t in (a, b) for r in t.live_regions()]
    a.close(), b.close()
    assert not leaks, f"regions left registered: {leaks}"


def banks(n, size):
    return [np.zeros(size, np.uint8) for _ in range(n)]


def test_write_plan_lands_bytes_in_each_bank(pair):
    a, b = pair
    src = np.arange(64, dtype=np.uint8)
    dst = banks(2, 32)
    rs = a.register_buffer(src)
    rd = [b.register_buffer(x, peer_access=True) for x in dst]
    plan = make_plan([(0, 1, 0, 16), (16, 0, 8, 16), (32, 1, 16, 16)], 64, (32, 32))
    a.submit(plan, rs, rd, op="write")
    assert dst[1][:16].tolist() == list(range(16))
    assert dst[0][8:24].tolist() == list(range(16, 32))
    assert dst[1][16:32].tolist() == list(range(32, 48))
    a.release(rs)
    for r in rd:
        b.release(r)


def test_read_plan_pulls_into_local_banks(pair):
    a, b = pair
    src = np.arange(32, dtype=np.uint8)
    dst = banks(2, 16)
    rs = a.register_buffer(src, peer_access=True)
    rd = [b.register_buffer(x) for x in dst]
    plan = make_plan([(0, 0, 0, 16), (16, 1, 0, 16)], 32, (16, 16))
    b.submit(plan, rs, rd, op="read")
    assert np.concatenate(dst).tolist() == list(range(32))
    a.release(rs)
    [b.release(r) for r in rd]


@pytest.mark.parametrize("write, where", [
    ((0, 0, 10, 8), "region 0 bytes [10, 18) outside [0, 16)"),
    ((30, 0, 0, 8), "source bytes [30, 38) outside [0, 32)"),
    ((0, 2, 0, 8), "targets region 2, only 2 registered"),
])
def test_out_of_bounds_plan_is_rejected_before_posting(pair, write, where):
    a, b = pair
    src, dst = np.arange(32, dtype=np.uint8), banks(2, 16)
    rs, rd = a.register_buffer(src), [b.register_buffer(x, peer_access=True) for x in dst]
    plan = make_plan([(0, 1, 0, 8), write], 32, (16, 16))
    with pytest.raises(PlanOutOfBounds, match=where.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        a.post(plan, rs, rd, op="write")
    assert not dst[1].any(), "the valid first write must not have been posted"
    a.close(), b.close()


def test_local_range_must_be_registered(pair):
    a, b = pair
    src, dst = np.arange(32, dtype=np.uint8), banks(1, 32)
    rd = [b.register_buffer(dst[0], peer_access=True)]
    fake = Region(src.ctypes.data, 32, owner=a.id)
    with pytest.raises(PlanOutOfBounds, match="not inside a registered region"):
        a.post(make_plan([(0, 0, 0, 8)], 32, (32,)), fake, rd)
    b.release(rd[0])


def test_remote_key_must_match_the_peer_registration(pair):
    a, b = pair
    src, dst = np.arange(16, dtype=np.uint8), banks(1, 16)
    rs, rd = a.register_buffer(src), b.register_buffer(dst[0], peer_access=True)
    forged = Region(rd.address, rd.nbytes, key=rd.key + 1, owner=rd.owner)
    with pytest.raises(RegistrationError, match=f"key {rd.key + 1} does not match"):
        a.submit(make_plan([(0, 0, 0, 16)], 16, (16,)), rs, [forged])
    assert not dst[0].any()
    a.release(rs), b.release(rd)


def test_release_of_unknown_region_names_it(pair):
    a, _ = pair
    with pytest.raises(RegistrationError, match="0x1000 .*not registered"):
        a.release(Region(0x1000, 8))


def test_dead_peer_and_injected_failure_and_timeout(pair):
    a, b = pair
    src, dst = np.ones(16, np.uint8), banks(1, 16)
    rs, rd = a.register_buffer(src), [b.register_buffer(dst[0], peer_access=True)]
    plan = make_plan([(0, 0, 0, 16)], 16, (16,))
    a.faults.fail = OSError("link down")
    with pytest.raises(TransferFailed, match="injected failure"):
        a.submit(plan, rs, rd)
    a.faults.delay_s = 0.2
    with pytest.raises(TransferTimeout, match="not complete after 0.050 s"):
        a.submit(plan, rs, rd, timeout_s=0.05)
    b.close()
    with pytest.raises(PeerLost, match=b.id):
        a.submit(plan, rs, rd)
    a.release(rs)


def test_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed .*loopback.*mooncake.*verbs"):
        make_transport("ucx")


# -- pyverbs: translation everywhere, posting only with a device ---------------------------

def make_batch(op="write"):
    fabric = LoopbackFabric()
    t = make_transport("loopback", fabric=fabric)
    src = Region(0x10000, 4096, key=7, owner="peer" if op == "read" else "me")
    dsts = [Region(0x20000 + k * 0x1000, 1024, key=100 + k,
                   owner="peer" if op == "write" else "me") for k in range(3)]
    plan = make_plan([(i * 64, i % 3, (i // 3) * 64, 64) for i in range(7)], 4096,
                     (1024,) * 3)
    from hardware.transport.base import Batch, remote_keys, resolve
    s, d, n = resolve(plan, src, dsts)
    t.close()
    return Batch(op, "peer", s, d, n, remote_keys(plan, src, dsts, op))


def test_verbs_translation_addresses_lengths_keys_chaining():
    batch = make_batch("write")
    lkeys = np.full(7, 55)
    wrs = verbs.work_requests(batch, lkeys, max_chain=3)
    assert len(wrs) == 7
    assert [w.local_addr for w in wrs] == [0x10000 + i * 64 for i in range(7)]
    assert [w.remote_addr for w in wrs] == [0x20000 + (i % 3) * 0x1000 + (i // 3) * 64
                                            for i in range(7)]
    assert {w.length for w in wrs} == {64} and {w.lkey for w in wrs} == {55}
    assert [w.rkey for w in wrs] == [100 + i % 3 for i in range(7)]
    assert [w.next for w in wrs] == [1, 2, None, 4, 5, None, None]
    assert [w.signaled for w in wrs] == [False, False, True, False, False, True, True]
    assert [len(c) for c in verbs.chains(wrs)] == [3, 3, 1]
    assert {w.opcode for w in wrs} == {verbs.WR_RDMA_WRITE}


def test_verbs_read_translation_swaps_local_and_remote():
    batch = make_batch("read")
    wrs = verbs.work_requests(batch, np.full(7, 9))
    assert {w.opcode for w in wrs} == {verbs.WR_RDMA_READ}
    assert wrs[1].local_addr == 0x21000 and wrs[1].remote_addr == 0x10040
    assert {w.rkey for w in wrs} == {7}
    assert [w.signaled for w in wrs] == [False] * 6 + [True]


def test_verbs_work_requests_build_pyverbs_objects():
    e = needs.pyverbs("pyverbs.enums")
    assert (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_READ) == (verbs.WR_RDMA_WRITE,
                                                          verbs.WR_RDMA_READ)
    chain = verbs.chains(verbs.work_requests(make_batch(), np.full(7, 1), max_chain=4))[0]
    objs = verbs.to_send_wrs(chain)
    assert [o.wr_id for o in objs] == [0, 1, 2, 3]
    assert {o.num_sge for o in objs} == {1} and {o.opcode for o in objs} == {0}
    assert [o.send_flags for o in objs] == [0, 0, 0, e.IBV_SEND_SIGNALED]


def test_verbs_posting_needs_a_device():
    if verbs.rdma_devices():
        pytest.skip("an RDMA device is present; see test_verbs_real_write")
    needs.pyverbs()
    with pytest.raises(TransportUnavailable, match="no RDMA device"):
        make_transport("verbs")


def test_verbs_real_write():
    if not verbs.rdma_devices():
        pytest.skip("no RDMA device under /sys/class/infiniband: real posting not possible")
    a, b = make_transport("verbs"), make_transport("verbs")
    try:
        a.connect(b.endpoint()), b.connect(a.endpoint())
        src, dst = np.arange(256, dtype=np.uint8), banks(2, 128)
        rs, rd = a.register_buffer(src), [b.register_buffer(x, peer_access=True) for x in dst]
        plan = make_plan([(0, 1, 0, 128), (128, 0, 0, 128)], 256, (128, 128))
        a.submit(plan, rs, rd, timeout_s=5)
        assert np.concatenate([dst[1], dst[0]]).tolist() == src.tolist()
    finally:
        a.close(), b.close()


# -- Mooncake's RDMA fallback check and lazy imports ------------------------------------------

def test_rdma_hcas_reads_the_engine_topology():
    from hardware.transport.mooncake import rdma_hcas
    topology = json.dumps({"cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2"]],
                           "cuda:0": [["mlx5_1"], []]})
    assert rdma_hcas(topology) == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert rdma_hcas(json.dumps({"cpu:0": [[], []]})) == []     # what TCP fallback reports
    assert rdma_hcas("") == []


def test_importing_the_real_path_imports_no_backend():
    code = ("import sys, hardware.transport, hardware.protocol, hardware.mechanisms, "
            "hardware.transfer_bench, hardware.commands; "
            "print(sorted(m for m in ('mooncake', 'pyverbs', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# -- peer access and late writes ---------------------------------------------------------------

def test_only_regions_opened_to_peers_can_be_reached(pair):
    a, b = pair
    src, dst = np.arange(16, dtype=np.uint8), banks(1, 16)
    rs, closed = a.register_buffer(src), b.register_buffer(dst[0])
    plan = make_plan([(0, 0, 0, 16)], 16, (16,))
    with pytest.raises(RegistrationError, match="not inside a region open to peers"):
        a.submit(plan, rs, [closed])
    with pytest.raises(RegistrationError, match="not inside a region open to peers"):
        b.submit(plan, Region(rs.address, 16, rs.key, a.id), [closed], op="read")
    assert not dst[0].any() and b.open_to_peers() == []
    b.release(closed)
    opened = b.register_buffer(dst[0], peer_access=True)
    assert b.open_to_peers() == [opened]
    a.submit(plan, rs, [opened])
    assert dst[0].tolist() == list(range(16))
    a.release(rs), b.release(opened)
    assert b.open_to_peers() == []


def test_a_timed_out_batch_keeps_its_memory_until_it_settles(pair):
    import threading
    a, b = pair
    src, dst = np.arange(16, dtype=np.uint8), banks(1, 16)
    rs, rd = a.register_buffer(src, peer_access=True), b.register_buffer(dst[0])
    late = threading.Event()
    b.faults.hold = late
    batch = b.post(make_plan([(0, 0, 0, 16)], 16, (16,)), rs, [rd], op="read")
    with pytest.raises(TransferTimeout):
        b.wait(batch, timeout_s=0.05)
    assert not b.settled(batch)
    freed = []
    b.after_settled(batch, lambda: freed.append("rd"))
    b.drain_s = 0.05
    with pytest.raises(RegistrationError, match="is kept: a timed-out read batch of 1 writes"):
        b.release(rd)
    assert b.live_regions() == [rd] and freed == [] and not dst[0].any()
    late.set()
    b.drain_s = 60.0
    b.release(rd)                        # waits for the write, which lands in memory still held
    assert b.settled(batch) and freed == ["rd"]
    assert dst[0].tolist() == list(range(16))
    b.after_settled(batch, lambda: freed.append("now"))
    assert freed == ["rd", "now"]
    a.release(rs)


def test_buffers_and_protocol_do_not_import_each_other():
    """The types both use (Prepared, Region, the errors) live in transport.base."""
    code = ("import sys, hardware.transport.buffers; "
            "print('hardware.protocol' in sys.modules, 'hardware.wire' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
    assert "from hardware.protocol" not in (ROOT / "hardware/transport/buffers.py").read_text()
