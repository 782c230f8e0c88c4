"""The transport seam: register memory, post one request's plan as one batch, wait, release.

Contract (who calls what, and when)::

    t = make_transport("mooncake", host="127.0.0.1")    # or "verbs", "loopback"
    peer = exchange(t.endpoint())                       # out of band (hardware.protocol)
    t.connect(peer)                                     # verbs: RC QP to RTS; others: no-op
    src = t.register(address, nbytes)                   # -> Region (address, nbytes, key, owner)
    batch = t.post(plan, src, dsts, op="write")         # bounds-checked, then posted
    t.wait(batch, timeout_s=5.0)                        # raises on failure or timeout
    t.release(src); t.close()

Peer access. ``register(..., peer_access=False)`` (the default) makes a region usable as the
local side of this transport's own batches only; no peer can read or write it. Only a region
registered with ``peer_access=True`` is open to peers, and only until it is released: the
prefill side opens one request's range of its send buffer per pull and closes it on ``done``.

Late writes. A batch that timed out may still be moving bytes (a backend's call cannot be
cancelled). Until it settles, ``settled(batch)`` is False, ``after_settled(batch, fn)`` defers
``fn`` (the decode side defers freeing the request's receive space this way), and ``release``
of a region the batch touches waits for it (at most ``drain_s``) and otherwise refuses: memory
is never handed back while a write into it can still land.

A plan (``hardware.transfer_plan.TransferPlan``) copies ``nbytes`` from ``src_offset`` of one source
region to ``dst_offset`` of ``dsts[dst_region]``. ``op="write"``: the source is local and
the destinations belong to the peer (one-sided RDMA WRITE). ``op="read"``: the destinations
are local and the source belongs to the peer (one-sided RDMA READ, the decode side pulling,
Algorithm 1 D2-D5). Every plan is checked against the regions' sizes, and the local side
against this transport's registrations, before anything is posted.

Errors. Backends raise only these, chained ``from`` the backend's own error::

    TransportError
     +-- TransportUnavailable      backend not installed, no device, or a silent fallback
     +-- RegistrationError         registering / releasing memory failed, or unknown region
     +-- PlanOutOfBounds           a write falls outside a region (also a ValueError)
     +-- TransferFailed            the backend reported a failed write
     |    +-- PeerLost             the peer is gone (refused, reset, killed)
     +-- TransferTimeout           no completion in time (also a TimeoutError)
     +-- ProtocolError             a bad control message (hardware.protocol)
          +-- AuthError            wrong shared token
          +-- UnknownRequest       the prefill side holds no KV cache for that id
          +-- SendBufferExhausted  no room in the prefill send buffer now: retry later
          +-- ChecksumMismatch     received bytes differ from the sender's MAC
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from hardware.transfer_plan import TransferPlan

Op = Literal["write", "read"]
OPS = ("write", "read")


class TransportError(Exception):
    """Root of every error the real transfer path raises."""


class TransportUnavailable(TransportError):
    pass


class RegistrationError(TransportError):
    pass


class PlanOutOfBounds(TransportError, ValueError):
    pass


class TransferFailed(TransportError):
    pass


class PeerLost(TransferFailed):
    pass


class TransferTimeout(TransportError, TimeoutError):
    pass


class ProtocolError(TransportError):
    pass


class AuthError(ProtocolError):
    pass


class UnknownRequest(ProtocolError):
    pass


class SendBufferExhausted(ProtocolError):
    pass


class ChecksumMismatch(ProtocolError):
    pass


@dataclass(frozen=True)
class Prepared:
    """A request's transformed KV bytes as the prefill side sends them (Algorithm 1 P1-P5);
    what a ``hardware.protocol`` source returns."""

    data: object                         # uint8 numpy array or torch tensor, [nbytes]
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Region:
    """A registered memory range, as a peer addresses it.

    ``key`` is the remote key (verbs rkey; 0 where the transport needs none); ``owner`` is the
    endpoint id of the process holding the memory.
    """

    address: int
    nbytes: int
    key: int = 0
    owner: str = ""

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"region at {self.address:#x}: nbytes {self.nbytes}, must be > 0")

    def to_wire(self) -> dict:
        return {"address": self.address, "nbytes": self.nbytes, "key": self.key,
                "owner": self.owner}

    @classmethod
    def from_wire(cls, d: dict) -> "Region":
        return cls(int(d["address"]), int(d["nbytes"]), int(d.get("key", 0)),
                   str(d.get("owner", "")))


@dataclass(frozen=True)
class Batch:
    """A posted plan: absolute addresses per write and the backend's handle(s)."""

    op: Op
    peer: str
    src_addr: np.ndarray    # [w] int64, absolute source addresses
    dst_addr: np.ndarray    # [w] int64, absolute destination addresses
    nbytes: np.ndarray      # [w] int64
    remote_key: np.ndarray  # [w] int64, the peer region's key per write (verbs rkey)
    handle: object = None


