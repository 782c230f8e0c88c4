"""Algorithm 1 (docs/paper.md section 4) as a protocol between a prefill and a decode process.

Control messages are length-prefixed JSON over TCP (framing, deadlines, error answers and
MACs in ``hardware.wire``), bound to 127.0.0.1 unless told otherwise, and every message
carries the run's secret token (``new_token()``; at least ``MIN_TOKEN`` characters). Bulk
bytes move on a ``hardware.transport``: the decode side reads them one-sidedly from the one
range of the prefill side's send buffer that holds its request, and that range is open to
peers only from the pull's answer to its ``done``::

    decode (DecodeClient)                          prefill (PrefillServer)
    hello(token, endpoint)                   ->    check token; connect transport
                                             <-    endpoint
    dest = sink.reserve(r)                                                       (D: own space)
    D1  pull(r, dest, mac)                   ->    P1-P7 prepared = source(r, dest) (transform),
                                                   reserve in send buffer, copy, MAC segments,
                                                   open the request's range to peers
                                             <-    region, nbytes, meta, nonce, MACs  | error
    D2-D5 plan = sink.plan(r, dest, meta); post as one batch; wait; verify MACs
    D6-D7 sink.complete(r, meta)                                                 (rebuild)
    D8-D9 sink.release(r); done(r, ok)       ->    P8-P9 close the range, release it
    reserved                                 ->    (any time) request ids holding send buffer

Every reservation is released on success, on error and on timeout: the decode side in a
``finally`` (after a ``TransferTimeout`` only once the timed-out batch has settled, so a late
write never lands in space given to another request); the prefill side on ``done``, when the
control connection drops (peer killed), and when a reservation outlives ``lease_s``. A full
send buffer answers ``SendBufferExhausted`` (back-pressure: the decode side may retry), never
a crash. Every payload segment is MACed by default (``DecodeClient(integrity=True)``): bytes
changed on the way fail the pull with ``ChecksumMismatch``.

The server holds at most ``max_connections`` control connections; one that has not shown the
token may send at most ``wire.MAX_HELLO`` bytes per message and must do so within
``frame_s``. A malformed message (not an object, a token or id of the wrong type) gets an
error answer; no message stops a server thread other than its own connection's.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from hardware.transfer_plan import TransferPlan
from hardware.transport.base import (  # noqa: F401  (Prepared: a public name kept here)
    AuthError, PeerLost, Prepared, ProtocolError, Region, TransferTimeout, Transport,
    TransportError, UnknownRequest, buffer_address,
)
from hardware.transport.buffers import Reservations
from hardware.wire import (  # noqa: F401  (ERRORS, new_token...: public names kept here)
    ERRORS, MAX_HELLO, MAX_MESSAGE, MIN_TOKEN, NoMessage, check_token, error_reply, field,
    mac_context, new_token, raise_for_reply, received_macs, recv_msg, segment_macs, send_msg,
    verify_macs,
)

DEFAULT_SEGMENT_BYTES = 4 << 20    # one MAC per this many payload bytes

# -- the prefill side --------------------------------------------------------------------------
Source = Callable[[str, dict], Prepared]    # (request id, decode side's dest) -> Prepared


@dataclass
class _Held:
    cid: int                # the control connection that pulled it
    deadline: float         # monotonic instant its lease ends
    region: Region          # its range of the send buffer, open to peers


class PrefillServer:
    """Serves pulls of prepared KV caches from one send buffer, one open range per pull."""

    def __init__(self, transport: Transport, send_buffer, source: Source, token: str,
                 host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, max_connections: int = 64,
                 frame_s: float = 10.0) -> None:
        self._key = check_token(token)
        if segment_bytes <= 0 or max_connections <= 0 or frame_s <= 0 or lease_s <= 0:
            raise ValueError(f"prefill: segment_bytes {segment_bytes}, max_connections "
                             f"{max_connections}, frame_s {frame_s} and lease_s {lease_s} "
                             f"must be > 0")
        self.transport, self.source, self.token = transport, source, token
        self.lease_s, self.segment_bytes = lease_s, segment_bytes
        self.max_connections, self.frame_s = max_connections, frame_s
        self.buffer = send_buffer
        self.base, capacity = buffer_address(send_buffer)
        self.reservations = Reservations(capacity)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.1)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open_conns = 0
        self.errors: list[str] = []

    def start(self) -> "PrefillServer":
        t = threading.Thread(target=self._accept_loop, daemon=True, name="prefill-accept")
        t.start()
        self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        self._accept_loop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._sock.close()
        with self._lock:
            for key in list(self._held):
                self._release(key)

    def reserved(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self.reservations.held)

    def _accept_loop(self) -> None:
        conn_ids = iter(range(1 << 62))
        while not self._stop.is_set():
            self._reap_expired()
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                full = self._open_conns >= self.max_connections
                self._open_conns += not full
            if full:
                self._refuse(conn)
                continue
            t = threading.Thread(target=self._serve, args=(conn, next(conn_ids)), daemon=True)
            t.start()
            self._threads = [th for th in self._threads if th.is_alive()] + [t]

    def _refuse(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(1.0)
            try:
                send_msg(conn, error_reply(ProtocolError(
                    f"prefill {self.address}: too many connections (at most "
                    f"{self.max_connections})")))
            except (TransportError, OSError):
                pass

    def _serve(self, conn: socket.socket, cid: int) -> None:
        peer = f"decode connection {cid}"
        conn.settimeout(0.2)
        authenticated, idle_since = False, time.monotonic()
        try:
            with conn:
                while not self._stop.is_set():
                    try:
                        msg = recv_msg(conn, peer, MAX_MESSAGE if authenticated else MAX_HELLO,
                                       self.frame_s)
                    except NoMessage:
                        self._reap_expired()
                        if not authenticated and time.monotonic() - idle_since > self.frame_s:
                            raise ProtocolError(f"{peer}: no token within {self.frame_s} s")
                        continue
                    except ProtocolError as e:          # unreadable: answer, then hang up
                        conn.settimeout(self.frame_s)
                        send_msg(conn, error_reply(e))
                        raise
                    reply, close = self._handle(msg, cid)
                    authenticated = authenticated or not close
                    conn.settimeout(self.frame_s)
                    send_msg(conn, reply)
                    conn.settimeout(0.2)
                    if close:
                        return
        except (TransportError, OSError) as e:
            self.errors.append(f"{peer}: {e}")
        finally:
            self._release_connection(cid)
            with self._lock:
                self._open_conns -= 1

    def _handle(self, msg: dict, cid: int) -> tuple[dict, bool]:
        """The answer to one message, and whether to close the connection after it."""
        token = msg.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
                token.encode("utf-8", "backslashreplace"), self._key):
            return error_reply(AuthError(f"prefill {self.address}: wrong token")), True
        op = msg.get("op")
        try:
            if op == "hello":
                self.transport.connect(field(msg, "endpoint", dict))
                return {"ok": True, "endpoint": self.transport.endpoint()}, False
            if op == "pull":
                return self._pull(field(msg, "request_id", str),
                                  field(msg, "dest", dict, {}),
                                  field(msg, "mac", bool, True), cid), False
            if op == "done":
                with self._lock:
                    self._release(field(msg, "request_id", str), cid)
                return {"ok": True}, False
            if op == "reserved":
                return {"ok": True, "reserved": sorted(self.reserved())}, False
            raise ProtocolError(f"prefill {self.address}: unknown op {op!r}")
        except Exception as e:  # noqa: BLE001  (every failure is the peer's answer)
            return error_reply(e if isinstance(e, TransportError) else ProtocolError(
                f"prefill {self.address}: {op!r} failed: {e!r}")), False

    def _pull(self, request_id: str, dest: dict, mac: bool, cid: int) -> dict:
        """P1-P7: transform, reserve, copy into the send buffer, MAC, open, answer."""
        try:
            prepared = self.source(request_id, dest)
        except KeyError as e:
            raise UnknownRequest(f"prefill {self.address}: no KV cache for request "
                                 f"{request_id!r}") from e
        except Exception as e:  # noqa: BLE001  (a failed transform is the peer's answer)
            raise ProtocolError(f"prefill {self.address}: preparing request {request_id!r} "
                                f"failed: {e!r}") from e
        _, nbytes = buffer_address(prepared.data)
        with self._lock:
            offset = self.reservations.reserve(request_id, nbytes)
        try:
            _copy_into(self.buffer, offset, prepared.data)
            reply = {"ok": True, "nbytes": nbytes, "meta": prepared.meta,
                     "segment_bytes": self.segment_bytes}
            if mac:
                reply["nonce"] = secrets.token_hex(8)
                reply["mac"] = segment_macs(_host_bytes(prepared.data), self.segment_bytes,
                                            self._key, mac_context(request_id, reply))
            with self._lock:
                region = self.transport.register(self.base + offset, max(nbytes, 1),
                                                 peer_access=True)
                self._held[request_id] = _Held(cid, time.monotonic() + self.lease_s, region)
        except Exception as e:
            with self._lock:
                if request_id not in self._held:
                    self.reservations.release(request_id)
            raise ProtocolError(f"prefill {self.address}: staging request {request_id!r} "
                                f"in the send buffer failed: {e!r}") from e
        return {**reply, "region": region.to_wire()}

    def _release(self, request_id: str, cid: int | None = None) -> None:
        """Close the request's range to peers, then free it (caller holds the lock)."""
        held = self._held.get(request_id)
        if held is None or (cid is not None and held.cid != cid):
            return
        del self._held[request_id]
        try:
            self.transport.release(held.region)
        except TransportError as e:
            self.errors.append(f"request {request_id!r}: {e}")
            return                  # still open or still written to: never reused
        self.reservations.release(request_id)

    def _release_connection(self, cid: int) -> None:
        with self._lock:
            for key in [k for k, h in self._held.items() if h.cid == cid]:
                self._release(key)

    def _reap_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, h in self._held.items() if h.deadline < now]:
                self.errors.append(f"request {key!r}: lease of {self.lease_s} s expired")
                self._release(key)


