"""Mooncake Transfer Engine backend (the paper's engine): TCP here, RDMA on a cluster.

P2P handshake, no metadata server: a peer is addressed as ``"host:rpc_port"`` and is
contacted on first use. ``mooncake`` is imported when a transport is built, never before.
Pitfalls handled here (FACTS.md section 5): asking for ``rdma`` without an RDMA HCA makes the
engine silently use TCP, so the local topology is read back and the fallback raises
``TransportUnavailable``; batches are split into chunks of at most ``MAX_BATCH`` writes; a
failed batch is reported as -1 only, so the peer's port is probed to tell a dead peer
(``PeerLost``) from other failures.
"""

from __future__ import annotations

import json
import socket
import threading

from hardware.transport.base import (
    Batch, PeerLost, Region, RegistrationError, TransferFailed, TransferTimeout, Transport,
    TransportUnavailable,
)

PROTOCOLS = ("tcp", "rdma")
MAX_BATCH = 1024          # writes per engine batch: 4096 failed with queue-full


def rdma_hcas(topology_json: str) -> list[str]:
    """Names of the RDMA HCAs in an engine's ``get_local_topology()`` answer."""
    topo = json.loads(topology_json) if topology_json.strip() else {}
    names = set()
    for lists in topo.values():
        for group in lists if isinstance(lists, list) else []:
            names.update(group if isinstance(group, list) else [])
    return sorted(names)


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol {protocol!r}: allowed {PROTOCOLS}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransportUnavailable(
                "mooncake: `mooncake.engine` does not import; install "
                "`mooncake-transfer-engine-non-cuda` and Debian `libibverbs1`") from e
        self.protocol = protocol
        self.host = host
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportUnavailable(f"mooncake: initialize({host!r}, P2PHANDSHAKE, "
                                       f"{protocol!r}) returned {rc}")
        if protocol == "rdma":
            hcas = rdma_hcas(self._engine.get_local_topology())
            if not hcas:
                raise TransportUnavailable(
                    "mooncake: asked for rdma but the engine found no RDMA HCA and would "
                    "silently fall back to TCP (no device under /sys/class/infiniband)")
            self.hcas = hcas
        self.id = f"{host}:{self._engine.get_rpc_port()}"

    def endpoint(self) -> dict:
        return {"transport": self.name, "id": self.id, "protocol": self.protocol}

    def _register(self, address: int, nbytes: int) -> Region:
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise RegistrationError(f"mooncake {self.id}: register_memory({address:#x}, "
                                    f"{nbytes}) returned {rc}")
        return Region(address, nbytes, key=0, owner=self.id)

    def _release(self, region: Region) -> None:
        rc = self._engine.unregister_memory(region.address)
        if rc != 0:
            raise RegistrationError(f"mooncake {self.id}: unregister_memory("
                                    f"{region.address:#x}) returned {rc}")

    def _post(self, batch: Batch) -> object:
        """Run the chunks on a worker thread, so that ``wait`` can time out."""
        result: dict = {}
        worker = threading.Thread(target=self._run, args=(batch, result), daemon=True,
                                  name=f"mooncake-batch-{batch.peer}")
        worker.start()
        return worker, result

    def _run(self, batch: Batch, result: dict) -> None:
        if batch.op == "write":
            call, local, remote = (self._engine.batch_transfer_sync_write,
                                   batch.src_addr, batch.dst_addr)
        else:
            call, local, remote = (self._engine.batch_transfer_sync_read,
                                   batch.dst_addr, batch.src_addr)
        try:
            for i in range(0, len(batch.nbytes), MAX_BATCH):
                j = i + MAX_BATCH
                rc = call(batch.peer, local[i:j].tolist(), remote[i:j].tolist(),
                          batch.nbytes[i:j].tolist())
                if rc != 0:
                    result["rc"], result["chunk"] = rc, i // MAX_BATCH
                    return
            result["rc"] = 0
        except Exception as e:          # noqa: BLE001  (re-raised by wait as our own)
            result["error"] = e

    def _wait(self, batch: Batch, timeout_s: float) -> None:
        worker, result = batch.handle
        worker.join(timeout_s)
        if worker.is_alive():
            raise TransferTimeout(f"mooncake {self.id}: {batch.op} batch of "
                                  f"{len(batch.nbytes)} to {batch.peer} not complete after "
                                  f"{timeout_s:.3f} s")
        if "error" in result:
            raise TransferFailed(f"mooncake {self.id}: {batch.op} batch to {batch.peer} "
                                 f"raised {result['error']!r}") from result["error"]
        if result["rc"] != 0:
            where = (f"{batch.op} batch of {len(batch.nbytes)} writes to {batch.peer}, "
                     f"chunk {result['chunk']}, returned {result['rc']}")
            if not peer_alive(batch.peer):
                raise PeerLost(f"mooncake {self.id}: peer {batch.peer} is gone ({where})")
            raise TransferFailed(f"mooncake {self.id}: {where}")

    def _close(self) -> None:
        self._engine = None


def peer_alive(peer: str, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` still accepts TCP connections (the engine's RPC listener)."""
    host, _, port = peer.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