def buffer_address(buf) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous numpy array, torch tensor or writable buffer."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):       # torch.Tensor
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous to be registered")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    arr = np.asarray(buf) if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("array must be C-contiguous to be registered")
    return int(arr.ctypes.data), int(arr.nbytes)


def resolve(plan: TransferPlan, src: Region, dsts: Sequence[Region]):
    """Bounds-check ``plan`` against the regions; return absolute (src, dst, nbytes) columns."""
    try:
        plan.check_bounds(src.nbytes, [d.nbytes for d in dsts])
    except ValueError as e:
        raise PlanOutOfBounds(str(e)) from e
    dst_base = np.array([d.address for d in dsts], dtype=np.int64)
    src_addr = src.address + plan.src_offset
    dst_addr = (dst_base[plan.dst_region] + plan.dst_offset if plan.num_writes
                else np.zeros(0, dtype=np.int64))
    return src_addr, dst_addr, plan.nbytes


def remote_keys(plan: TransferPlan, src: Region, dsts: Sequence[Region], op: Op) -> np.ndarray:
    """The key of the peer's region each write touches."""
    if op == "read":
        return np.full(plan.num_writes, src.key, dtype=np.int64)
    keys = np.array([d.key for d in dsts], dtype=np.int64)
    return keys[plan.dst_region] if plan.num_writes else np.zeros(0, dtype=np.int64)


