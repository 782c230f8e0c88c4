"""Algorithm 1 between a prefill server and a decode client in one process (loopback double)."""

import json
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hardware.transfer_plan import TransferPlan
from hardware.protocol import DecodeClient, PrefillServer, recv_msg, send_msg
from hardware.transport import (
    AuthError, ChecksumMismatch, PeerLost, PlanOutOfBounds, ProtocolError, Region,
    RegistrationError, SendBufferExhausted, TransferFailed, TransferTimeout, UnknownRequest,
    make_transport,
)
from hardware.transport.buffers import BytesSource, Reservations, StripedSink
from hardware.transport.loopback import LoopbackFabric

TOKEN = "s3cret-token-0123456789"
KIB = 1024


def payloads(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}


class Cluster:
    """A prefill server and decode clients on one fabric, with a leak check at the end."""

    def __init__(self, data, send_bytes=256 * KIB, lease_s=30.0, **server_kw):
        self.fabric = LoopbackFabric()
        self.p = make_transport("loopback", fabric=self.fabric)
        self.d = make_transport("loopback", fabric=self.fabric)
        self.send = np.zeros(send_bytes, np.uint8)
        self.server = PrefillServer(self.p, self.send, BytesSource(data), TOKEN,
                                    lease_s=lease_s, **server_kw).start()
        self.banks = [np.zeros(128 * KIB, np.uint8) for _ in range(4)]
        self.sink = StripedSink(self.d, self.banks, chunk_bytes=4 * KIB,
                                max_request_bytes=128 * KIB)
        self.clients = []

    def client(self, token=TOKEN, sink=None, timeout_s=5.0):
        c = DecodeClient(self.d, sink or self.sink, self.server.address, token, timeout_s)
        self.clients.append(c)
        return c

    def raw(self):
        """A bare control connection that has said hello."""
        s = socket.create_connection(self.server.address, timeout=5)
        send_msg(s, {"op": "hello", "token": TOKEN, "endpoint": self.d.endpoint()})
        assert recv_msg(s, "test")["ok"]
        return s

    def close(self):
        for c in self.clients:
            c.close()
        wait_until(lambda: not self.server.reserved())
        leaks = {"send buffer": self.server.reserved(), "sink": self.sink.reserved()}
        self.server.stop()
        self.sink.close()
        leaks["regions"] = self.p.live_regions() + self.d.live_regions()
        self.p.close(), self.d.close()
        assert not any(leaks.values()), f"left reserved: {leaks}"


