"""Algorithm 1 across two processes on loopback over the Mooncake Transfer Engine (TCP)."""

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hardware.protocol import DecodeClient, PrefillServer, recv_msg, send_msg
from hardware.transport import PeerLost, TransferFailed, TransportError, make_transport
from hardware.transport.buffers import BytesSource, StripedSink
from tests import needs

needs.mooncake_engine()

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "two-process-token"
MIB = 1 << 20

# The prefill process: seeded payloads r0 (3 MiB) and r1 (1 MiB + 5), prints its address.
PREFILL = textwrap.dedent("""
    import json, os, numpy as np
    from hardware.protocol import PrefillServer
    from hardware.transport import make_transport
    from hardware.transport.buffers import BytesSource
    rng = np.random.default_rng(7)
    data = {"r0": rng.integers(0, 256, 3 << 20, dtype=np.uint8),
            "r1": rng.integers(0, 256, (1 << 20) + 5, dtype=np.uint8)}
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    send = np.zeros(8 << 20, np.uint8)
    server = PrefillServer(t, send, BytesSource(data), os.environ["HAWK_TOKEN"],
                           segment_bytes=1 << 20)
    print(json.dumps({"address": list(server.address), "engine": t.id,
                      "send_buffer": int(send.ctypes.data)}), flush=True)
    server.serve_forever()
""")


def expected(rid):
    rng = np.random.default_rng(7)
    data = {"r0": rng.integers(0, 256, 3 << 20, dtype=np.uint8),
            "r1": rng.integers(0, 256, (1 << 20) + 5, dtype=np.uint8)}
    return data[rid].tobytes()


def read_line(proc, timeout_s=120.0) -> str:
    """The child's next stdout line; fails (never hangs) if none comes. The limit only bounds
    a broken run: a loaded machine slows a child down, it never makes one answer early."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            pytest.fail(f"child process printed nothing within {timeout_s} s")
    return proc.stdout.readline()


@pytest.fixture
def prefill_hello():
    env = {**os.environ, "HAWK_TOKEN": TOKEN, "GLOG_minloglevel": "2"}
    proc = subprocess.Popen([sys.executable, "-c", PREFILL], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        hello = json.loads(read_line(proc))
        address = tuple(hello["address"])
        yield proc, address, hello
        if proc.poll() is None:
            held = peer_reserved(address)
            assert held == [], f"the prefill process still holds {held}"
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.fixture
def prefill_process(prefill_hello):
    proc, address, _ = prefill_hello
    return proc, address


def peer_reserved(address, timeout_s=60.0) -> list:
    """The prefill process's send-buffer reservations, once they settle (leak check)."""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(address, timeout=timeout_s) as s:
        while True:
            send_msg(s, {"op": "reserved", "token": TOKEN})
            held = recv_msg(s, "prefill process", frame_s=timeout_s)["reserved"]
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(0.05)


@pytest.fixture
def decode_side():
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    banks = [np.zeros(2 * MIB, np.uint8) for _ in range(4)]
    sink = StripedSink(t, banks, chunk_bytes=256 * 1024, max_request_bytes=4 * MIB)
    yield t, sink
    leaks = sink.reserved()
    sink.close()
    leaks = (leaks, t.live_regions())
    t.close()
    assert leaks == (0, []), f"left reserved: {leaks}"


def test_pull_across_processes_is_byte_exact(prefill_process, decode_side):
    _, address = prefill_process
    t, sink = decode_side
    with DecodeClient(t, sink, address, TOKEN, timeout_s=20) as client:
        for rid in ("r0", "r1", "r0"):
            result = client.pull(rid)
            assert result.output == expected(rid), f"{rid} differs"


class KillingSink(StripedSink):
    """Kills the prefill process after its answer and before the batch is posted."""

    def __init__(self, victim, *args, **kw):
        super().__init__(*args, **kw)
        self.victim = victim

    def plan(self, request_id, dest, meta):
        self.victim.send_signal(signal.SIGKILL)
        self.victim.wait(timeout=10)
        return super().plan(request_id, dest, meta)


def test_prefill_killed_mid_transfer(prefill_process, decode_side):
    proc, address = prefill_process
    t, _ = decode_side
    sink = KillingSink(proc, t, [np.zeros(2 * MIB, np.uint8) for _ in range(2)],
                       chunk_bytes=256 * 1024, max_request_bytes=4 * MIB)
    try:
        client = DecodeClient(t, sink, address, TOKEN, timeout_s=20)
        with pytest.raises(TransferFailed, match="is gone"):
            client.pull("r0")
        assert not sink.reserved()
        with pytest.raises(PeerLost):
            client.pull("r1")
        client.close()
    finally:
        sink.close()


