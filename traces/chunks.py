"""Requests in chunks: a trace read a few thousand requests at a time, for bounded memory.

A ``RequestSource`` knows how many requests it holds (``n``) and yields them in arrival order
as ``RequestChunk`` column arrays. Two kinds:

- ``workload_source``: a paper workload's Poisson arrivals generated chunk by chunk, the same
  numbers ``traces.workloads.make_workload`` draws in one go (tested byte for byte). That
  function draws, from one generator, every gap, then every length-table row, then (for
  Summarization) every uniform prompt length. Each kind of draw is sequential in the
  generator, so a chunk of draws continues the previous one exactly; a first pass counts the
  gaps (and, for Summarization, the rows) without keeping them, which gives the generator's
  state where each kind starts, and one generator per kind then advances chunk by chunk.
  Arrival instants are a running sum carried across chunks in the same order as ``cumsum``.
- ``trace_source``: a ``Trace`` held in memory, handed out in slices (its columns are 32
  bytes a request; the simulator's per-request state is what streaming bounds).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import numpy as np

from traces.trace import Trace
from traces.workloads import check_size, length_table, workload_spec

#: requests per chunk: large enough that numpy, not Python, does the work per request
CHUNK_SIZE = 8192


@dataclass(frozen=True)
class RequestChunk:
    """Requests ``start .. start + len - 1`` of a source (positions in arrival order)."""

    start: int
    request_id: np.ndarray          # [k] int64
    arrival_at: np.ndarray          # [k] float64, non-decreasing
    num_prompt_tokens: np.ndarray   # [k] int64
    num_output_tokens: np.ndarray   # [k] int64
    tenant: np.ndarray | None = None   # [k] object (str), or None

    def __len__(self) -> int:
        return len(self.arrival_at)


@dataclass(frozen=True)
class RequestSource:
    """``n`` requests; ``chunks()`` yields them from the first, anew on every call."""

    n: int
    name: str
    chunks: Callable[[], Iterator[RequestChunk]]
    has_tenant: bool = False
    #: a picklable ``recipe(chunk_size=...)`` that makes this source again in another
    #: process (a cell's worker), or None
    recipe: Callable[..., "RequestSource"] | None = None

    def __len__(self) -> int:
        return self.n


def trace_source(trace: Trace, chunk_size: int = CHUNK_SIZE) -> RequestSource:
    """A trace in memory, in slices of ``chunk_size`` requests."""
    def chunks() -> Iterator[RequestChunk]:
        for lo in range(0, len(trace), chunk_size):
            part = slice(lo, lo + chunk_size)
            yield RequestChunk(lo, trace.request_id[part], trace.arrival_at[part],
                               trace.num_prompt_tokens[part], trace.num_output_tokens[part],
                               None if trace.tenant is None else trace.tenant[part])

    return RequestSource(len(trace), trace.name, chunks, trace.tenant is not None,
                         recipe=partial(trace_source, trace))


def workload_source(name: str, rate: float, num_requests: int | None = None,
                    duration_s: float | None = None, seed: int = 0,
                    chunk_size: int = CHUNK_SIZE) -> RequestSource:
    """``make_workload(name, rate, num_requests, duration_s, seed)`` chunk by chunk."""
    check_size(num_requests, duration_s)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    spec = workload_spec(name)
    table_prompt, table_output = length_table(spec.lengths_file)
    rng = np.random.default_rng(seed)
    start = copy.deepcopy(rng.bit_generator.state)
    num_drawn, n = _count_arrivals(rng, rate, num_requests, duration_s, chunk_size)
    rows_start = copy.deepcopy(rng.bit_generator.state)
    range_start = None
    if spec.prompt_range is not None:          # skip the row draws: uniform prompts follow
        for k in _sizes(num_drawn, chunk_size):
            rng.integers(0, len(table_prompt), size=k)
        range_start = rng.bit_generator.state

    def chunks() -> Iterator[RequestChunk]:
        gaps, rows = _generator(start), _generator(rows_start)
        uniform = _generator(range_start) if range_start is not None else None
        carry, lo = np.zeros(1), 0
        for k in _sizes(n, chunk_size):
            times = np.cumsum(np.concatenate([carry, gaps.exponential(1.0 / rate, size=k)]))
            carry = times[-1:]
            index = rows.integers(0, len(table_prompt), size=k)
            prompt, output = table_prompt[index], table_output[index]
            if uniform is not None:
                low, high = spec.prompt_range
                prompt = uniform.integers(low, high + 1, size=k)
            yield RequestChunk(lo, np.arange(lo, lo + k, dtype=np.int64), times[1:],
                               prompt.astype(np.int64), output.astype(np.int64))
            lo += k

    return RequestSource(n, f"{name}@{rate:g}", chunks,
                         recipe=partial(workload_source, name, rate, num_requests, duration_s,
                                        seed))


def _count_arrivals(rng: np.random.Generator, rate: float, num_requests: int | None,
                    duration_s: float | None, chunk_size: int) -> tuple[int, int]:
    """Draw the gaps ``make_workload`` draws, keeping none: (gaps drawn, requests kept).

    A count draws that many; a duration alone draws blocks of ``rate * duration * 1.2 + 50``
    until one arrival is past it; the requests kept are those before ``duration_s``."""
    scale = 1.0 / rate
    if num_requests is not None:
        block, blocks_until_past = num_requests, False
    else:
        block, blocks_until_past = int(rate * duration_s * 1.2 + 50), True
    drawn = kept = 0
    last = 0.0
    while True:
        for k in _sizes(block, chunk_size):
            times = np.cumsum(np.concatenate([[last], rng.exponential(scale, size=k)]))[1:]
            last = float(times[-1])
            kept += k if duration_s is None else int(np.searchsorted(times, duration_s))
            drawn += k
        if not blocks_until_past or last >= duration_s:
            return drawn, kept


def rechunk(parts: Iterator[dict], chunk_size: int, n: int | None = None
            ) -> Iterator[RequestChunk]:
    """Column blocks of any sizes (``RequestChunk``'s columns as a dict, tenant None when
    absent) as chunks of ``chunk_size`` requests numbered from 0; stops after ``n``."""
    names = ("request_id", "arrival_at", "num_prompt_tokens", "num_output_tokens", "tenant")
    held: list[dict] = []
    num_held = start = 0
    for part in parts:
        if len(part["arrival_at"]):
            held.append(part)
            num_held += len(part["arrival_at"])
        while num_held >= chunk_size or (n is not None and start + num_held >= n and held):
            k = chunk_size if n is None else min(chunk_size, n - start)
            if k <= 0:
                return
            joined = {c: None if held[0][c] is None else np.concatenate([p[c] for p in held])
                      for c in names}
            yield RequestChunk(start, *(None if joined[c] is None else joined[c][:k]
                                        for c in names))
            rest = {c: None if v is None else v[k:] for c, v in joined.items()}
            held = [rest] if len(rest["arrival_at"]) else []
            num_held -= k
            start += k
            if n is not None and start >= n:
                return
    if held and num_held:
        joined = {c: None if held[0][c] is None else np.concatenate([p[c] for p in held])
                  for c in names}
        yield RequestChunk(start, *(joined[c] for c in names))


def _sizes(n: int, chunk_size: int) -> Iterator[int]:
    for lo in range(0, n, chunk_size):
        yield min(chunk_size, n - lo)


def _generator(state: dict) -> np.random.Generator:
    bit = np.random.PCG64()
    bit.state = state
    return np.random.Generator(bit)
