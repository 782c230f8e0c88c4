"""In-process test double of a one-sided transport: a fabric shared by endpoints in one process.

Writes are ``memmove``s between registered regions, checked like a NIC checks them (the remote
range must lie inside a region the peer registered open to peers, with the right key). Faults
are injected per endpoint through ``faults``: ``fail`` (raise on the next post), ``corrupt``
(flip one byte of the next batch's last write), ``delay_s`` (the bytes land, and completion
arrives, that late) or ``hold`` (they land once that event is set): the source bytes are read
when the batch is posted and written when it completes, so a waiter that times out first sees
the write land afterwards, as a real engine's in-flight data would; ``dead`` peers.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass

from hardware.transport.base import (
    Batch, PeerLost, Region, RegistrationError, TransferFailed, TransferTimeout, Transport,
)


class LoopbackFabric:
    """The wire between loopback endpoints of one process; ids come from its own counter."""

    def __init__(self) -> None:
        self.endpoints: dict[str, "LoopbackTransport"] = {}
        self._ids = itertools.count()

    def new_id(self) -> str:
        return f"loopback-{next(self._ids)}"


@dataclass
class Faults:
    fail: Exception | None = None     # raised (once) by the next post
    corrupt: bool = False             # flip a byte in the next batch (once)
    delay_s: float = 0.0              # every completion arrives this late
    hold: threading.Event | None = None   # every completion waits for this event


class LoopbackTransport(Transport):
    name = "loopback"

    def __init__(self, fabric: LoopbackFabric) -> None:
        super().__init__()
        self.fabric = fabric
        self.id = fabric.new_id()
        self.faults = Faults()
        self._keys = itertools.count(1)
        fabric.endpoints[self.id] = self

    def endpoint(self) -> dict:
        return {"transport": self.name, "id": self.id}

    def _register(self, address: int, nbytes: int, peer_access: bool) -> Region:
        return Region(address, nbytes, key=next(self._keys), owner=self.id)

    def _release(self, region: Region) -> None:
        pass

    def _post(self, batch: Batch) -> object:
        peer = self.fabric.endpoints.get(batch.peer)
        if peer is None or peer._closed:
            raise PeerLost(f"loopback peer {batch.peer!r} is gone")
        if self.faults.fail is not None:
            err, self.faults.fail = self.faults.fail, None
            raise TransferFailed(f"loopback {self.id}: injected failure") from err
        peer._check_batch(batch)
        corrupt, self.faults.corrupt = self.faults.corrupt, False
        wire = [ctypes.string_at(a, n) for a, n in zip(batch.src_addr.tolist(),
                                                        batch.nbytes.tolist())]
        if self.faults.delay_s <= 0 and self.faults.hold is None:
            _land(batch, wire, corrupt)
            return None
        worker = threading.Thread(target=_land_later, daemon=True,
                                  args=(batch, wire, corrupt, self.faults.delay_s,
                                        self.faults.hold))
        worker.start()
        return worker

    def _wait(self, batch: Batch, timeout_s: float) -> None:
        worker = batch.handle
        if worker is not None:
            worker.join(timeout_s)
            if worker.is_alive():
                raise TransferTimeout(f"loopback {self.id}: batch to {batch.peer!r} "
                                      f"({len(batch.nbytes)} writes) not complete after "
                                      f"{timeout_s:.3f} s")

    def _drain(self, batch: Batch, timeout_s: float | None) -> bool:
        worker = batch.handle
        if worker is not None:
            worker.join(timeout_s)
        return worker is None or not worker.is_alive()

    def _check_batch(self, batch: Batch) -> None:
        remote = batch.dst_addr if batch.op == "write" else batch.src_addr
        for addr, n, key in zip(remote.tolist(), batch.nbytes.tolist(),
                                batch.remote_key.tolist()):
            self._check_remote(addr, n, key)

    def _check_remote(self, address: int, nbytes: int, key: int) -> None:
        for r in self.open_to_peers():
            if r.address <= address and address + nbytes <= r.address + r.nbytes:
                if r.key != key:
                    raise RegistrationError(f"loopback {self.id}: key {key} does not match "
                                            f"region {r.address:#x} (key {r.key})")
                return
        raise RegistrationError(f"loopback {self.id}: remote range [{address:#x}, "
                                f"{address + nbytes:#x}) is not inside a region open to "
                                f"peers")

    def _close(self) -> None:
        self.fabric.endpoints.pop(self.id, None)


def _land(batch: Batch, wire: list[bytes], corrupt: bool) -> None:
    """Write the bytes read at post time into their destinations."""
    for piece, d in zip(wire, batch.dst_addr.tolist()):
        ctypes.memmove(d, piece, len(piece))
    if corrupt and len(batch.nbytes):
        byte = ctypes.c_uint8.from_address(int(batch.dst_addr[-1]))
        byte.value ^= 0xFF


def _land_later(batch: Batch, wire: list[bytes], corrupt: bool, delay_s: float,
                hold: threading.Event | None) -> None:
    if hold is not None:
        hold.wait()
    time.sleep(delay_s)
    _land(batch, wire, corrupt)