class Transport(abc.ABC):
    """One endpoint of a one-sided transport; see the module docstring for the contract."""

    name: str = "abstract"
    drain_s: float = 60.0       # how long ``release`` waits for a timed-out batch to settle

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}      # address -> registered local region
        self._peer_access: set[int] = set()        # addresses of regions open to peers
        self._unsettled: dict[int, tuple[Batch, list]] = {}   # id -> (batch, callbacks)
        self._lock = threading.Lock()
        self._closed = False

    # -- what subclasses implement ------------------------------------------------------
    @abc.abstractmethod
    def endpoint(self) -> dict:
        """JSON-able description a peer passes to ``connect`` (id under ``"id"``)."""

    def connect(self, peer: dict) -> None:
        """Prepare to exchange data with ``peer`` (an ``endpoint()`` of the other side)."""

    @abc.abstractmethod
    def _register(self, address: int, nbytes: int, peer_access: bool) -> Region: ...

    @abc.abstractmethod
    def _release(self, region: Region) -> None: ...

    @abc.abstractmethod
    def _post(self, batch: Batch) -> object:
        """Post the batch's writes; return a handle for ``_wait``."""

    @abc.abstractmethod
    def _wait(self, batch: Batch, timeout_s: float) -> None: ...

    def _drain(self, batch: Batch, timeout_s: float | None) -> bool:
        """Wait (``None``: without limit) for a timed-out batch to stop moving bytes; True
        once it has. Backends that cannot tell keep it unsettled (False)."""
        return False

    def _close(self) -> None:
        pass

    # -- the public protocol ------------------------------------------------------------
    def register(self, address: int, nbytes: int, peer_access: bool = False) -> Region:
        self._check_open()
        if address in self._regions:
            raise RegistrationError(f"{self.name}: {address:#x} is already registered")
        region = self._register(int(address), int(nbytes), bool(peer_access))
        self._regions[region.address] = region
        if peer_access:
            self._peer_access.add(region.address)
        return region

    def register_buffer(self, buf, peer_access: bool = False) -> Region:
        return self.register(*buffer_address(buf), peer_access=peer_access)

    def release(self, region: Region) -> None:
        if region.address not in self._regions:
            raise RegistrationError(f"{self.name}: region at {region.address:#x} "
                                    f"({region.nbytes} B) is not registered here")
        self._drain_touching(region)
        del self._regions[region.address]
        self._peer_access.discard(region.address)
        self._release(region)

    def live_regions(self) -> list[Region]:
        """Regions registered and not yet released (a leak check reads this)."""
        return list(self._regions.values())

    def open_to_peers(self) -> list[Region]:
        """Regions a peer may read or write now."""
        return [self._regions[a] for a in sorted(self._peer_access)]

    def post(self, plan: TransferPlan, src: Region, dsts: Sequence[Region],
             op: Op = "write") -> Batch:
        """Bounds-check ``plan``, then post all its writes as one batch."""
        self._check_open()
        if op not in OPS:
            raise ValueError(f"op {op!r}: allowed {OPS}")
        local = [src] if op == "write" else list(dsts)
        for r in local:
            self._check_local(r)
        src_addr, dst_addr, nbytes = resolve(plan, src, dsts)
        remote = list(dsts) if op == "write" else [src]
        peers = {r.owner for r in remote}
        if len(peers) > 1:
            raise PlanOutOfBounds(f"plan {plan.kind!r}: remote regions span peers {peers}")
        keys = remote_keys(plan, src, dsts, op)
        batch = Batch(op, peers.pop() if peers else "", src_addr, dst_addr, nbytes, keys)
        handle = self._post(batch) if plan.num_writes else None
        return dataclasses.replace(batch, handle=handle)

    def wait(self, batch: Batch, timeout_s: float = 30.0) -> None:
        """Wait for the batch; on ``TransferTimeout`` it stays unsettled (see the module
        docstring) until the backend says it stopped moving bytes."""
        if batch.handle is None:
            return
        try:
            self._wait(batch, timeout_s)
        except TransferTimeout:
            with self._lock:
                self._unsettled[id(batch)] = (batch, [])
            threading.Thread(target=self._settle, args=(batch,), daemon=True,
                             name=f"{self.name}-drain").start()
            raise

    def submit(self, plan: TransferPlan, src: Region, dsts: Sequence[Region],
               op: Op = "write", timeout_s: float = 30.0) -> None:
        """``post`` then ``wait``."""
        self.wait(self.post(plan, src, dsts, op), timeout_s)

    def settled(self, batch: Batch) -> bool:
        """Whether no write of ``batch`` can still land."""
        with self._lock:
            return id(batch) not in self._unsettled

    def after_settled(self, batch: Batch, fn) -> None:
        """Call ``fn()`` once ``batch`` has settled (now, if it has)."""
        with self._lock:
            entry = self._unsettled.get(id(batch))
            if entry is not None:
                entry[1].append(fn)
                return
        fn()

    def close(self) -> None:
        """Release every region still registered, then shut the backend down."""
        if self._closed:
            return
        for region in list(self._regions.values()):
            self.release(region)
        self._close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------
    def _settle(self, batch: Batch) -> None:
        if self._drain(batch, None):
            self._settled(batch)

    def _settled(self, batch: Batch) -> None:
        with self._lock:
            _, callbacks = self._unsettled.pop(id(batch), (None, []))
        for fn in callbacks:
            fn()

    def _drain_touching(self, region: Region) -> None:
        """Wait for unsettled batches whose local side lies in ``region``; refuse if any
        is still moving bytes after ``drain_s``."""
        with self._lock:
            touching = [b for b, _ in self._unsettled.values() if _touches(b, region)]
        for batch in touching:
            if self._drain(batch, self.drain_s):
                self._settled(batch)
            else:
                raise RegistrationError(
                    f"{self.name}: region at {region.address:#x} ({region.nbytes} B) is "
                    f"kept: a timed-out {batch.op} batch of {len(batch.nbytes)} writes may "
                    f"still write into it after {self.drain_s} s")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name}: transport is closed")

    def _check_local(self, region: Region) -> None:
        """A local region of a batch must lie inside one of this transport's registrations."""
        for r in self._regions.values():
            if r.address <= region.address and region.address + region.nbytes <= \
                    r.address + r.nbytes:
                return
        raise PlanOutOfBounds(f"{self.name}: local range [{region.address:#x}, "
                              f"{region.address + region.nbytes:#x}) is not inside a "
                              f"registered region")


def _touches(batch: Batch, region: Region) -> bool:
    """Whether any local range of ``batch`` overlaps ``region``."""
    local = batch.src_addr if batch.op == "write" else batch.dst_addr
    end = region.address + region.nbytes
    return bool(np.any((local < end) & (local + batch.nbytes > region.address)))