DECODE = textwrap.dedent("""
    import json, os, sys, numpy as np
    from hardware.protocol import DecodeClient
    from hardware.transport import make_transport
    from hardware.transport.buffers import StripedSink
    class Dying(StripedSink):
        def plan(self, request_id, dest, meta):
            print("answered", flush=True)
            os._exit(9)
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    sink = Dying(t, [np.zeros(1 << 20, np.uint8)], 1 << 16, 1 << 20)
    client = DecodeClient(t, sink, tuple(json.loads(sys.argv[1])), os.environ["HAWK_TOKEN"])
    client.pull("r0")
""")


def test_decode_killed_mid_request_releases_the_send_buffer():
    t = make_transport("mooncake", host="127.0.0.1", protocol="tcp")
    data = {"r0": np.ones(MIB, np.uint8)}
    server = PrefillServer(t, np.zeros(2 * MIB, np.uint8), BytesSource(data), TOKEN).start()
    env = {**os.environ, "HAWK_TOKEN": TOKEN, "GLOG_minloglevel": "2"}
    proc = subprocess.Popen([sys.executable, "-c", DECODE, json.dumps(list(server.address))],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert read_line(proc).strip() == "answered"
        assert proc.wait(timeout=120) == 9
        deadline = time.monotonic() + 60
        while server.reserved() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.reserved(), "a dead decode peer must not pin the send buffer"
    finally:
        proc.kill()
        proc.wait(timeout=60)
        server.stop()
        leaks = t.live_regions()
        t.close()
    assert not leaks


def test_wrong_token_across_processes(prefill_process, decode_side):
    _, address = prefill_process
    t, sink = decode_side
    with pytest.raises(TransportError, match="wrong token"):
        DecodeClient(t, sink, address, "not-the-token-at-all", timeout_s=20)


def test_concurrent_pulls_share_the_send_buffer(prefill_process, decode_side):
    _, address = prefill_process
    t, sink = decode_side
    errors, lock = [], threading.Lock()
    clients = [DecodeClient(t, sink, address, TOKEN, timeout_s=20) for _ in range(2)]

    def run(client, rid):
        try:
            assert client.pull(rid).output == expected(rid)
        except Exception as e:      # noqa: BLE001  (collected and asserted below)
            with lock:
                errors.append(repr(e))
    threads = [threading.Thread(target=run, args=(c, r)) for c, r in zip(clients, ("r0", "r1"))]
    [th.start() for th in threads]
    [th.join(timeout=300) for th in threads]
    assert not any(th.is_alive() for th in threads), "a pull is still running"
    [c.close() for c in clients]
    assert not errors


# A third process that has no token: it may know every address, and tries the control port,
# then reads and writes over its own Mooncake engine. It prints what each attempt returned.
INTRUDER = textwrap.dedent("""
    import json, socket, struct, sys
    import numpy as np
    from mooncake.engine import TransferEngine
    target = json.loads(sys.argv[1])
    out = {}
    s = socket.create_connection(tuple(target["address"]), timeout=30)
    body = json.dumps({"op": "pull", "request_id": "r0", "token": "guessed-token-0000"}).encode()
    s.sendall(struct.pack("!I", len(body)) + body)
    n = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))[0]
    out["control"] = json.loads(s.recv(n, socket.MSG_WAITALL))
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    loot = np.zeros(1 << 20, np.uint8)
    junk = np.full(1 << 20, 0xEE, np.uint8)
    out["read_send_buffer"] = e.transfer_sync_read(target["engine"], loot.ctypes.data,
                                                   target["send_buffer"], 1 << 20)
    out["write_send_buffer"] = e.transfer_sync_write(target["engine"], junk.ctypes.data,
                                                     target["send_buffer"], 1 << 20)
    out["read_banks"] = e.transfer_sync_read(target["decode"], loot.ctypes.data,
                                             target["bank"], 1 << 20)
    out["write_banks"] = e.transfer_sync_write(target["decode"], junk.ctypes.data,
                                               target["bank"], 1 << 20)
    out["loot"] = int(loot.any())
    print(json.dumps(out), flush=True)
""")


def test_a_tokenless_third_process_cannot_read_or_write(prefill_hello, decode_side):
    _, address, hello = prefill_hello
    t, sink = decode_side
    with DecodeClient(t, sink, address, TOKEN, timeout_s=120) as client:
        assert client.pull("r0").output == expected("r0")
        target = {**hello, "decode": t.id, "bank": int(sink.banks[0].ctypes.data)}
        bank_before = sink.banks[0].copy()
        env = {**os.environ, "GLOG_minloglevel": "3"}
        intruder = subprocess.Popen([sys.executable, "-c", INTRUDER, json.dumps(target)],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        try:
            out = json.loads(read_line(intruder))
        finally:
            intruder.kill()
            intruder.wait(timeout=60)
        assert out["control"]["error"] == "AuthError"
        for attempt in ("read_send_buffer", "write_send_buffer", "read_banks", "write_banks"):
            assert out[attempt] != 0, f"{attempt} succeeded without the token"
        assert out["loot"] == 0
        assert np.array_equal(sink.banks[0], bank_before), "the decode banks were written"
        assert client.pull("r0").output == expected("r0"), "the send buffer was not touched"
