"""Algorithm 1 (docs/paper.md section 4) as a protocol between a prefill and a decode process.

Control messages are length-prefixed JSON over TCP (framing, error answers and checksums in
``hardware.wire``), bound to 127.0.0.1 unless told otherwise, and every message carries a
shared token. Bulk bytes move on a ``hardware.transport`` (the decode side reads them
one-sidedly from the prefill side's registered send buffer)::

    decode (DecodeClient)                          prefill (PrefillServer)
    hello(token, endpoint)                   ->    check token; connect transport
                                             <-    endpoint, send-buffer region
    dest = sink.reserve(r)                                                       (D: own space)
    D1  pull(r, dest)                        ->    P1-P7 prepared = source(r, dest) (transform),
                                                   reserve in send buffer, copy, checksums
                                             <-    offset, nbytes, meta, checksums  | error
    D2-D5 plan = sink.plan(r, dest, meta); post as one batch; wait; verify checksums
    D6-D7 sink.complete(r, meta)                                                 (rebuild)
    D8-D9 sink.release(r); done(r, ok)       ->    P8-P9 release the send-buffer reservation
    reserved                                 ->    (any time) request ids holding send buffer

Every reservation is released on success, on error and on timeout: the decode side in a
``finally``; the prefill side on ``done``, when the control connection drops (peer killed), and
when a reservation outlives ``lease_s``. A full send buffer answers ``SendBufferExhausted``
(back-pressure: the decode side may retry), never a crash.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from hardware.plan import TransferPlan
from hardware.transport.buffers import Reservations
from hardware.transport.base import (
    AuthError, ChecksumMismatch, PeerLost, ProtocolError, Region, TransferTimeout, Transport,
    TransportError, UnknownRequest, buffer_address,
)
from hardware.wire import (  # noqa: F401  (MAX_MESSAGE, ERRORS: public names kept here)
    ERRORS, MAX_MESSAGE, error_reply, raise_for_reply, received_crcs, recv_msg, segment_crcs,
    send_msg,
)


# -- the prefill side --------------------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A request's transformed KV bytes as the prefill side sends them (P1-P5)."""

    data: object                         # uint8 numpy array or torch tensor, [nbytes]
    meta: dict = field(default_factory=dict)


Source = Callable[[str, dict], Prepared]    # (request id, decode side's dest) -> Prepared