def _host_bytes(data) -> np.ndarray:
    if hasattr(data, "data_ptr"):
        data = data.detach().cpu().contiguous().view(-1).numpy()
    return np.asarray(data).reshape(-1).view(np.uint8)


def _copy_into(buffer, offset: int, data) -> None:
    """P5: copy the transformed bytes into the send buffer (device to device on a GPU)."""
    if hasattr(buffer, "data_ptr"):                                  # torch send buffer
        import torch
        src = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.asarray(data))
        flat = buffer.view(-1).view(torch.uint8)
        flat[offset:offset + src.numel() * src.element_size()].copy_(src.view(-1).view(torch.uint8))
        return
    data = _host_bytes(data)
    buffer.view(np.uint8)[offset:offset + data.size] = data


# -- the decode side ---------------------------------------------------------------------------
class Sink(Protocol):
    """The decode side's receive buffers (D2-D9)."""

    regions: list[Region]

    def reserve(self, request_id: str) -> dict: ...          # own space; -> dest for P
    def plan(self, request_id: str, dest: dict, meta: dict) -> TransferPlan: ...
    def complete(self, request_id: str, meta: dict) -> object: ...   # D6-D7 rebuild
    def release(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class PullResult:
    request_id: str
    nbytes: int
    num_writes: int
    meta: dict
    output: object           # what ``sink.complete`` returned
    latency_s: float         # from D1 to the bytes landing (before the rebuild)


class DecodeClient:
    """Pulls KV caches from one prefill server into a sink's registered regions.

    ``timeout_s`` bounds each control exchange (sending, the answer starting, the answer
    completing) and, by default, each transfer; ``integrity`` asks for and checks a MAC per
    payload segment (on by default; off only to measure its cost).
    """

    def __init__(self, transport: Transport, sink: Sink, address, token: str,
                 timeout_s: float = 30.0, integrity: bool = True) -> None:
        check_token(token)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s {timeout_s}: must be > 0")
        self.transport, self.sink, self.token = transport, sink, token
        self.timeout_s, self.integrity = timeout_s, integrity
        self._key = token.encode()
        self.peer = f"prefill {address[0]}:{address[1]}"
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
        except OSError as e:
            raise PeerLost(f"{self.peer}: cannot connect ({e})") from e
        try:
            hello = self._call({"op": "hello", "endpoint": transport.endpoint()})
            transport.connect(field(hello, "endpoint", dict))
        except BaseException:
            self._sock.close()
            raise

    def _call(self, msg: dict) -> dict:
        """One request and its answer. After a lost or late answer the connection is closed
        (a late answer would be read as the next one), which also makes the prefill side
        release what this connection holds."""
        if self._sock.fileno() < 0:
            raise PeerLost(f"{self.peer}: connection closed after an earlier failure")
        try:
            send_msg(self._sock, {**msg, "token": self.token})
            reply = recv_msg(self._sock, self.peer, MAX_MESSAGE, self.timeout_s)
        except (TransferTimeout, PeerLost, ProtocolError):    # TransferTimeout is an OSError
            self._sock.close()
            raise
        except OSError as e:
            self._sock.close()
            raise PeerLost(f"{self.peer}: connection lost sending {msg['op']} ({e})") from e
        return raise_for_reply(reply, f"{self.peer}: {msg['op']}")

    def pull(self, request_id: str, timeout_s: float | None = None) -> PullResult:
        """Algorithm 1 for one request; every reservation is released on every path."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        request_id = str(request_id)
        dest = self.sink.reserve(request_id)
        answered, batch = False, None
        try:
            start = time.perf_counter()
            meta = self._call({"op": "pull", "request_id": request_id, "dest": dest,
                               "mac": self.integrity})                                  # D1
            answered = True
            source = self._source_region(meta)
            plan = self.sink.plan(request_id, dest, meta["meta"])                       # D2-D4
            self._check_size(plan, meta)
            batch = self.transport.post(plan, source, self.sink.regions, op="read")    # D5
            self.transport.wait(batch, timeout_s)
            latency = time.perf_counter() - start
            if self.integrity:
                self._verify(request_id, plan, meta)
            output = self.sink.complete(request_id, meta["meta"])                       # D6-D7
            return PullResult(request_id, meta["nbytes"], plan.num_writes, meta["meta"],
                              output, latency)
        finally:
            if batch is not None:                          # D8-D9, once no write can land
                self.transport.after_settled(batch, lambda: self.sink.release(request_id))
            else:
                self.sink.release(request_id)
            if answered:
                self._done(request_id)

    def peer_reserved(self) -> list[str]:
        """Request ids holding the prefill side's send buffer now (a leak check)."""
        return list(self._call({"op": "reserved"})["reserved"])

    def _source_region(self, meta: dict) -> Region:
        try:
            region = Region.from_wire(meta["region"])
            nbytes = int(meta["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{self.peer}: pull answer without a valid region "
                                f"({e!r})") from e
        if nbytes > region.nbytes:
            raise ProtocolError(f"{self.peer}: {nbytes} B prepared in a region of "
                                f"{region.nbytes} B")
        return region

    def _check_size(self, plan: TransferPlan, meta: dict) -> None:
        if plan.src_size > meta["nbytes"]:
            raise ProtocolError(f"{self.peer}: plan {plan.kind!r} reads {plan.src_size} B but "
                                f"the prefill side prepared {meta['nbytes']} B")

    def _verify(self, request_id: str, plan: TransferPlan, meta: dict) -> None:
        if "mac" not in meta or "nonce" not in meta:
            raise ProtocolError(f"{self.peer}: pull answer for {request_id!r} carries no "
                                f"MACs, and this client checks integrity")
        seg = int(meta["segment_bytes"])
        got = received_macs(plan, self.sink.regions, meta["nbytes"], seg, self._key,
                            mac_context(request_id, meta))
        verify_macs(got, meta["mac"], request_id, seg)

    def _done(self, request_id: str) -> None:
        """P8-P9 on the prefill side; best effort (a dead peer releases on disconnect)."""
        try:
            self._call({"op": "done", "request_id": request_id})
        except TransportError:
            pass

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
