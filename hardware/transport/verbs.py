"""pyverbs backend: one RC queue pair per peer, a plan posted as chained RDMA WRITE (or READ)
work requests, one memory region per registered (bank) buffer.

The plan-to-work-request translation (``work_requests``) is pure data and is tested on any
machine; ``to_send_wrs`` turns it into pyverbs objects (which construct without a device).
Posting needs an RDMA device (/sys/class/infiniband; Soft-RoCE counts); without one, building
a ``VerbsTransport`` raises ``TransportUnavailable`` naming the reason. GPU memory: a CUDA
tensor is registered as a ``DmaBufMR`` over a dma-buf exported by the CUDA driver, or as a plain
MR when nvidia-peermem is loaded. pyverbs pitfalls (release 44): keep every WR alive until
``post_send`` returns; ``next_wr`` can be set but not read back; signal only a chain's last WR.
``post`` translates a plan into chains of at most the send-queue depth; ``wait`` posts each
chain and polls its signaled completion before the next one, so the queue never overflows.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hardware.transport.base import (
    Batch, PeerLost, Region, RegistrationError, TransferFailed, TransferTimeout, Transport,
    TransportUnavailable,
)

IB_SYSFS = Path("/sys/class/infiniband")
PEERMEM = Path("/sys/module/nvidia_peermem")
WR_RDMA_WRITE, WR_RDMA_READ = 0, 4      # ibv_wr_opcode values (IBV_WR_RDMA_WRITE/_READ)
MAX_CHAIN = 256                         # WRs per chain = send queue depth


@dataclass(frozen=True)
class WorkRequest:
    """One ``ibv_send_wr`` as data: one SGE, one remote range; ``next`` indexes the chain."""

    wr_id: int
    opcode: int
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    signaled: bool
    next: int | None


def work_requests(batch: Batch, lkeys: np.ndarray, max_chain: int = MAX_CHAIN,
                  first_id: int = 0) -> list[WorkRequest]:
    """Translate a bounds-checked batch into chains of at most ``max_chain`` WRs.

    ``lkeys[i]`` is the local key of write i's local range. A write: local = source, remote =
    destination; a read: the reverse. Each chain's last WR is signaled and ends the chain.
    """
    if max_chain < 1:
        raise ValueError(f"max_chain {max_chain}, must be >= 1")
    write = batch.op == "write"
    opcode = WR_RDMA_WRITE if write else WR_RDMA_READ
    local = batch.src_addr if write else batch.dst_addr
    remote = batch.dst_addr if write else batch.src_addr
    n = len(batch.nbytes)
    out = []
    for i in range(n):
        last = (i + 1) % max_chain == 0 or i == n - 1
        out.append(WorkRequest(first_id + i, opcode, int(local[i]), int(batch.nbytes[i]),
                               int(lkeys[i]), int(remote[i]), int(batch.remote_key[i]),
                               signaled=last, next=None if last else i + 1))
    return out


def chains(wrs: list[WorkRequest]) -> list[list[WorkRequest]]:
    """Split a translated list at its chain ends."""
    out, cur = [], []
    for wr in wrs:
        cur.append(wr)
        if wr.next is None:
            out.append(cur)
            cur = []
    return out


def to_send_wrs(chain: list[WorkRequest]) -> list:
    """pyverbs ``SendWR`` objects for one chain, linked by ``next_wr``; keep the list alive
    until ``post_send`` has returned."""
    from pyverbs.wr import SGE, SendWR
    import pyverbs.enums as e

    objs = []
    for wr in chain:
        flags = e.IBV_SEND_SIGNALED if wr.signaled else 0
        obj = SendWR(wr_id=wr.wr_id, opcode=wr.opcode, num_sge=1,
                     sg=[SGE(wr.local_addr, wr.length, wr.lkey)], send_flags=flags)
        obj.set_wr_rdma(wr.rkey, wr.remote_addr)
        objs.append(obj)
    for a, b in zip(objs, objs[1:]):
        a.next_wr = b
    return objs


def rdma_devices() -> list[str]:
    return sorted(p.name for p in IB_SYSFS.iterdir()) if IB_SYSFS.is_dir() else []


class VerbsTransport(Transport):
    name = "verbs"

    def __init__(self, device: str | None = None, port: int = 1, gid_index: int = 0,
                 max_chain: int = MAX_CHAIN) -> None:
        super().__init__()
        try:
            import pyverbs.device as d
            import pyverbs.enums as e
            from pyverbs.cq import CQ
            from pyverbs.pd import PD
            from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        except ImportError as err:
            raise TransportUnavailable("verbs: pyverbs does not import; install Debian "
                                       "`python3-pyverbs` and put its dist-packages on the "
                                       "path") from err
        names = rdma_devices()
        if not names:
            raise TransportUnavailable(f"verbs: no RDMA device ({IB_SYSFS} is absent or "
                                       f"empty); load a NIC driver or Soft-RoCE (rdma_rxe)")
        self.device = device or names[0]
        self.port, self.gid_index, self.max_chain = port, gid_index, max_chain
        self._e = e
        try:
            self._ctx = d.Context(name=self.device)
            self._pd = PD(self._ctx)
            self._cq = CQ(self._ctx, 2 * max_chain)
            cap = QPCap(max_send_wr=max_chain, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            attr = QPAttr(port_num=port)
            attr.qp_access_flags = self._access()
            self._qp = QP(self._pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq,
                                               rcq=self._cq, cap=cap), attr)
            self._gid = self._ctx.query_gid(port, gid_index)
            self._lid = self._ctx.query_port(port).lid
        except Exception as err:  # noqa: BLE001  (any pyverbs error becomes ours)
            raise TransportUnavailable(f"verbs: opening {self.device} port {port} "
                                       f"failed: {err}") from err
        self._psn = random.Random(self._qp.qp_num).randrange(1 << 24)
        self._mrs: dict[int, object] = {}
        self._peer: str | None = None
        self.id = f"{os.uname().nodename}/{self.device}/qp{self._qp.qp_num}"

    def _access(self, peer_access: bool = True) -> int:
        e = self._e
        remote = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ if peer_access else 0
        return e.IBV_ACCESS_LOCAL_WRITE | remote

    def endpoint(self) -> dict:
        return {"transport": self.name, "id": self.id, "qp_num": self._qp.qp_num,
                "psn": self._psn, "lid": self._lid, "gid": str(self._gid),
                "port": self.port}

    def connect(self, peer: dict) -> None:
        """Move the RC QP to RTS against ``peer``'s QP (both sides call this)."""
        from pyverbs.addr import AHAttr, GID, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = self._access()
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(peer["qp_num"])
        attr.rq_psn, attr.sq_psn = int(peer["psn"]), self._psn
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 16
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer = 14, 7, 7, 12
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=int(peer["lid"]))
        try:
            self._qp.to_rts(attr)
        except Exception as err:  # noqa: BLE001
            raise PeerLost(f"verbs {self.id}: connecting to {peer.get('id')} failed: "
                           f"{err}") from err
        self._peer = str(peer["id"])

    def _register(self, address: int, nbytes: int, peer_access: bool) -> Region:
        from pyverbs.mr import MR
        try:
            mr = MR(self._pd, nbytes, self._access(peer_access), address=address)
        except Exception as err:  # noqa: BLE001
            raise RegistrationError(f"verbs {self.id}: MR({address:#x}, {nbytes}) failed: "
                                    f"{err}") from err
        return self._keep(mr, address, nbytes)

    def register_buffer(self, buf, peer_access: bool = False) -> Region:
        """CUDA tensors go through dma-buf (or peermem); everything else is a plain MR."""
        if getattr(getattr(buf, "device", None), "type", "cpu") != "cuda" or PEERMEM.exists():
            return super().register_buffer(buf, peer_access)
        from pyverbs.mr import DmaBufMR
        address, nbytes = int(buf.data_ptr()), int(buf.numel() * buf.element_size())
        fd, offset = cuda_dmabuf_fd(address, nbytes)
        try:
            mr = DmaBufMR(self._pd, nbytes, self._access(peer_access), dmabuf=fd,
                          offset=offset)
        except Exception as err:  # noqa: BLE001
            raise RegistrationError(f"verbs {self.id}: DmaBufMR for CUDA {address:#x} "
                                    f"({nbytes} B) failed: {err}") from err
        region = self._keep(mr, address, nbytes)
        self._regions[address] = region
        if peer_access:
            self._peer_access.add(address)
        return region

    def _keep(self, mr, address: int, nbytes: int) -> Region:
        self._mrs[address] = mr
        return Region(address, nbytes, key=mr.rkey, owner=self.id)

    def _release(self, region: Region) -> None:
        self._mrs.pop(region.address).close()

    def lkeys(self, local: np.ndarray) -> np.ndarray:
        """The lkey of the registered MR holding each local address."""
        starts = np.array(sorted(self._mrs), dtype=np.int64)
        idx = np.searchsorted(starts, local, side="right") - 1
        return np.array([self._mrs[int(starts[i])].lkey for i in idx], dtype=np.int64)

    def _post(self, batch: Batch) -> object:
        if self._peer != batch.peer:
            raise PeerLost(f"verbs {self.id}: not connected to {batch.peer!r} "
                           f"(connected: {self._peer!r})")
        local = batch.src_addr if batch.op == "write" else batch.dst_addr
        return chains(work_requests(batch, self.lkeys(local), self.max_chain))

    def _wait(self, batch: Batch, timeout_s: float) -> None:
        """Post chain by chain; each chain's signaled completion frees the send queue."""
        deadline = time.monotonic() + timeout_s
        for chain in batch.handle:
            objs = to_send_wrs(chain)
            try:
                self._qp.post_send(objs[0])
            except Exception as err:  # noqa: BLE001
                raise TransferFailed(f"verbs {self.id}: post_send of wr {chain[0].wr_id}.."
                                     f"{chain[-1].wr_id} failed: {err}") from err
            self._poll(chain[-1].wr_id, deadline, timeout_s)
            del objs

    def _poll(self, wr_id: int, deadline: float, timeout_s: float) -> None:
        while time.monotonic() < deadline:
            npolled, wcs = self._cq.poll(1)
            if npolled == 0:
                continue
            wc = wcs[0]
            if wc.status != self._e.IBV_WC_SUCCESS:
                cls = PeerLost if wc.status == self._e.IBV_WC_RETRY_EXC_ERR else TransferFailed
                raise cls(f"verbs {self.id}: wr {wc.wr_id} completed with status "
                          f"{wc.status}")
            if wc.wr_id == wr_id:
                return
        raise TransferTimeout(f"verbs {self.id}: wr {wr_id} not complete after "
                              f"{timeout_s:.3f} s")

    def _close(self) -> None:
        for obj in (self._qp, self._cq, self._pd, self._ctx):
            obj.close()


def cuda_dmabuf_fd(address: int, nbytes: int) -> tuple[int, int]:
    """Export a CUDA allocation as a dma-buf fd (``cuMemGetHandleForAddressRange``).

    The range is widened to the page granularity the driver requires; returns
    ``(fd, offset of address within the dma-buf)``.
    """
    page = 1 << 16
    start = address & ~(page - 1)
    size = -(-(address + nbytes - start) // page) * page
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise TransportUnavailable("verbs: libcuda.so.1 not found; CUDA memory cannot be "
                                   "exported as a dma-buf") from err
    fd = ctypes.c_int(-1)
    rc = cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), ctypes.c_uint64(start),
                                            ctypes.c_size_t(size), ctypes.c_int(1),
                                            ctypes.c_ulonglong(0))
    if rc != 0:
        raise RegistrationError(f"verbs: cuMemGetHandleForAddressRange({start:#x}, {size}) "
                                f"returned CUresult {rc} (needs a dma-buf capable driver)")
    return fd.value, address - start