class PrefillServer:
    """Serves pulls of prepared KV caches from one registered send buffer."""

    def __init__(self, transport: Transport, send_buffer, source: Source, token: str,
                 host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0,
                 segment_bytes: int | None = None) -> None:
        if not token:
            raise ValueError("token must be a non-empty shared secret")
        self.transport, self.source, self.token = transport, source, token
        self.lease_s, self.segment_bytes = lease_s, segment_bytes
        self.buffer = send_buffer
        self.region = transport.register_buffer(send_buffer)
        self.reservations = Reservations(self.region.nbytes)
        self._owner: dict[str, tuple[int, float]] = {}   # request id -> (conn id, deadline)
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.1)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
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
            for key in list(self._owner):
                self._release(key)
        self.transport.release(self.region)

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
            t = threading.Thread(target=self._serve, args=(conn, next(conn_ids)), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket, cid: int) -> None:
        peer = f"decode connection {cid}"
        conn.settimeout(0.2)
        try:
            with conn:
                while not self._stop.is_set():
                    try:
                        msg = recv_msg(conn, peer)
                    except TransferTimeout:
                        self._reap_expired()
                        continue
                    reply, close = self._handle(msg, cid)
                    send_msg(conn, reply)
                    if close:
                        return
        except (TransportError, OSError) as e:
            self.errors.append(f"{peer}: {e}")
        finally:
            self._release_connection(cid)

    def _handle(self, msg: dict, cid: int) -> tuple[dict, bool]:
        if not hmac.compare_digest(str(msg.get("token", "")), self.token):
            return error_reply(AuthError(f"prefill {self.address}: wrong token")), True
        op = msg.get("op")
        try:
            if op == "hello":
                self.transport.connect(msg["endpoint"])
                return {"ok": True, "endpoint": self.transport.endpoint(),
                        "region": self.region.to_wire()}, False
            if op == "pull":
                return self._pull(str(msg["request_id"]), msg.get("dest", {}), cid), False
            if op == "done":
                with self._lock:
                    self._release(str(msg["request_id"]), cid)
                return {"ok": True}, False
            if op == "reserved":
                return {"ok": True, "reserved": sorted(self.reserved())}, False
            raise ProtocolError(f"prefill {self.address}: unknown op {op!r}")
        except (TransportError, KeyError, TypeError) as e:
            return error_reply(e), False

    def _pull(self, request_id: str, dest: dict, cid: int) -> dict:
        """P1-P7: look up and transform, reserve, copy into the send buffer, answer metadata."""
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
            self._owner[request_id] = (cid, time.monotonic() + self.lease_s)
        try:
            _copy_into(self.buffer, offset, prepared.data)
        except Exception as e:
            with self._lock:
                self._release(request_id)
            raise ProtocolError(f"prefill {self.address}: copying request {request_id!r} "
                                f"into the send buffer failed: {e!r}") from e
        reply = {"ok": True, "offset": offset, "nbytes": nbytes, "meta": prepared.meta}
        if self.segment_bytes:
            host = _host_bytes(prepared.data)
            reply["segment_bytes"] = self.segment_bytes
            reply["crc"] = segment_crcs(host, self.segment_bytes)
        return reply

    def _release(self, request_id: str, cid: int | None = None) -> None:
        owner = self._owner.get(request_id)
        if owner is not None and (cid is None or owner[0] == cid):
            del self._owner[request_id]
            self.reservations.release(request_id)

    def _release_connection(self, cid: int) -> None:
        with self._lock:
            for key in [k for k, (c, _) in self._owner.items() if c == cid]:
                self._release(key)

    def _reap_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (_, dl) in self._owner.items() if dl < now]:
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
    """Pulls KV caches from one prefill server into a sink's registered regions."""

    def __init__(self, transport: Transport, sink: Sink, address, token: str,
                 timeout_s: float = 30.0) -> None:
        self.transport, self.sink, self.token = transport, sink, token
        self.timeout_s = timeout_s
        self.peer = f"prefill {address[0]}:{address[1]}"
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
        except OSError as e:
            raise PeerLost(f"{self.peer}: cannot connect ({e})") from e
        try:
            hello = self._call({"op": "hello", "endpoint": transport.endpoint()})
            transport.connect(hello["endpoint"])
        except BaseException:
            self._sock.close()
            raise
        self.send_region = Region.from_wire(hello["region"])

    def _call(self, msg: dict) -> dict:
        """One request and its answer. After a lost or late answer the connection is closed
        (a late answer would be read as the next one), which also makes the prefill side
        release what this connection holds."""
        if self._sock.fileno() < 0:
            raise PeerLost(f"{self.peer}: connection closed after an earlier failure")
        try:
            send_msg(self._sock, {**msg, "token": self.token})
            reply = recv_msg(self._sock, self.peer)
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
        answered = False
        try:
            start = time.perf_counter()
            meta = self._call({"op": "pull", "request_id": request_id, "dest": dest})   # D1
            answered = True
            plan = self.sink.plan(request_id, dest, meta["meta"])                       # D2-D4
            self._check_size(plan, meta)
            shifted = _shift_source(plan, meta["offset"], self.send_region.nbytes)
            self.transport.submit(shifted, self.send_region, self.sink.regions, op="read",
                                  timeout_s=timeout_s)                                  # D5
            latency = time.perf_counter() - start
            if "crc" in meta:
                self._verify(request_id, plan, meta)
            output = self.sink.complete(request_id, meta["meta"])                       # D6-D7
            return PullResult(request_id, meta["nbytes"], plan.num_writes, meta["meta"],
                              output, latency)
        finally:
            self.sink.release(request_id)                                               # D8-D9
            if answered:
                self._done(request_id)

    def peer_reserved(self) -> list[str]:
        """Request ids holding the prefill side's send buffer now (a leak check)."""
        return list(self._call({"op": "reserved"})["reserved"])

    def _check_size(self, plan: TransferPlan, meta: dict) -> None:
        if plan.src_size > meta["nbytes"]:
            raise ProtocolError(f"{self.peer}: plan {plan.kind!r} reads {plan.src_size} B but "
                                f"the prefill side prepared {meta['nbytes']} B")

    def _verify(self, request_id: str, plan: TransferPlan, meta: dict) -> None:
        got = received_crcs(plan, self.sink.regions, meta["nbytes"], meta["segment_bytes"])
        bad = [i for i, (a, b) in enumerate(zip(got, meta["crc"])) if a != b]
        if bad or len(got) != len(meta["crc"]):
            seg = meta["segment_bytes"]
            raise ChecksumMismatch(f"request {request_id!r}: {len(bad)} of {len(got)} segments "
                                   f"differ, first segment {bad[0] if bad else len(got)} "
                                   f"(payload bytes from {(bad[0] if bad else 0) * seg})")

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


def _shift_source(plan: TransferPlan, offset: int, src_size: int) -> TransferPlan:
    return TransferPlan(plan.kind, plan.src_offset + offset, plan.dst_region, plan.dst_offset,
                        plan.nbytes, src_size, plan.region_sizes, plan.extra)
