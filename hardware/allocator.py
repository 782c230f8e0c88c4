"""Receive-side allocators on one NPU chip: where a request's incoming KV cache may land.

``ReceiveAllocator`` is HAWK's layout-aware design (docs/paper.md 4.2): the destination is the TT
paged KV cache itself, one region per DRAM bank; a request reserves TT blocks (one contiguous
run when it can, so the HAWK plan needs one write per bank and tensor) and every block spreads
its pages over the banks, so banks fill evenly.

``ContiguousAllocator`` is the rejected design: each request gets one linear buffer in the
chip's address space, which fills bank 0, then bank 1, ...; the request is re-laid out from
there. Its ``stats()`` show the per-bank imbalance, and ``interleaved_free_bytes`` how little
interleaved memory (which needs the same room in every bank) is left once one bank fills.

Both raise ``OutOfMemory`` when a reservation does not fit, and ``ValueError`` for bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hardware.dram import DramConfig, contiguous_runs
from hardware.kv_layout import TTKVSpec


class OutOfMemory(Exception):
    """A reservation does not fit in the free NPU memory."""


@dataclass(frozen=True)
class AllocatorStats:
    """Occupancy of one chip's receive memory. Bytes are per bank unless named otherwise."""

    bank_used_bytes: tuple[int, ...]
    bank_capacity_bytes: int
    num_requests: int
    free_units: int                # free blocks (layout-aware) or free bytes (contiguous)
    largest_free_run: int          # in the same unit
    fragmentation: float           # 1 - largest free run / free; 0 when nothing or all is free

    @property
    def occupancy(self) -> tuple[float, ...]:
        return tuple(u / self.bank_capacity_bytes for u in self.bank_used_bytes)

    @property
    def imbalance(self) -> float:
        """Most-used bank over the mean bank (1.0 = even; N = everything in one bank)."""
        used = np.asarray(self.bank_used_bytes, dtype=np.float64)
        return float(used.max() / used.mean()) if used.sum() else 1.0

    @property
    def interleaved_free_bytes(self) -> int:
        """Largest interleaved buffer that still fits: N times the free room of the fullest bank."""
        free = self.bank_capacity_bytes - np.asarray(self.bank_used_bytes, dtype=np.int64)
        return int(len(free) * free.min())


def _fragmentation(free_mask: np.ndarray) -> tuple[int, int, float]:
    """Free count, largest free run and fragmentation of a boolean free mask."""
    runs = contiguous_runs(np.flatnonzero(free_mask))
    free = int(free_mask.sum())
    largest = max((length for _, length in runs), default=0)
    return free, largest, (1.0 - largest / free) if free else 0.0


class ReceiveAllocator:
    """TT blocks of one chip's paged KV cache, reserved and released per request."""

    def __init__(self, tt: TTKVSpec):
        self.tt = tt
        self.free = np.ones(tt.max_num_blocks, dtype=bool)
        self.reservations: dict[object, np.ndarray] = {}

    @property
    def region_sizes(self) -> tuple[int, ...]:
        """Bytes per bank to register as the receive regions."""
        return self.tt.region_sizes

    def reserve(self, request_id, num_tokens: int) -> np.ndarray:
        """Reserve the TT blocks for ``num_tokens`` tokens: one run if one fits, else scattered."""
        if request_id in self.reservations:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens {num_tokens} must be > 0")
        need = self.tt.blocks_for(num_tokens)
        free_ids = np.flatnonzero(self.free)
        if free_ids.size < need:
            raise OutOfMemory(f"request {request_id!r} needs {need} blocks, {free_ids.size} free "
                              f"of {self.tt.max_num_blocks}")
        blocks = free_ids[:need]
        for start, length in contiguous_runs(free_ids):
            if length >= need:
                blocks = np.arange(start, start + need)
                break
        self.free[blocks] = False
        self.reservations[request_id] = blocks
        return blocks.copy()

    def release(self, request_id) -> None:
        if request_id not in self.reservations:
            raise ValueError(f"request {request_id!r} holds no reservation")
        self.free[self.reservations.pop(request_id)] = True

    def stats(self) -> AllocatorStats:
        tt = self.tt
        used = np.flatnonzero(~self.free)
        pages = tt.block_pages(used)
        per_bank = np.bincount(pages % tt.dram.num_banks, minlength=tt.dram.num_banks)
        per_bank = per_bank * 2 * tt.num_layers * tt.dram.aligned(tt.page_bytes)
        free, largest, frag = _fragmentation(self.free)
        return AllocatorStats(tuple(int(b) for b in per_bank), tt.region_sizes[0],
                              len(self.reservations), free, largest, frag)


class ContiguousAllocator:
    """One linear buffer per request in the chip's address space (bank b = [b*S, (b+1)*S))."""

    def __init__(self, dram: DramConfig):
        self.dram = dram
        self.reservations: dict[object, tuple[int, int]] = {}   # request -> (base, nbytes)

    @property
    def capacity(self) -> int:
        return self.dram.num_banks * self.dram.bank_bytes

    def reserve(self, request_id, nbytes: int) -> int:
        """First-fit base address of a free range of ``nbytes``."""
        if request_id in self.reservations:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        if nbytes <= 0:
            raise ValueError(f"nbytes {nbytes} must be > 0")
        cursor = 0
        for base, size in sorted(self.reservations.values()):
            if base - cursor >= nbytes:
                break
            cursor = max(cursor, base + size)
        if self.capacity - cursor < nbytes:
            raise OutOfMemory(f"request {request_id!r} needs {nbytes} contiguous bytes; none "
                              f"free in {self.capacity}")
        self.reservations[request_id] = (cursor, int(nbytes))
        return cursor

    def release(self, request_id) -> None:
        if request_id not in self.reservations:
            raise ValueError(f"request {request_id!r} holds no reservation")
        del self.reservations[request_id]

    def stats(self) -> AllocatorStats:
        s, n = self.dram.bank_bytes, self.dram.num_banks
        lo = np.arange(n, dtype=np.int64) * s
        used = np.zeros(n, dtype=np.int64)
        extents = sorted(self.reservations.values())
        for base, size in extents:
            used += np.clip(np.minimum(lo + s, base + size) - np.maximum(lo, base), 0, None)
        gaps, cursor = [], 0
        for base, size in extents + [(self.capacity, 0)]:
            gaps.append(base - cursor)
            cursor = max(cursor, base + size)
        free, largest = self.capacity - sum(sz for _, sz in extents), max(gaps)
        frag = (1.0 - largest / free) if free else 0.0
        return AllocatorStats(tuple(int(u) for u in used), s, len(self.reservations),
                              free, largest, frag)
