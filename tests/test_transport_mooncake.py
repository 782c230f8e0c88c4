"""Mooncake Transfer Engine between two processes on loopback (TCP), and its RDMA fallback."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hardware.transfer_plan import TransferPlan
from hardware.transport import (
    PeerLost, PlanOutOfBounds, Region, TransferFailed, TransportUnavailable, make_transport,
)
from hardware.transport import verbs
from tests import needs

needs.mooncake_engine()

ROOT = Path(__file__).resolve().parent.parent
NUM_BANKS, BANK_BYTES = 4, 1 << 20

# The peer: registers banks, prints its endpoint and regions, then answers "sum" / "quit".
PEER = textwrap.dedent(f"""
    import json, sys, zlib
    import numpy as np
    from hardware.transport import make_transport
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    banks = [np.zeros({BANK_BYTES}, np.uint8) for _ in range({NUM_BANKS})]
    regions = [t.register_buffer(b, peer_access=True).to_wire() for b in banks]
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


# -- who can reach the engine ------------------------------------------------------------------

def listening_sockets() -> dict:
    """fd -> (address, port, device) of this process's listening TCP sockets."""
    import os
    import socket
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(name))
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with s:
            try:
                if s.type == socket.SOCK_STREAM and \
                        s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    dev = s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, 16)
                    found[int(name)] = (*s.getsockname()[:2], dev.rstrip(b"\0").decode())
            except OSError:
                pass
    return found


def test_every_engine_listener_is_pinned_to_loopback():
    before = listening_sockets()
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    try:
        new = {fd: v for fd, v in listening_sockets().items() if fd not in before}
        ports = {port for _, port, _ in new.values()}
        assert int(t.id.rsplit(":", 1)[1]) in ports and len(new) >= 2, new   # RPC and data
        for address, port, device in new.values():
            assert address == "127.0.0.1" or device == "lo", \
                f"{address}:{port} is reachable from other interfaces"
        assert sorted((a, p) for a, p, _ in t.listeners) == sorted((a, p) for a, p, _ in
                                                                     new.values())
    finally:
        t.close()


def test_a_pinned_listener_refuses_connections_from_other_interfaces():
    """What pinning does on this kernel: a socket listening on every address, pinned to a
    device other than ``lo``, refuses a connection that arrives on ``lo``."""
    import socket
    from hardware.transport.mooncake import pin_listeners
    others = [name for _, name in socket.if_nameindex() if name != "lo"]
    if not others:
        pytest.skip("no network device other than lo to pin to")
    for device, reachable in ((others[0], False), ("lo", True)):
        listener = socket.create_server(("0.0.0.0", 0))
        port = listener.getsockname()[1]
        assert pin_listeners({listener.fileno(): ("0.0.0.0", port)}, device, port) == \
            [("0.0.0.0", port, device)]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=30).close()
            connected = True
        except ConnectionRefusedError:
            connected = False
        listener.close()
        assert connected == reachable, f"pinned to {device}"


def test_listeners_cannot_be_pinned_for_a_foreign_host():
    with pytest.raises(TransportUnavailable, match="192.0.2.254.*not an address of a network"):
        make_transport("mooncake", host="192.0.2.254", protocol="tcp")


def test_local_only_regions_are_not_registered_with_the_engine(local):
    """A region registered without peer access is invisible to a peer; the engine refuses."""
    mine = np.full(4096, 3, np.uint8)
    region = local.register_buffer(mine)
    assert local.open_to_peers() == []
    other = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    try:
        loot = np.zeros(4096, np.uint8)
        rl = other.register_buffer(loot)
        plan = TransferPlan("steal", [0], [0], [0], [4096], 4096, (4096,))
        with pytest.raises(TransferFailed):
            other.submit(plan, Region(region.address, 4096, owner=local.id), [rl], op="read",
                         timeout_s=20)
        assert not loot.any()
        other.release(rl)
    finally:
        other.close()
    local.release(region)


def test_the_engine_keeps_its_own_log_lines_off_the_terminal():
    code = ("from hardware.transport import make_transport\n"
            "t = make_transport('mooncake', host='127.0.0.1', protocol='tcp')\n"
            "t.close()\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MC_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    chatter = [line for line in out.stderr.splitlines() if line[:1] in "IWE" and
               line[1:5].isdigit()]
    assert chatter == []       # glog's I/W lines (topology, metrics, malloc), its start-up E line
    assert "InitGoogleLogging" not in out.stderr


def test_only_the_engines_start_up_noise_is_held_back():
    code = textwrap.dedent("""
        import os, sys
        from hardware.transport.mooncake import engine_stderr_filtered
        with engine_stderr_filtered():
            os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\\n")
            os.write(2, b"E1202 14:19:31.2 16596 transfer_metadata.cpp:1098] Local segment "
                        b"descriptor not found\\n")
            os.write(2, b"E1202 14:19:31.3 16596 tcp_transport.cpp:80] connect failed\\n")
            print("python's own", file=sys.stderr)
        print("after", file=sys.stderr)
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["E1202 14:19:31.3 16596 tcp_transport.cpp:80] connect "
                                       "failed", "python's own", "after"]
