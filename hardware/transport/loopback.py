"""In-process test double of a one-sided transport: a fabric shared by endpoints in one process.

Writes are ``memmove``s between registered regions, checked like a NIC checks them (the remote
range must lie inside a region the peer registered, with the right key). Faults are injected
per endpoint through ``faults``: ``fail`` (raise on the next post), ``corrupt`` (flip one byte
of the next batch's last write), ``delay_s`` (completion arrives that late), ``dead`` peers.
"""

from __future__ import annotations

import ctypes
import itertools
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

    def _register(self, address: int, nbytes: int) -> Region:
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
        remote = batch.dst_addr if batch.op == "write" else batch.src_addr
        for addr, n, key in zip(remote.tolist(), batch.nbytes.tolist(),
                                batch.remote_key.tolist()):
            peer._check_remote(addr, n, key)
        for s, d, n in zip(batch.src_addr.tolist(), batch.dst_addr.tolist(),
                           batch.nbytes.tolist()):
            ctypes.memmove(d, s, n)
        if self.faults.corrupt and len(batch.nbytes):
            self.faults.corrupt = False
            byte = ctypes.c_uint8.from_address(int(batch.dst_addr[-1]))
            byte.value ^= 0xFF
        return time.monotonic() + self.faults.delay_s

    def _wait(self, batch: Batch, timeout_s: float) -> None:
        remaining = batch.handle - time.monotonic()
        if remaining > timeout_s:
            time.sleep(timeout_s)
            raise TransferTimeout(f"loopback {self.id}: batch to {batch.peer!r} "
                                  f"({len(batch.nbytes)} writes) not complete after "
                                  f"{timeout_s:.3f} s")
        if remaining > 0:
            time.sleep(remaining)

    def _check_remote(self, address: int, nbytes: int, key: int) -> None:
        for r in self._regions.values():
            if r.address <= address and address + nbytes <= r.address + r.nbytes:
                if r.key != key:
                    raise RegistrationError(f"loopback {self.id}: key {key} does not match "
                                            f"region {r.address:#x} (key {r.key})")
                return
        raise RegistrationError(f"loopback {self.id}: remote range [{address:#x}, "
                                f"{address + nbytes:#x}) is not inside a registered region")

    def _close(self) -> None:
        self.fabric.endpoints.pop(self.id, None)
