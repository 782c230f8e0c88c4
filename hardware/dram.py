"""NPU DRAM banks and interleaved buffers: where each page of a tensor lands.

An interleaved buffer (ttnn ``DRAM_MEMORY_CONFIG``) puts page ``p`` in bank ``p % N`` at
``base + bank_offset[bank] + (p // N) * align(page_bytes, A)``; every bank uses the same base.
For any contiguous page range ``[P0, P1)`` each bank's share is one contiguous range of slots,
which is what lets HAWK place a tensor with N writes instead of one per page (docs/facts.md 3).

Offsets returned here are *within a bank* (``base + slot * aligned page``); the bank's own
offset in the device address space (Wormhole: 1 GiB for odd banks) is added only by
``DramConfig.device_address``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GiB = 1 << 30


@dataclass(frozen=True)
class DramConfig:
    """The DRAM banks of one NPU chip. Read ``num_banks`` from the device; never assume it."""

    num_banks: int
    alignment: int = 64                 # bytes; 64 on Blackhole, 32 on Wormhole
    bank_bytes: int = 4 * GiB           # usable bytes per bank
    bank_offsets: tuple[int, ...] = ()  # per-bank offset in the device address space
    name: str = "dram"

    def __post_init__(self) -> None:
        if not 1 <= self.num_banks <= 64:
            raise ValueError(f"num_banks {self.num_banks} out of range 1..64")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment {self.alignment} must be a positive power of two")
        if self.bank_bytes <= 0:
            raise ValueError(f"bank_bytes {self.bank_bytes} must be > 0")
        if not self.bank_offsets:
            object.__setattr__(self, "bank_offsets", (0,) * self.num_banks)
        if len(self.bank_offsets) != self.num_banks:
            raise ValueError(f"{len(self.bank_offsets)} bank offsets for {self.num_banks} banks")

    def aligned(self, page_bytes: int) -> int:
        """Bytes a page occupies in its bank (rounded up to the alignment)."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes {page_bytes} must be > 0")
        return -(-page_bytes // self.alignment) * self.alignment

    def device_address(self, bank, offset):
        """Address in the device's address space of ``offset`` within ``bank``."""
        return np.asarray(self.bank_offsets, dtype=np.int64)[bank] + offset


def blackhole_p150a() -> DramConfig:
    """Blackhole p150a: 8 banks = 8 GDDR6 channels, no bank offsets, ~3.98 GiB each."""
    return DramConfig(num_banks=8, alignment=64, bank_bytes=int(3.98 * GiB), name="p150a")


def wormhole() -> DramConfig:
    """Wormhole (n150, one n300 chip): 12 banks of 1 GiB; odd banks sit 1 GiB into a channel."""
    return DramConfig(num_banks=12, alignment=32, bank_bytes=GiB,
                      bank_offsets=tuple((b % 2) * GiB for b in range(12)), name="wormhole")


def page_location(pages, page_bytes: int, dram: DramConfig, base: int = 0):
    """Bank and in-bank offset of each page of an interleaved buffer at ``base``."""
    pages = np.asarray(pages, dtype=np.int64)
    n = dram.num_banks
    return pages % n, base + (pages // n) * dram.aligned(page_bytes)


def bank_shares(p0: int, p1: int, num_banks: int):
    """Each bank's share of pages ``[p0, p1)``: first page, page count, first in-bank slot.

    Bank k gets pages ``p_k, p_k + N, ...`` with ``p_k = p0 + ((k - p0) mod N)``.
    Returns three ``[N]`` int64 arrays (``first`` is meaningless where ``count`` is 0).
    """
    if p0 < 0 or p1 < p0:
        raise ValueError(f"page range [{p0}, {p1}) must satisfy 0 <= p0 <= p1")
    k = np.arange(num_banks, dtype=np.int64)
    first = p0 + (k - p0) % num_banks
    count = np.maximum(0, -(-(p1 - first) // num_banks))
    return first, count, first // num_banks


def bank_major_order(p0: int, p1: int, num_banks: int) -> np.ndarray:
    """Pages ``[p0, p1)`` reordered bank by bank (bank 0's pages first, each in slot order).

    Same as padding the page list to whole rows of N starting at ``p0 % N``, viewing it as
    ``[rows, N]``, transposing to ``[N, rows]`` and dropping the pads.
    """
    lead = p0 % num_banks
    rows = -(-(p1 - p0 + lead) // num_banks)
    grid = np.arange(rows * num_banks, dtype=np.int64).reshape(rows, num_banks) - lead + p0
    order = grid.T.reshape(-1)                                   # [N * rows], bank-major
    return order[(order >= p0) & (order < p1)]


def contiguous_runs(ids) -> list[tuple[int, int]]:
    """Split a sequence of ints into runs of consecutive values: ``[(start, length), ...]``."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    return [(int(ids[s]), int(e - s)) for s, e in zip(starts, ends)]
