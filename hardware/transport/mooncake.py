"""Mooncake Transfer Engine backend (the paper's engine): TCP here, RDMA on a cluster.

P2P handshake, no metadata server: a peer is addressed as ``"host:rpc_port"`` and is
contacted on first use. ``mooncake`` is imported when a transport is built, never before.
Pitfalls handled here: asking for ``rdma`` without an RDMA HCA makes the engine silently use
TCP, so the local topology is read back and the fallback raises ``TransportUnavailable``;
batches are split into chunks of at most ``MAX_BATCH`` writes; a failed batch is reported as
-1 only, so the peer's port is probed to tell a dead peer (``PeerLost``) from other failures.

Who can reach it. The engine (0.3.x) binds its RPC port to 0.0.0.0 and its TCP data port to
``*`` whatever host it is given, and has no option to change that (``MC_TCP_BIND_ADDRESS``
only names the address it advertises). Right after ``initialize`` the transport therefore
pins both listening sockets to the network device that holds ``host`` (``SO_BINDTODEVICE``;
``lo`` for a loopback host), so that the kernel refuses connections arriving on any other
interface; ``listeners`` lists them. Behind that, the engine serves reads and writes only
inside memory registered with it, and over TCP a local range needs no registration: so only
regions registered ``peer_access=True`` are registered with the engine (with ``rdma`` every
region is, since the NIC needs its keys), and the engine has no authentication of its own:
any process that can reach the port may read or write those regions while they are open.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
import tempfile
import threading
from contextlib import contextmanager

from hardware.transport.base import (
    Batch, PeerLost, Region, RegistrationError, TransferFailed, TransferTimeout, Transport,
    TransportUnavailable,
)

PROTOCOLS = ("tcp", "rdma")
MAX_BATCH = 1024          # writes per engine batch: 4096 failed with queue-full
#: what the engine writes to stderr on every start though nothing is wrong: glog's note that
#: the library never initialised it, and an ERROR line from the P2P handshake's first lookup of
#: its own segment, which no metadata server holds (seen with mooncake-transfer-engine 0.3.x)
STARTUP_NOISE = ("Logging before InitGoogleLogging() is written to STDERR",
                 "] Local segment descriptor not found")


def rdma_hcas(topology_json: str) -> list[str]:
    """Names of the RDMA HCAs in an engine's ``get_local_topology()`` answer."""
    topo = json.loads(topology_json) if topology_json.strip() else {}
    names = set()
    for lists in topo.values():
        for group in lists if isinstance(lists, list) else []:
            names.update(group if isinstance(group, list) else [])
    return sorted(names)


@contextmanager
def engine_stderr_filtered(noise=STARTUP_NOISE):
    """The process's stderr (fd 2, where the engine's glog writes) held in a file while the
    engine starts, then written back without the lines that contain an entry of ``noise``:
    any other line, a real error included, still reaches the terminal, just after."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:                         # no stderr at all: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(True)
                    if not any(n in line for n in noise)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol {protocol!r}: allowed {PROTOCOLS}")
        # the engine logs every INFO and WARNING line to stderr (its own topology discovery,
        # metrics, malloc notes): errors only, unless the user chose a level
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransportUnavailable(
                "mooncake: `mooncake.engine` does not import; install "
                "`mooncake-transfer-engine-non-cuda` and Debian `libibverbs1`") from e
        self.protocol = protocol
        self.host = host
        device = listen_device(host)
        with engine_stderr_filtered():
            self._engine = TransferEngine()
            before = set(wildcard_listeners())
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportUnavailable(f"mooncake: initialize({host!r}, P2PHANDSHAKE, "
                                       f"{protocol!r}) returned {rc}")
        self.listeners = pin_listeners(
            {fd: a for fd, a in wildcard_listeners().items() if fd not in before}, device,
            self._engine.get_rpc_port())
        if protocol == "rdma":
            hcas = rdma_hcas(self._engine.get_local_topology())
            if not hcas:
                raise TransportUnavailable(
                    "mooncake: asked for rdma but the engine found no RDMA HCA and would "
                    "silently fall back to TCP (no device under /sys/class/infiniband)")
            self.hcas = hcas
        self.id = f"{host}:{self._engine.get_rpc_port()}"
        self._with_engine: set[int] = set()        # addresses registered with the engine

    def endpoint(self) -> dict:
        return {"transport": self.name, "id": self.id, "protocol": self.protocol}

    def _register(self, address: int, nbytes: int, peer_access: bool) -> Region:
        if peer_access or self.protocol == "rdma":
            rc = self._engine.register_memory(address, nbytes)
            if rc != 0:
                raise RegistrationError(f"mooncake {self.id}: register_memory({address:#x}, "
                                        f"{nbytes}) returned {rc}")
            self._with_engine.add(address)
        return Region(address, nbytes, key=0, owner=self.id)

    def _release(self, region: Region) -> None:
        if region.address not in self._with_engine:
            return
        self._with_engine.discard(region.address)
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

    def _drain(self, batch: Batch, timeout_s: float | None) -> bool:
        worker, _ = batch.handle
        worker.join(timeout_s)
        return not worker.is_alive()

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


def listen_device(host: str) -> str:
    """The network device holding ``host`` (``lo`` for a loopback address)."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as e:
        raise TransportUnavailable(f"mooncake: host {host!r} does not resolve ({e})") from e
    if addr.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,                 # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(addr):
                return name
    raise TransportUnavailable(f"mooncake: host {host!r} ({addr}) is not an address of a "
                               f"network device here, so its listeners cannot be pinned")


def wildcard_listeners() -> dict[int, tuple]:
    """This process's listening TCP sockets bound to every address: fd -> sockname."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(name))
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if (sock.type == socket.SOCK_STREAM
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and sock.getsockname()[0] in ("0.0.0.0", "::")):
                found[int(name)] = sock.getsockname()
        except OSError:
            pass
        finally:
            sock.close()
    return found


def pin_listeners(new: dict[int, tuple], device: str, rpc_port: int) -> list[tuple]:
    """Bind each new listening socket to ``device``; ``[(address, port, device)]``."""
    if rpc_port not in {a[1] for a in new.values()}:
        raise TransportUnavailable(f"mooncake: the engine's RPC listener (port {rpc_port}) "
                                   f"was not found among new sockets {sorted(new.values())}, "
                                   f"so it cannot be pinned to {device}")
    pinned = []
    for fd, addr in new.items():
        with socket.socket(fileno=os.dup(fd)) as sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
            except OSError as e:
                raise TransportUnavailable(f"mooncake: pinning listener {addr[0]}:{addr[1]} "
                                           f"to {device} failed ({e})") from e
        pinned.append((addr[0], addr[1], device))
    return sorted(pinned, key=lambda p: p[1])
