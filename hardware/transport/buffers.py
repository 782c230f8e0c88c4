"""Registered buffers with reservations: the prefill send buffer's first-fit ranges, and a
reference source and sink on plain bytes that ``hardware.protocol`` moves (tests, benchmarks).
"""

from __future__ import annotations

import threading

import numpy as np

from hardware.transfer_plan import TransferPlan
from hardware.transport.base import Prepared, ProtocolError, SendBufferExhausted, Transport


class Reservations:
    """First-fit byte ranges of one buffer, keyed by request id."""

    def __init__(self, capacity: int, align: int = 64, name: str = "send buffer") -> None:
        if capacity <= 0 or align <= 0:
            raise ValueError(f"{name}: capacity {capacity} and align {align} must be > 0")
        self.capacity, self.align, self.name = capacity, align, name
        self.held: dict[str, tuple[int, int]] = {}       # request id -> (offset, nbytes)

    def reserve(self, key: str, nbytes: int) -> int:
        if key in self.held:
            raise ProtocolError(f"{self.name}: request {key!r} already holds a reservation")
        size = -(-max(nbytes, 1) // self.align) * self.align
        start = 0
        for off, n in sorted(self.held.values()):
            if off - start >= size:
                break
            start = max(start, off + -(-n // self.align) * self.align)
        if start + size > self.capacity:
            raise SendBufferExhausted(
                f"{self.name}: no room for request {key!r} ({nbytes} B); {self.used_bytes} of "
                f"{self.capacity} B reserved by {len(self.held)} requests")
        self.held[key] = (start, nbytes)
        return start

    def release(self, key: str) -> bool:
        return self.held.pop(key, None) is not None

    @property
    def used_bytes(self) -> int:
        return sum(n for _, n in self.held.values())


class BytesSource:
    """Prefill-side source over a dict of request id -> bytes (tests, benchmarks)."""

    def __init__(self, payloads: dict) -> None:
        self.payloads = payloads

    def __call__(self, request_id: str, dest: dict):
        data = self.payloads[request_id]
        return Prepared(data, {"nbytes": int(np.asarray(data).nbytes)})


class StripedSink:
    """Decode-side sink over N registered bank buffers: chunk i of a payload lands in bank
    ``i % N``; each bank is a ``Reservations`` of its own. The banks are registered for local
    use only: the decode side reads into them, no peer can write them."""

    def __init__(self, transport: Transport, banks: list[np.ndarray], chunk_bytes: int,
                 max_request_bytes: int) -> None:
        self.transport, self.banks, self.chunk = transport, banks, chunk_bytes
        self.regions = [transport.register_buffer(b) for b in banks]
        self.per_bank = -(-max_request_bytes // (chunk_bytes * len(banks))) * chunk_bytes
        self.held = [Reservations(b.nbytes, name=f"bank {k}") for k, b in enumerate(banks)]
        self._lock = threading.Lock()

    def reserve(self, request_id: str) -> dict:
        with self._lock:
            try:
                return {"bank_offsets": [h.reserve(request_id, self.per_bank)
                                         for h in self.held]}
            except SendBufferExhausted:
                for h in self.held:
                    h.release(request_id)
                raise

    def plan(self, request_id: str, dest: dict, meta: dict) -> TransferPlan:
        n, nb = meta["nbytes"], len(self.banks)
        starts = np.arange(0, n, self.chunk, dtype=np.int64)
        i = np.arange(starts.size)
        base = np.asarray(dest["bank_offsets"], dtype=np.int64)
        return TransferPlan("striped", starts, i % nb, base[i % nb] + (i // nb) * self.chunk,
                            np.minimum(self.chunk, n - starts), n,
                            tuple(b.nbytes for b in self.banks))

    def complete(self, request_id: str, meta: dict) -> bytes:
        """Read the payload back in order (the rebuild, for plain bytes)."""
        dest = {"bank_offsets": [h.held[request_id][0] for h in self.held]}
        plan = self.plan(request_id, dest, meta)
        out = np.empty(meta["nbytes"], np.uint8)
        for s, r, d, n in zip(plan.src_offset, plan.dst_region, plan.dst_offset, plan.nbytes):
            out[s:s + n] = self.banks[r][d:d + n]
        return out.tobytes()

    def release(self, request_id: str) -> None:
        with self._lock:
            for h in self.held:
                h.release(request_id)

    def reserved(self) -> int:
        return sum(len(h.held) for h in self.held)

    def close(self) -> None:
        for r in self.regions:
            self.transport.release(r)
