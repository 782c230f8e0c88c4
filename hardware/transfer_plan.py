"""The transfer plan: the list of one-sided writes that move one request's KV cache (each
mechanism's builder is in ``hardware.mechanism_plans``; the capacity plan is another thing,
``sim.runs.capacity``).

One plan, two executors: the real mode posts a plan's writes on a transport; the simulator
prices the same plan (setup + per-write cost + bytes / bandwidth + transformation time).
Every mechanism (per page, per GPU block, single contiguous buffer, host-staged, HAWK) is a
plan, so they can be compared on the same request.

A write copies ``nbytes`` from ``src_offset`` of the source (send) buffer to
``dst_offset`` of destination region ``dst_region`` (a DRAM bank buffer on an NPU, or the one
contiguous buffer of a GPU / single-buffer design).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TransferPlan:
    """Writes as columns. ``kind`` names the mechanism (e.g. ``"hawk"``, ``"per_page"``)."""

    kind: str
    src_offset: np.ndarray   # [w] int64, bytes into the source buffer
    dst_region: np.ndarray   # [w] int64, destination region (bank) index
    dst_offset: np.ndarray   # [w] int64, bytes into that region
    nbytes: np.ndarray       # [w] int64, > 0
    src_size: int            # bytes of the source buffer the plan reads from
    region_sizes: tuple[int, ...] = field(default=())   # bytes per destination region used
    extra: dict = field(default_factory=dict)           # mechanism facts (e.g. relayout bytes)

    def __post_init__(self) -> None:
        cols = {}
        for name in ("src_offset", "dst_region", "dst_offset", "nbytes"):
            value = np.ascontiguousarray(getattr(self, name), dtype=np.int64)
            value.setflags(write=False)
            cols[name] = value
            object.__setattr__(self, name, value)
        n = len(cols["nbytes"])
        if any(len(v) != n for v in cols.values()):
            raise ValueError(f"plan {self.kind!r}: columns differ in length")
        if n and cols["nbytes"].min() <= 0:
            i = int(np.argmin(cols["nbytes"]))
            raise ValueError(f"plan {self.kind!r}: write {i} has nbytes {cols['nbytes'][i]}, "
                             f"must be > 0")

    @property
    def num_writes(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def writes_per_region(self) -> np.ndarray:
        """Number of writes into each destination region."""
        if self.num_writes == 0:
            return np.zeros(len(self.region_sizes), dtype=np.int64)
        size = max(len(self.region_sizes), int(self.dst_region.max()) + 1)
        return np.bincount(self.dst_region, minlength=size)

    def bytes_per_region(self) -> np.ndarray:
        if self.num_writes == 0:
            return np.zeros(len(self.region_sizes), dtype=np.int64)
        size = max(len(self.region_sizes), int(self.dst_region.max()) + 1)
        return np.bincount(self.dst_region, weights=self.nbytes, minlength=size).astype(np.int64)

    def check_bounds(self, src_size: int, region_sizes) -> None:
        """Raise ``ValueError`` naming the first write that falls outside its buffers."""
        region_sizes = np.asarray(region_sizes, dtype=np.int64)
        bad_region = (self.dst_region < 0) | (self.dst_region >= len(region_sizes))
        if bad_region.any():
            i = int(np.flatnonzero(bad_region)[0])
            raise ValueError(f"plan {self.kind!r}: write {i} targets region "
                             f"{self.dst_region[i]}, only {len(region_sizes)} registered")
        src_end = self.src_offset + self.nbytes
        bad_src = (self.src_offset < 0) | (src_end > src_size)
        if bad_src.any():
            i = int(np.flatnonzero(bad_src)[0])
            raise ValueError(f"plan {self.kind!r}: write {i} reads source bytes "
                             f"[{self.src_offset[i]}, {src_end[i]}) outside [0, {src_size})")
        dst_end = self.dst_offset + self.nbytes
        limit = region_sizes[self.dst_region]
        bad_dst = (self.dst_offset < 0) | (dst_end > limit)
        if bad_dst.any():
            i = int(np.flatnonzero(bad_dst)[0])
            raise ValueError(f"plan {self.kind!r}: write {i} writes region {self.dst_region[i]} "
                             f"bytes [{self.dst_offset[i]}, {dst_end[i]}) outside "
                             f"[0, {limit[i]})")
