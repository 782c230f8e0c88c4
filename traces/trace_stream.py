"""A trace file streamed: read a block at a time, checked, ordered, shaped, handed out in chunks.

``load_trace`` holds a whole file (~40 bytes a request, and its parsing several times that).
``stream_source(TraceStream(path, ...))`` gives the same requests as a
``traces.chunks.RequestSource`` in bounded memory, for a streamed run (``sim.engine.stream``):

1. **Scan** (``scan``): the file is read once through ``traces.loaders.read_blocks``, the
   whole-file loader's own reader, parser and checks, so a bad row raises the same
   ``TraceFormatError`` naming file, line (``row`` for Parquet) and field, and ``skip_bad``
   counts the same reasons. The scan counts the requests the run will get (``n``, which the
   router needs up front) and writes the ``LoadReport`` and ``ShapeReport``.
2. **Chunks**: each call of ``chunks()`` reads the file again and hands the requests out in
   arrival order, re-based, shaped and cut as the whole-file path does (``--window``, then
   ``--rate-scale``, then ``--num-requests``, then ``--duration``), in ``chunk_size`` slices.

**Arrival order.** ``load_trace`` sorts rows by arrival (stably). A stream holds back the
latest ``reorder_rows`` rows (``REORDER_ROWS``) and passes rows on in (arrival, row) order:
a row whose arrival is earlier than at most ``reorder_rows`` of the rows before it is put in
its place, so the requests are exactly the sorted ones. A row earlier than a request already
passed on is refused, naming its line and the arrival column: sort the file, or load it whole
(``--no-stream``). Every value check happens in the scan, before the run starts.
``hawk simulate --trace`` without ``--stream``/``--no-stream`` scans first and streams a
trace of more than ``sim.config.run_size.STREAM_MIN_REQUESTS`` requests, else loads it whole.

Memory: a block of raw rows (``block_rows``), the reorder window and one chunk; plus 16 bytes
a request when ``mapping`` names an id column (ids are checked for duplicates over the whole
file; the default ids, row indices, are unique by construction). Measured: ``hawk simulate
--trace`` of a 3,000,000-row CSV (default Chatbot cluster) peaked at 214 MB resident with
``--stream`` and at 1,862 MB with ``--no-stream`` (the file loaded whole), with the same
counts, attainment and means; the scan and the second read took 34 s of CPU together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np

from traces.bundled import resolve_trace
from traces.chunks import CHUNK_SIZE, RequestChunk, RequestSource, rechunk
from traces.loaders import (FORMATS, TENANT_COLUMNS, TIME_UNITS, ColumnMapping, LoadReport,
                            Tally, TraceFormatError, check_unique, detect_format,
                            norm_column_name, read_blocks, tenants_of)
from traces.shaping import ShapeReport, ShapeSpec, offered_load

#: rows a stream holds back to put rows out of arrival order in their place
REORDER_ROWS = 65_536
#: rows parsed at a time (~0.5 KB each as Python text before conversion)
BLOCK_ROWS = 16_384


class OutOfOrder(TraceFormatError):
    """A row arrives before a request the stream has already passed on."""


@dataclass(frozen=True)
class TraceStream:
    """A trace file to stream and what to do to it: the arguments of ``load_trace``, the
    shaping of ``hawk simulate`` (window and rate scale only) and its cuts. The first
    ``num_requests`` good rows are read (``load_trace``'s ``max_requests``) unless
    ``whole_file``: then every row is read and the count cut after the window, as
    ``hawk simulate --window`` does."""

    path: Path
    format: str | None = None
    skip_bad: bool = False
    mapping: ColumnMapping | None = None
    filters: dict | None = field(default=None, hash=False)
    num_requests: int | None = None
    duration_s: float | None = None
    shape: ShapeSpec = ShapeSpec()
    whole_file: bool = False
    reorder_rows: int = REORDER_ROWS
    block_rows: int = BLOCK_ROWS

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"trace format {self.format!r} is not one of {list(FORMATS)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.reorder_rows < 0 or self.block_rows < 1:
            raise ValueError(f"reorder_rows must be >= 0 and block_rows >= 1, got "
                             f"{self.reorder_rows} and {self.block_rows}")
        s = self.shape
        if (s.sample_fraction, s.sample_requests, s.max_prompt_tokens,
                s.max_output_tokens) != (None, None, None, None):
            raise ValueError("a streamed trace is windowed and rate-scaled only; sampling and "
                             "length caps need the whole trace (load it with load_trace)")


@dataclass(frozen=True)
class Scan:
    """What the scan found: the requests the run gets, the load and shaping reports, the
    trace's tenant column (None: no tenants)."""

    n: int
    report: LoadReport
    shaped: ShapeReport
    tenant_column: str | None
    #: seconds from the first request's arrival to the last's, as the run gets them
    span_s: float = 0.0


def scan(spec: TraceStream) -> Scan:
    """Read the whole file once, checking every row (module docstring, step 1)."""
    path, fmt = _open(spec)
    tally = Tally(keep_problems=False)
    counts = {"reordered": 0, "ids": [], "lines": [], "unit": "line"}
    n = num_in = num_windowed = 0
    first = first_at = last_at = None
    for part in _shaped(spec, path, fmt, tally, None, counts):
        if first is None:
            first = part["origin"]
        if len(part["arrival_at"]):
            first_at = part["arrival_at"][0] if first_at is None else first_at
            last_at = part["arrival_at"][-1]
        n += len(part["arrival_at"])
        num_in += part["num_in"]
        num_windowed += part["num_windowed"]
    if not tally.num_kept:
        raise ValueError(f"{path}: no requests left to load ({tally.num_bad} bad rows, "
                         f"{tally.num_filtered} filtered out of {tally.num_rows})")
    if tally.spec.request_id:
        check_unique(path, counts["unit"], np.concatenate(counts["ids"]),
                      np.concatenate(counts["lines"]), tally.spec.request_id)
    notes = ("hash_ids checked but not carried: a streamed run has no prefix cache",) \
        if fmt == "mooncake" and "hash_ids" in tally.columns else ()
    report = LoadReport(str(path), fmt, tally.num_rows, tally.num_kept, tally.num_bad,
                        dict(tally.reasons), tally.num_filtered, counts["reordered"],
                        _origin_text(first, tally.spec), notes, tally.read_to_end)
    shaped = ShapeReport(num_in, num_windowed, num_in - num_windowed,
                         rate_scale=spec.shape.rate_scale)
    by_key = {norm_column_name(k): k for k in tally.columns}   # every column (JSON: key) seen
    return Scan(n, report, shaped, next((by_key[k] for k in TENANT_COLUMNS if k in by_key),
                                        None), float(last_at - first_at) if n else 0.0)


def stream_source(spec: TraceStream, chunk_size: int = CHUNK_SIZE,
                  found: Scan | None = None) -> RequestSource:
    """The requests of ``spec`` in chunks (module docstring); ``found``: its scan, if done."""
    found = found if found is not None else scan(spec)
    path, fmt = _open(spec)

    def chunks() -> Iterator[RequestChunk]:
        tally = Tally(keep_problems=False)
        parts = _shaped(spec, path, fmt, tally, found.tenant_column, None)
        num = 0
        for chunk in rechunk(parts, chunk_size, found.n):
            num += len(chunk)
            yield chunk
        if num != found.n:
            raise RuntimeError(f"{path}: {num:,} requests read, but the scan found "
                               f"{found.n:,}: did the file change during the run?")

    return RequestSource(found.n, path.stem, chunks, found.tenant_column is not None,
                         recipe=partial(stream_source, spec, found=found))


def _open(spec: TraceStream) -> tuple[Path, str]:
    path = resolve_trace(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    fmt = detect_format(path) if spec.format is None else spec.format
    if spec.mapping is not None and fmt not in ("csv", "jsonl", "parquet"):
        raise ValueError(f"mapping applies to csv, jsonl and parquet traces, not {fmt!r}")
    return path, fmt


def _kept(spec: TraceStream, path: Path, fmt: str, tally: Tally, tenant: str | None,
          counts: dict | None) -> Iterator[tuple[dict, str]]:
    """Each block's good rows, in file order (arrival in the file's unit, lengths, ids,
    tenants, source lines, their position among the kept rows), and the file's row unit;
    ``counts`` (the scan's) gathers the rows out of order and, for a mapped id column, ids."""
    max_requests = None if spec.whole_file else spec.num_requests
    position, running_max = 0, None
    for raw, values, problems in read_blocks(
            path, fmt, tally, skip_bad=spec.skip_bad, mapping=ColumnMapping.of(spec.mapping),
            filters=spec.filters, max_requests=max_requests, block_rows=spec.block_rows):
        bad = {line for line, *_ in problems}
        keep = np.array([line not in bad for line in raw.lines], dtype=bool)
        k = int(keep.sum())
        at = values["arrival_at"][keep]
        rows = {"at": at, "prompt": values["num_prompt_tokens"][keep],
                "output": values["num_output_tokens"][keep],
                "id": values["request_id"][keep] if "request_id" in values else raw.index[keep],
                "line": raw.lines[keep], "pos": np.arange(position, position + k)}
        if tenant is not None:
            column = raw.columns.get(tenant)
            rows["tenant"] = (np.full(k, "", dtype=object) if column is None else
                              tenants_of(_only(raw, tenant))[keep])
        position += k
        if counts is not None and k:
            counts["unit"] = raw.unit
            ahead = np.maximum.accumulate(at) if running_max is None else \
                np.maximum.accumulate(np.concatenate([[running_max], at]))[1:]
            counts["reordered"] += int(np.sum(at < ahead))
            running_max = ahead[-1]
            if tally.spec.request_id:
                counts["ids"].append(rows["id"])
                counts["lines"].append(rows["line"])
        yield rows, raw.unit


def _only(raw, column: str):
    """``raw`` with its columns cut to ``column`` (``tenants_of`` reads the first tenant
    column it finds; the stream names it once for the whole file)."""
    return replace(raw, columns={column: raw.columns[column]})


def _ordered(spec: TraceStream, path: Path, fmt: str, tally: Tally, tenant: str | None,
             counts: dict | None) -> Iterator[dict]:
    """The kept rows in (arrival, position) order, holding back ``reorder_rows`` of them."""
    pending, last = None, None
    column = None
    for rows, unit in _kept(spec, path, fmt, tally, tenant, counts):
        column = column or dict(tally.spec.fields())["arrival_at"]
        if last is not None and len(rows["at"]) and rows["at"].min() < last:
            j = int(np.flatnonzero(rows["at"] < last)[0])
            raise OutOfOrder(
                path, f"{unit} {int(rows['line'][j])}", column,
                f"arrives before a request already passed on ({_shown(rows['at'][j], tally)} "
                f"< {_shown(last, tally)}): a streamed trace puts rows in arrival order only "
                f"within {spec.reorder_rows:,} rows; sort the file by arrival, or load it "
                f"whole (--no-stream)")
        merged = rows if pending is None else {k: np.concatenate([pending[k], rows[k]])
                                               for k in rows}
        order = np.lexsort((merged["pos"], merged["at"]))
        merged = {k: v[order] for k, v in merged.items()}
        cut = len(order) - spec.reorder_rows
        if cut > 0:
            last = merged["at"][cut - 1]
            yield {k: v[:cut] for k, v in merged.items()}
            pending = {k: v[cut:] for k, v in merged.items()}
        else:
            pending = merged
    if pending is not None and len(pending["at"]):
        yield pending


def _shaped(spec: TraceStream, path: Path, fmt: str, tally: Tally, tenant: str | None,
            counts: dict | None) -> Iterator[dict]:
    """Ordered rows re-based to the first arrival, windowed, rate-scaled and cut, as
    ``hawk simulate`` does to a loaded trace: ``RequestChunk`` columns, plus the counts."""
    origin, left = None, spec.num_requests
    s = spec.shape
    for rows in _ordered(spec, path, fmt, tally, tenant, counts):
        if origin is None:
            origin = rows["at"][0]
        if tally.spec.time_unit == "datetime":
            seconds = (rows["at"] - origin) / 1e9
        else:
            seconds = (rows["at"] - origin) * TIME_UNITS[tally.spec.time_unit]
        keep = seconds >= s.start_s
        if s.end_s is not None:
            keep &= seconds < s.end_s
        arrival = seconds[keep] - s.start_s
        if s.rate_scale != 1.0:
            arrival = arrival / s.rate_scale
        take = np.flatnonzero(keep)
        if left is not None:
            arrival, take = arrival[:left], take[:left]
            left -= len(take)
        if spec.duration_s is not None:
            before = arrival < spec.duration_s
            arrival, take = arrival[before], take[before]
        yield {"request_id": rows["id"][take].astype(np.int64), "arrival_at": arrival,
               "num_prompt_tokens": rows["prompt"][take], "num_output_tokens":
               rows["output"][take], "tenant": rows["tenant"][take] if tenant else None,
               "origin": origin, "num_in": len(keep), "num_windowed": int(keep.sum())}


def _origin_text(origin, spec: ColumnMapping | None) -> str:
    if origin is None or spec is None:
        return ""
    if spec.time_unit == "datetime":
        return str(np.datetime64(int(origin), "ns")) + "Z"
    return f"{origin * TIME_UNITS[spec.time_unit]:.9g} s"


def _shown(value, tally: Tally) -> str:
    if tally.spec.time_unit == "datetime":
        return str(np.datetime64(int(value), "ns")) + "Z"
    return f"{float(value):g} {tally.spec.time_unit}"


#: bytes sampled from a text trace's start to estimate its rows from its size
SAMPLE_BYTES = 1 << 20


def estimate_rows(path) -> int:
    """The rows of a trace file, estimated without reading it: a Parquet file's footer, else
    the file's size over the mean line length of its first ``SAMPLE_BYTES`` (exact for a file
    that short; a CSV's header line is not a row). Rows, not requests: bad, filtered and
    windowed rows are only known once the file is read."""
    path = resolve_trace(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    size = path.stat().st_size
    with open(path, "rb") as f:
        sample = f.read(SAMPLE_BYTES)
    lines = sample.count(b"\n") + (0 if sample.endswith(b"\n") or not sample else 1)
    header = 0 if sample.lstrip()[:1] == b"{" else 1
    if len(sample) == size or lines <= header:
        return max(lines - header, 0)
    return round(size / (len(sample) / lines)) - header


def open_stream(path, format: str | None, skip_bad: bool, num_requests: int | None,
                duration_s: float | None, shape: ShapeSpec, whole_file: bool,
                quiet: bool = False, longer_than: int | None = None,
                mapping: ColumnMapping | None = None) -> tuple[RequestSource, dict] | None:
    """``hawk simulate --trace FILE --stream``: the scanned source and the trace's part of
    the summary (what a loaded trace reports: path, load and shaping reports, requests).

    With ``longer_than`` (no ``--stream``/``--no-stream``) the scan decides: a trace of more
    requests streams; None for a shorter one, or one out of order beyond the reorder
    window (``OutOfOrder``): load it whole (the exact path, which sorts)."""
    import sys
    from dataclasses import asdict

    spec = TraceStream(Path(path), format, skip_bad, mapping, num_requests=num_requests,
                       duration_s=duration_s, shape=shape, whole_file=whole_file)
    try:
        found = scan(spec)
    except OutOfOrder:
        if longer_than is None:
            raise
        return None
    if longer_than is not None and found.n <= longer_than:
        return None
    if found.n == 0:
        raise ValueError(f"{path}: no requests left to simulate after the window and "
                         f"duration ({found.shaped.describe()})")
    if not quiet:
        print(found.report.describe() + "\n  shaping: " + found.shaped.describe()
              + f"\n  streamed: read in blocks of {spec.block_rows:,} rows, reordered within "
              f"{spec.reorder_rows:,}", file=sys.stderr)
    info = {"path": str(path), "load": found.report.as_dict(), "shaping": asdict(found.shaped),
            "num_simulated": found.n, "offered": offered_load(found.n, found.span_s),
            "streamed": True}
    return stream_source(spec, found=found), info