def wait_until(cond, timeout_s=60.0):
    """Poll ``cond`` until it holds; the limit only bounds a broken run, never a passing one."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.fixture
def make_cluster():
    made = []

    def make(data, **kw):
        made.append(Cluster(data, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def test_pull_moves_the_prepared_bytes_exactly(make_cluster):
    data = payloads([100 * KIB, 5 * KIB + 3])
    c = make_cluster(data)
    client = c.client()
    for rid, payload in data.items():
        result = client.pull(rid)
        assert result.output == payload.tobytes()
        assert result.num_writes == -(-payload.size // (4 * KIB))
        assert not c.server.reserved() and not c.sink.reserved()


def test_control_socket_binds_loopback_by_default(make_cluster):
    c = make_cluster(payloads([KIB]))
    assert c.server.address[0] == "127.0.0.1"


def test_wrong_token_is_refused_and_server_keeps_serving(make_cluster):
    c = make_cluster(payloads([KIB]))
    with pytest.raises(AuthError, match="wrong token"):
        c.client(token="guess-guess-guess-guess")
    assert c.client().pull("r0").output == c.server.source.payloads["r0"].tobytes()


def test_unknown_request_names_the_id(make_cluster):
    c = make_cluster(payloads([KIB]))
    with pytest.raises(UnknownRequest, match="no KV cache for request 'nope'"):
        c.client().pull("nope")


def test_full_send_buffer_pushes_back_then_recovers(make_cluster):
    c = make_cluster(payloads([96 * KIB, 96 * KIB]), send_bytes=128 * KIB)
    held = c.raw()
    send_msg(held, {"op": "pull", "token": TOKEN, "request_id": "r0", "dest": {}})
    assert recv_msg(held, "test")["ok"]
    client = c.client()
    with pytest.raises(SendBufferExhausted, match="no room for request 'r1'"):
        client.pull("r1")
    assert not c.sink.reserved(), "the decode side released its banks after the refusal"
    send_msg(held, {"op": "done", "token": TOKEN, "request_id": "r0"})
    assert recv_msg(held, "test")["ok"]
    assert client.pull("r1").nbytes == 96 * KIB
    held.close()


def test_timeout_keeps_the_receive_space_until_the_late_write_lands(make_cluster):
    c = make_cluster(payloads([8 * KIB, 8 * KIB]))
    client = c.client()
    late = threading.Event()
    c.d.faults.hold = late                  # r0's bytes are in flight until this is set
    with pytest.raises(TransferTimeout, match="not complete after 0.100 s"):
        client.pull("r0", timeout_s=0.1)
    held = lambda: sorted(c.sink.held[0].held)          # noqa: E731
    assert held() == ["r0"], "r0's banks must stay reserved while its write can land"
    c.d.faults.hold = None
    r0_offsets = [h.held["r0"][0] for h in c.sink.held]
    assert client.pull("r1").output == c.server.source.payloads["r1"].tobytes()
    assert held() == ["r0"]
    late.set()
    assert wait_until(lambda: not c.sink.reserved())
    landed = np.concatenate([c.banks[k][o:o + 4 * KIB] for k, o in enumerate(r0_offsets[:2])])
    assert landed.tobytes() == c.server.source.payloads["r0"].tobytes(), \
        "the late write landed in r0's own quarantined space"
    assert not c.server.reserved()


class SlowSource(BytesSource):
    def __call__(self, request_id, dest):
        time.sleep(0.6)
        return super().__call__(request_id, dest)


def test_late_answer_times_out_and_the_prefill_side_still_releases(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    c.server.source = SlowSource(c.server.source.payloads)
    client = c.client(timeout_s=0.2)
    with pytest.raises(TransferTimeout, match="no answer within 0.2 s"):
        client.pull("r0")
    assert not c.sink.reserved()
    assert wait_until(lambda: not c.server.reserved())
    with pytest.raises(PeerLost, match="closed after an earlier failure"):
        client.pull("r0")


def test_failed_transfer_releases_both_sides(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    c.d.faults.fail = OSError("link down")
    with pytest.raises(TransferFailed):
        c.client().pull("r0")
    assert not c.server.reserved() and not c.sink.reserved()


def test_corrupted_bytes_fail_the_segment_mac_by_default(make_cluster):
    c = make_cluster(payloads([64 * KIB]))              # no integrity settings at all
    client = c.client()
    c.d.faults.corrupt = True
    with pytest.raises(ChecksumMismatch, match="1 of 1 segments differ"):
        client.pull("r0")
    assert client.pull("r0").output == c.server.source.payloads["r0"].tobytes()


def test_corrupted_segment_is_named(make_cluster):
    c = make_cluster(payloads([64 * KIB]), segment_bytes=16 * KIB)
    client = c.client()
    c.d.faults.corrupt = True
    with pytest.raises(ChecksumMismatch, match="1 of 4 segments differ, first segment 3"):
        client.pull("r0")


def test_a_client_checking_integrity_refuses_an_answer_without_macs(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    unchecked = c.client()
    unchecked.integrity = False
    assert unchecked.pull("r0").output == c.server.source.payloads["r0"].tobytes()
    client = c.client()
    client._call = lambda msg, call=client._call: {
        k: v for k, v in call(msg).items() if k != "mac"}
    with pytest.raises(ProtocolError, match="carries no MACs"):
        client.pull("r0")


class OutOfBoundsSink(StripedSink):
    def plan(self, request_id, dest, meta):
        good = super().plan(request_id, dest, meta)
        return TransferPlan("bad", good.src_offset, good.dst_region,
                            good.dst_offset + 128 * KIB, good.nbytes, good.src_size,
                            good.region_sizes)


def test_out_of_bounds_plan_is_rejected_before_posting(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    sink = OutOfBoundsSink(c.d, [np.zeros(128 * KIB, np.uint8)], 4 * KIB, 64 * KIB)
    try:
        with pytest.raises(PlanOutOfBounds, match=r"write 0 writes region 0 bytes \[131072"):
            c.client(sink=sink).pull("r0")
        assert not sink.reserved() and not c.server.reserved()
    finally:
        sink.close()


def test_dropped_decode_connection_releases_its_reservations(make_cluster):
    c = make_cluster(payloads([8 * KIB, 8 * KIB]))
    s = c.raw()
    for rid in ("r0", "r1"):
        send_msg(s, {"op": "pull", "token": TOKEN, "request_id": rid, "dest": {}})
        assert recv_msg(s, "test")["ok"]
    assert len(c.server.reserved()) == 2
    s.close()
    assert wait_until(lambda: not c.server.reserved())


def test_reserved_op_lists_what_the_send_buffer_holds(make_cluster):
    c = make_cluster(payloads([8 * KIB, 8 * KIB]))
    client, s = c.client(), c.raw()
    assert client.peer_reserved() == []
    send_msg(s, {"op": "pull", "token": TOKEN, "request_id": "r1", "dest": {}})
    assert recv_msg(s, "test")["ok"]
    assert client.peer_reserved() == ["r1"]
    client.pull("r0")
    assert client.peer_reserved() == ["r1"]
    send_msg(s, {"op": "done", "token": TOKEN, "request_id": "r1"})
    assert recv_msg(s, "test")["ok"]
    assert client.peer_reserved() == []
    send_msg(s, {"op": "reserved", "token": "guess"})
    assert recv_msg(s, "test")["error"] == "AuthError"
    s.close()


def test_expired_lease_is_released(make_cluster):
    c = make_cluster(payloads([8 * KIB]), lease_s=0.2)
    s = c.raw()
    send_msg(s, {"op": "pull", "token": TOKEN, "request_id": "r0", "dest": {}})
    assert recv_msg(s, "test")["ok"]
    assert wait_until(lambda: not c.server.reserved())
    assert any("lease of 0.2 s expired" in e for e in c.server.errors)
    s.close()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=40))
def test_reservations_never_overlap_and_release_everything(ops):
    r = Reservations(1024, align=64)
    live = []
    for i, (release, n) in enumerate(ops):
        if release and live:
            assert r.release(live.pop(0))
            continue
        try:
            r.reserve(f"k{i}", n)
            live.append(f"k{i}")
        except SendBufferExhausted:
            pass
        spans = sorted(r.held.values())
        assert all(o + n <= 1024 for o, n in spans)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for k in live:
        r.release(k)
    assert not r.held and r.used_bytes == 0


# -- a third party without the token ---------------------------------------------------------

class TamperingSink(StripedSink):
    """Lets a third endpoint, which has no token, overwrite the open range before the read."""

    def __init__(self, attacker, *args, **kw):
        super().__init__(*args, **kw)
        self.attacker, self.source = attacker, None

    def plan(self, request_id, dest, meta):
        good = super().plan(request_id, dest, meta)
        region = self.source()
        junk = np.full(64, 0xEE, np.uint8)
        own = self.attacker.register_buffer(junk)
        self.attacker.submit(TransferPlan("tamper", [0], [0], [100], [64], 64,
                                          (region.nbytes,)), own, [region], op="write")
        self.attacker.release(own)
        return good


def test_a_tokenless_writer_in_the_open_window_is_caught_by_the_mac(make_cluster):
    c = make_cluster(payloads([32 * KIB]))
    attacker = make_transport("loopback", fabric=c.fabric)
    sink = TamperingSink(attacker, c.d, [np.zeros(64 * KIB, np.uint8)], 4 * KIB, 64 * KIB)
    sink.source = lambda: c.p.open_to_peers()[0]         # it learned the address somehow
    try:
        with pytest.raises(ChecksumMismatch, match="1 of 1 segments differ"):
            c.client(sink=sink).pull("r0")
        assert not sink.reserved()
    finally:
        sink.close()
        attacker.close()


def test_nothing_is_open_to_peers_outside_a_pull(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    attacker = make_transport("loopback", fabric=c.fabric)
    assert c.p.open_to_peers() == [] and c.d.open_to_peers() == []
    client = c.client()
    client.pull("r0")
    assert c.p.open_to_peers() == [] and c.d.open_to_peers() == []
    # a reader that guessed the send buffer's address and the key of the range it held
    guess = TransferPlan("steal", [0], [0], [0], [8 * KIB], 8 * KIB, (8 * KIB,))
    loot = np.zeros(8 * KIB, np.uint8)
    mine = attacker.register_buffer(loot)
    for key in range(1, 5):
        with pytest.raises(RegistrationError, match="not inside a region open to peers"):
            attacker.submit(guess, Region(c.send.ctypes.data, 8 * KIB, key, c.p.id), [mine],
                            op="read")
        with pytest.raises(RegistrationError, match="not inside a region open to peers"):
            attacker.submit(guess, mine, [Region(c.banks[0].ctypes.data, 8 * KIB, key,
                                                 c.d.id)], op="write")
    assert not loot.any()
    attacker.release(mine)
    attacker.close()


def test_the_hello_answer_names_no_address(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    s = socket.create_connection(c.server.address, timeout=30)
    send_msg(s, {"op": "hello", "token": TOKEN, "endpoint": c.d.endpoint()})
    reply = recv_msg(s, "test")
    assert reply["ok"] and set(reply) == {"ok", "endpoint"}
    s.close()


# -- the wire: deadlines, caps, malformed messages --------------------------------------------

def connect(c):
    return socket.create_connection(c.server.address, timeout=30)


def test_a_half_sent_frame_cannot_hold_a_server_thread(make_cluster):
    c = make_cluster(payloads([8 * KIB]), frame_s=0.3, max_connections=2)
    stalled = []
    for _ in range(2):
        s = connect(c)
        s.sendall(struct.pack("!I", 200) + b'{"op": "hel')     # then silence
        stalled.append(s)
    for s in stalled:                                          # the server hangs up on each
        assert s.recv(1 << 16) == b""
    assert wait_until(lambda: sum("stalled: 11 of 200 B" in e for e in c.server.errors) == 2)
    assert c.client().pull("r0").nbytes == 8 * KIB            # and both slots are free again
    [s.close() for s in stalled]


def test_a_connection_that_never_shows_the_token_is_closed(make_cluster):
    c = make_cluster(payloads([8 * KIB]), frame_s=0.3)
    s = connect(c)
    assert s.recv(1) == b""
    assert wait_until(lambda: any("no token within 0.3 s" in e for e in c.server.errors))
    s.close()


def test_half_an_answer_cannot_hold_the_client():
    listener = socket.create_server(("127.0.0.1", 0))

    def half_answer():
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        conn.sendall(struct.pack("!I", 100) + b'{"ok": tr')    # 9 of 100 B, then silence
        time.sleep(30)
        conn.close()
    threading.Thread(target=half_answer, daemon=True).start()
    fabric = LoopbackFabric()
    d = make_transport("loopback", fabric=fabric)
    outcome = []

    def connect_client():
        try:
            DecodeClient(d, None, listener.getsockname(), TOKEN, timeout_s=0.5)
        except Exception as e:          # noqa: BLE001  (asserted below)
            outcome.append(e)
    t = threading.Thread(target=connect_client, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the client is still waiting for the rest of the answer"
    assert isinstance(outcome[0], TransferTimeout)
    assert "stalled: 9 of 100 B" in str(outcome[0])
    listener.close()
    d.close()


def test_frames_are_capped_before_the_token_is_shown(make_cluster):
    c = make_cluster(payloads([8 * KIB]))
    s = connect(c)
    s.sendall(struct.pack("!I", 1 << 20))                      # 1 MiB, before any token
    reply = recv_msg(s, "test")
    assert reply["error"] == "ProtocolError" and "exceeds 65536 B" in reply["message"]
    assert s.recv(1) == b""
    s.close()
    big = c.raw()                                               # after hello: up to MAX_MESSAGE
    send_msg(big, {"op": "reserved", "token": TOKEN, "pad": "x" * (1 << 20)})
    assert recv_msg(big, "test") == {"ok": True, "reserved": []}
    big.close()


def test_connections_beyond_the_cap_are_refused_with_an_answer(make_cluster):
    c = make_cluster(payloads([8 * KIB]), max_connections=2)
    held = [c.raw(), c.raw()]
    extra = connect(c)
    reply = recv_msg(extra, "test")
    assert reply["error"] == "ProtocolError" and "too many connections (at most 2)" in \
        reply["message"]
    extra.close()
    held.pop().close()
    assert wait_until(lambda: c.server._open_conns < 2)
    assert c.client().pull("r0").nbytes == 8 * KIB
    held[0].close()


@pytest.mark.parametrize("message, error, text", [
    ([1, 2, 3], "ProtocolError", "message is a JSON list, expected an object"),
    ("pull", "ProtocolError", "message is a JSON str, expected an object"),
    ({"op": "hello", "token": "tökén-ünïcode-🙂"}, "AuthError", "wrong token"),
    ({"op": "hello", "token": 12345}, "AuthError", "wrong token"),
    ({"op": "hello", "token": ["a"]}, "AuthError", "wrong token"),
    ({"op": "pull", "token": TOKEN, "request_id": 7}, "ProtocolError",
     "field 'request_id': expected a JSON string, got int"),
    ({"op": "pull", "token": TOKEN, "request_id": "r0", "dest": [1]}, "ProtocolError",
     "field 'dest': expected a JSON object, got list"),
    ({"op": "pull", "token": TOKEN, "request_id": "r0", "mac": "yes"}, "ProtocolError",
     "field 'mac': expected a JSON boolean, got str"),
    ({"op": "hello", "token": TOKEN, "endpoint": "x"}, "ProtocolError",
     "field 'endpoint': expected a JSON object, got str"),
    ({"op": "done", "token": TOKEN, "request_id": None}, "ProtocolError",
     "field 'request_id': expected a JSON string, got NoneType"),
    ({"op": {"nested": 1}, "token": TOKEN}, "ProtocolError", "unknown op"),
])
def test_malformed_messages_get_an_error_answer(make_cluster, message, error, text):
    c = make_cluster(payloads([8 * KIB]))
    s = connect(c)
    body = json.dumps(message).encode()
    s.sendall(struct.pack("!I", len(body)) + body)
    reply = recv_msg(s, "test")
    assert reply["ok"] is False and reply["error"] == error and text in reply["message"]
    s.close()
    assert c.client().pull("r0").nbytes == 8 * KIB            # the server still serves


def test_tokens_must_be_long_printable_secrets():
    from hardware.protocol import check_token, new_token
    for bad in ("", "short", "x" * 15, "tökén-with-accents", 12345, None, "tab\there-long-enough"):
        with pytest.raises(ValueError, match="at least 16 characters"):
            check_token(bad)
    assert check_token(new_token()) and new_token() != new_token()


def test_the_router_and_the_workers_share_one_framing():
    # asyncio streams (the router) and blocking sockets (workers, Algorithm 1): one encoding
    import asyncio

    from hardware import wire

    class Writer:
        def __init__(self):
            self.data = b""

        def write(self, data):
            self.data += data

    def read(data: bytes, *args):
        async def go():
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            return await wire.read_frame(reader, *args)
        return asyncio.run(go())

    msg = {"op": "decode", "rid": "r0", "prompt": [1, 2, 3], "text": "é"}
    w = Writer()
    wire.write_frame(w, msg)
    a, b = socket.socketpair()
    send_msg(a, msg)
    assert b.recv(len(w.data) + 1) == w.data == wire.encode(msg)
    a.close(), b.close()
    assert read(w.data) == msg
    hello = struct.pack("!I", wire.MAX_HELLO + 1) + b"x" * (wire.MAX_HELLO + 1)
    with pytest.raises(ProtocolError, match="worker: message of 65537 B exceeds 65536 B"):
        read(hello, "worker", wire.MAX_HELLO)
    for body, why in ((b"[1]", "a JSON list"), (b"{x", "not JSON")):
        with pytest.raises(ProtocolError, match=why):
            read(struct.pack("!I", len(body)) + body)
    with pytest.raises(PeerLost, match="closed by the peer"):
        read(w.data[:-1])
