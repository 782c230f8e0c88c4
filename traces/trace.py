"""A trace: the table of requests a run consumes, held as columns.

Columns are numpy arrays of equal length, sorted by arrival. ``Trace`` is immutable; the
shaping functions return new traces. Iterating yields ``Request`` objects for readability;
the simulator reads the columns directly, which is what keeps it fast.

Optional prefix hashes (``hash_ids``): per request a tuple of block hashes, one per
``hash_block_size`` tokens of its prompt (the last block may be partial), as Mooncake's traces
carry them (``hash_ids``, 512-token blocks: FAST25-release/README.md of
github.com/kvcache-ai/Mooncake). Equal hashes at the same position are the same tokens and the
same prefix before them, so their KV cache can be shared (``sim.engine.prefix_cache``). A trace
without them is served as if every prompt were new.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from traces.schema import Request


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order. ``arrival_at`` in seconds from the start of the trace."""

    arrival_at: np.ndarray          # [n] float64, non-decreasing, >= 0
    num_prompt_tokens: np.ndarray   # [n] int64, >= 1
    num_output_tokens: np.ndarray   # [n] int64, >= 1
    request_id: np.ndarray          # [n] int64, unique
    name: str = "trace"
    tenant: np.ndarray | None = None  # [n] str (object): customer / application id, or None
    hash_ids: np.ndarray | None = None  # [n] tuple of int (object): prefix block hashes, or None
    hash_block_size: int = 512         # tokens per hash block (Mooncake's traces: 512)

    def __post_init__(self) -> None:
        arrays = {
            "arrival_at": np.ascontiguousarray(self.arrival_at, dtype=np.float64),
            "num_prompt_tokens": np.ascontiguousarray(self.num_prompt_tokens, dtype=np.int64),
            "num_output_tokens": np.ascontiguousarray(self.num_output_tokens, dtype=np.int64),
            "request_id": np.ascontiguousarray(self.request_id, dtype=np.int64),
        }
        n = len(arrays["arrival_at"])
        for key, value in arrays.items():
            if value.ndim != 1 or len(value) != n:
                raise ValueError(f"trace {self.name!r}: column {key} has shape {value.shape}, "
                                 f"expected ({n},)")
            value.setflags(write=False)
            object.__setattr__(self, key, value)
        if self.tenant is not None:
            tenant = np.asarray(self.tenant).astype(str).astype(object)
            if tenant.shape != (n,):
                raise ValueError(f"trace {self.name!r}: column tenant has shape "
                                 f"{tenant.shape}, expected ({n},)")
            tenant.setflags(write=False)
            object.__setattr__(self, "tenant", tenant)
        if self.hash_ids is not None:
            _set_hashes(self, n)
        _check(self.name, "arrival_at", arrays["arrival_at"],
               ~np.isfinite(arrays["arrival_at"]) | (arrays["arrival_at"] < 0),
               "finite and >= 0")
        if n > 1 and np.any(np.diff(arrays["arrival_at"]) < 0):
            i = int(np.flatnonzero(np.diff(arrays["arrival_at"]) < 0)[0]) + 1
            raise ValueError(f"trace {self.name!r}: arrival_at must be non-decreasing; row {i} "
                             f"({arrays['arrival_at'][i]}) comes before row {i - 1}")
        _check(self.name, "num_prompt_tokens", arrays["num_prompt_tokens"],
               arrays["num_prompt_tokens"] < 1, ">= 1")
        _check(self.name, "num_output_tokens", arrays["num_output_tokens"],
               arrays["num_output_tokens"] < 1, ">= 1")
        ids = np.sort(arrays["request_id"])     # (np.unique would import numpy.ma: start-up)
        if n > 1 and np.any(ids[1:] == ids[:-1]):
            raise ValueError(f"trace {self.name!r}: request_id values must be unique")

    @classmethod
    def from_columns(cls, arrival_at, num_prompt_tokens, num_output_tokens, request_id=None,
                     name: str = "trace") -> "Trace":
        n = len(arrival_at)
        if request_id is None:
            request_id = np.arange(n, dtype=np.int64)
        return cls(np.asarray(arrival_at), np.asarray(num_prompt_tokens),
                   np.asarray(num_output_tokens), np.asarray(request_id), name=name)

    def __len__(self) -> int:
        return len(self.arrival_at)

    def __iter__(self) -> Iterator[Request]:
        for i in range(len(self)):
            yield self[i]

    def __getitem__(self, i: int) -> Request:
        return Request(int(self.request_id[i]), float(self.arrival_at[i]),
                       int(self.num_prompt_tokens[i]), int(self.num_output_tokens[i]))

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests."""
        return self.select(slice(0, n))

    def until(self, duration_s: float) -> "Trace":
        """Requests arriving before ``duration_s``."""
        return self.select(self.arrival_at < duration_s)

    def select(self, index) -> "Trace":
        return Trace(self.arrival_at[index], self.num_prompt_tokens[index],
                     self.num_output_tokens[index], self.request_id[index], name=self.name,
                     tenant=None if self.tenant is None else self.tenant[index],
                     **self.hashes_at(index))

    def hashes_at(self, index) -> dict:
        """The prefix-hash keywords of the rows at ``index`` (none when the trace has none),
        for building a new trace of those rows."""
        if self.hash_ids is None:
            return {}
        return {"hash_ids": self.hash_ids[index], "hash_block_size": self.hash_block_size}

    @property
    def duration_s(self) -> float:
        return float(self.arrival_at[-1] - self.arrival_at[0]) if len(self) > 1 else 0.0

    def to_frame(self):
        import pandas as pd

        frame = pd.DataFrame({"request_id": self.request_id, "arrival_at": self.arrival_at,
                              "num_prompt_tokens": self.num_prompt_tokens,
                              "num_output_tokens": self.num_output_tokens})
        if self.tenant is not None:
            frame["tenant"] = self.tenant
        return frame


def _set_hashes(trace: Trace, n: int) -> None:
    """Hold ``hash_ids`` as a read-only object array of int tuples (hashes past a prompt's
    last block are kept, and never looked up: ``sim.engine.prefix_cache``)."""
    if not (isinstance(trace.hash_block_size, int) and trace.hash_block_size >= 1):
        raise ValueError(f"trace {trace.name!r}: hash_block_size must be a whole number >= 1, "
                         f"got {trace.hash_block_size!r}")
    given = list(trace.hash_ids)
    if len(given) != n:
        raise ValueError(f"trace {trace.name!r}: column hash_ids has {len(given)} rows, "
                         f"expected {n}")
    hashes = np.empty(n, dtype=object)
    for i, ids in enumerate(given):
        try:
            hashes[i] = tuple(int(h) for h in ids)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"trace {trace.name!r}: row {i}: hash_ids must be a list of "
                             f"integers, got {ids!r:.60}") from None
    hashes.setflags(write=False)
    object.__setattr__(trace, "hash_ids", hashes)


def _check(name: str, column: str, values: np.ndarray, bad: np.ndarray, allowed: str) -> None:
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"trace {name!r}: row {i}: {column} = {values[i]} must be {allowed}")
