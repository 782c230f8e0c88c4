"""A trace: the table of requests a run consumes, held as columns.

Columns are numpy arrays of equal length, sorted by arrival. ``Trace`` is immutable; the
shaping functions return new traces. Iterating yields ``Request`` objects for readability;
the simulator reads the columns directly, which is what keeps it fast.
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
                     tenant=None if self.tenant is None else self.tenant[index])

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


def _check(name: str, column: str, values: np.ndarray, bad: np.ndarray, allowed: str) -> None:
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"trace {name!r}: row {i}: {column} = {values[i]} must be {allowed}")
