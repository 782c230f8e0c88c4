"""Trace loaders: the request logs users bring, read into a ``Trace`` and a ``LoadReport``.

Formats (``FORMATS``: azure, burstgpt, mooncake, splitwise, csv, jsonl, parquet; their columns
and units in ``traces.formats``) are detected from the header / first record or chosen with
``format=``.

The contract every format keeps:

- Arrival instants are **re-based**: the earliest loaded request arrives at 0.0 s. The
  original first timestamp is kept in ``LoadReport.origin``.
- ``request_id`` is the row's 0-based index among the file's data rows (header and blank
  lines not counted), unless ``mapping`` names an id column; a record leads back to its row.
- Rows out of arrival order are sorted (stably) and counted in ``LoadReport.num_reordered``.
  (``traces.trace_stream`` reads a file in blocks through ``read_blocks``, with the same
  checks, and puts rows in order within a bounded window instead of sorting the whole file.)
- A malformed row raises ``TraceFormatError`` naming file, line (``row`` for Parquet) and
  field. With ``skip_bad=True`` it is dropped and counted by reason. Values are never
  clipped or rewritten: a zero-token response is a bad row, not a one-token one.
- A tenant column (``TENANT_COLUMNS``: ``tenant``, ``tenant_id``, ``customer``,
  ``application_id`` as in Splitwise's traces, ``app``), where a file has one, becomes the
  trace's ``tenant`` (as text; an empty cell is the tenant ``""``).
- ``filters={column: value or values}`` keeps only matching rows (counted as filtered, not
  as bad). Column names match ignoring case, spaces and underscores (``log_type``).
- Every value is range-checked after parsing: token counts are whole numbers in
  1..``MAX_TOKENS`` (ids 0..``MAX_REQUEST_ID``, exact in float64), arrivals finite, >= 0 and
  small enough that float64 still resolves ``ARRIVAL_RESOLUTION_S`` at their magnitude
  (1e17 s would silently round sub-second gaps away). Text that is not UTF-8, JSON nested
  deeper than ``traces.readers.MAX_JSON_DEPTH`` or with a repeated key are bad rows too; a
  header that repeats a column is refused.
- ``max_requests=N`` reads only until N requests are kept (bad and filtered rows do not
  count) and leaves the rest of the file unread: the first N good rows of the file, sorted,
  which is the first N arrivals when the file is in arrival order (``LoadReport.read_to_end``
  says whether the whole file was read).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from traces.bundled import resolve_trace
from traces.formats import (FORMATS, TIME_UNITS, ColumnMapping, container_of, column_spec,
                            detect_format)
from traces.readers import RawRows, TraceFormatError, open_rows
from traces.trace import Trace

__all__ = ["FORMATS", "ColumnMapping", "LoadReport", "TraceFormatError", "detect_format",
           "load_trace"]

#: most tokens one prompt or output may have (about 8x the longest context window served)
MAX_TOKENS = 10_000_000
#: largest request id: ids are read as float64, which holds integers exactly up to 2**53
MAX_REQUEST_ID = 2**53 - 1
#: tokens per ``hash_ids`` block in Mooncake's traces ("The block size is 512 tokens":
#: FAST25-release/README.md of github.com/kvcache-ai/Mooncake; each of the 12,031 rows of its
#: conversation_trace.jsonl has ceil(input_length / 512) hash ids)
MOONCAKE_BLOCK_SIZE = 512
#: the coarsest float64 spacing an arrival instant may have at its magnitude (1 us)
ARRIVAL_RESOLUTION_S = 1e-6


#: columns read as the requests' tenant (names compared ignoring case, spaces, underscores)
TENANT_COLUMNS = ("tenant", "tenantid", "customer", "customerid", "applicationid", "app")


@dataclass(frozen=True)
class LoadReport:
    """What a load read, kept and dropped. ``num_rows`` counts data rows (no header)."""

    path: str
    format: str
    num_rows: int
    num_loaded: int
    num_skipped: int
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    num_filtered: int = 0
    num_reordered: int = 0
    origin: str = ""
    notes: tuple[str, ...] = ()
    read_to_end: bool = True

    def describe(self) -> str:
        """Always says how many rows were skipped, sorted and filtered, even when none."""
        read = "" if self.read_to_end else " read (the rest of the file was not needed)"
        lines = [f"{self.path} ({self.format}): {self.num_loaded} of {self.num_rows} rows"
                 f"{read} loaded; first arrival ({self.origin}) re-based to 0.0 s",
                 f"  {self.num_skipped} bad rows skipped, {self.num_reordered} rows out of "
                 f"arrival order sorted, {self.num_filtered} rows left out by filters"]
        lines += [f"    {n} x {reason}" for reason, n in sorted(self.skipped_reasons.items())]
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "notes": list(self.notes)}


def load_trace(path, format: str | None = None, *, skip_bad: bool = False,
               mapping: "ColumnMapping | dict | None" = None,
               filters: dict[str, Any] | None = None,
               max_requests: int | None = None) -> tuple[Trace, LoadReport]:
    """Read ``path`` as ``format`` (None: detect) into a re-based ``Trace`` and its report;
    with ``max_requests``, stop reading once that many requests are kept."""
    path = resolve_trace(path)          # a bare name may be a bundled trace (traces/data/)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    fmt = detect_format(path) if format is None else format
    if fmt not in FORMATS:
        raise ValueError(f"trace format {fmt!r} is not one of {list(FORMATS)}")
    if mapping is not None and fmt not in ("csv", "jsonl", "parquet"):
        raise ValueError(f"mapping applies to csv, jsonl and parquet traces, not {fmt!r}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    mapping = ColumnMapping.of(mapping)
    blocks, parsed, tally = [], [], Tally()
    for raw, values, _bad in read_blocks(path, fmt, tally, skip_bad=skip_bad, mapping=mapping,
                                         filters=filters, max_requests=max_requests):
        blocks.append(raw)
        parsed.append(values)
    if not tally.num_kept:
        raise ValueError(f"{path}: no requests left to load ({len(tally.problems)} bad rows, "
                         f"{tally.num_filtered} filtered out of {tally.num_rows})")
    raw = RawRows.concat(blocks)
    raw.num_rows = tally.num_rows
    values = {k: np.concatenate([v[k] for v in parsed]) for k in parsed[0]}
    problems = sorted(tally.problems, key=lambda p: p[0])
    return _assemble(path, fmt, raw, values, problems, tally.num_filtered, tally.spec,
                     tally.read_to_end)


@dataclass
class Tally:
    """What ``read_blocks`` has read so far: rows, kept and filtered counts, problems (line,
    field, why, detail; kept only while ``keep_problems``), the column spec, the keys seen."""

    num_rows: int = 0
    num_kept: int = 0
    num_filtered: int = 0
    num_bad: int = 0
    reasons: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    keep_problems: bool = True
    spec: ColumnMapping | None = None
    columns: dict = field(default_factory=dict)
    read_to_end: bool = False

    def count(self, problems: list) -> None:
        """Count each bad line once, by its first problem (``LoadReport.skipped_reasons``)."""
        seen: set[int] = set()
        for line, name, why, _ in sorted(problems, key=lambda p: p[0]):
            if line not in seen:
                seen.add(line)
                self.reasons[f"{name}: {why}"] = self.reasons.get(f"{name}: {why}", 0) + 1
        self.num_bad += len(seen)
        if self.keep_problems:
            self.problems += problems


def read_blocks(path: Path, fmt: str, tally: Tally, *, skip_bad: bool = False,
                mapping: ColumnMapping = ColumnMapping(), filters: dict | None = None,
                max_requests: int | None = None, block_rows: int | None = None):
    """The rows of ``path`` a block at a time (``block_rows``; None: all at once), filtered and
    parsed: ``(raw, values, problems)`` per block, rows with problems still in. Raises the
    first problem met unless ``skip_bad``; ``tally`` counts as it goes."""
    with open_rows(path, container_of(fmt)) as rows:
        while not rows.exhausted and (max_requests is None or tally.num_kept < max_requests):
            want = None if max_requests is None else max_requests - tally.num_kept
            if block_rows is not None:
                want = block_rows if want is None else min(want, block_rows)
            raw = rows.read(want)
            tally.num_rows += raw.num_rows
            tally.columns.update(dict.fromkeys(raw.columns))
            problems = list(raw.bad)
            if len(raw.lines) == 0:          # nothing but bad rows (or none) in this block
                tally.count(problems)
                _raise_first(problems, skip_bad, path, raw.unit)
                continue
            tally.spec = tally.spec or column_spec(fmt, raw, mapping, path)
            raw, filtered = _apply_filters(raw, filters or {}, path)
            values, bad = _convert(raw, tally.spec, path, fmt)
            problems += bad
            tally.count(problems)
            _raise_first(problems, skip_bad, path, raw.unit)
            tally.num_kept += len(raw.lines) - len({line for line, *_ in bad})
            tally.num_filtered += filtered
            yield raw, values, problems
        tally.read_to_end = rows.exhausted


def _raise_first(problems: list, skip_bad: bool, path: Path, unit: str) -> None:
    """Raise the earliest problem found so far, unless bad rows are skipped."""
    if problems and not skip_bad:
        line, name, why, detail = min(problems, key=lambda p: p[0])
        raise TraceFormatError(path, f"{unit} {line}", name, f"{why}: {detail}")


def _apply_filters(raw: RawRows, filters: dict[str, Any], path: Path) -> tuple[RawRows, int]:
    keep = np.ones(len(raw.lines), dtype=bool)
    by_key = {norm_column_name(k): k for k in raw.columns}
    for key, wanted in filters.items():
        column = by_key.get(norm_column_name(key))
        if column is None:
            raise ValueError(f"{path}: filter column {key!r} is not among {sorted(raw.columns)}")
        options = [wanted] if isinstance(wanted, (str, int, float)) else list(wanted)
        allowed = {str(v) for v in options}
        keep &= np.array([str(v) in allowed for v in raw.columns[column]], dtype=bool)
    return raw.take(keep), int((~keep).sum())


def norm_column_name(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "")


def _convert(raw: RawRows, spec: ColumnMapping, path: Path, fmt: str):
    """Parse each mapped column; return values and (line, field, why, detail) problems."""
    values, problems = {}, []
    for name, column in spec.fields():
        source = raw.columns[column]
        if name == "arrival_at":
            parsed, why = _arrivals(source, spec.time_unit)
        else:
            parsed, why = _integers(source, *((0, MAX_REQUEST_ID) if name == "request_id"
                                              else (1, MAX_TOKENS)))
        for i in np.flatnonzero(why != ""):
            problems.append((int(raw.lines[i]), column, str(why[i]), repr(source[i])))
        values[name] = parsed
    if fmt == "mooncake" and "hash_ids" in raw.columns:
        for i, ids in enumerate(raw.columns["hash_ids"]):
            if ids is not None and not (isinstance(ids, list) and all(
                    isinstance(h, int) and not isinstance(h, bool) for h in ids)):
                problems.append((int(raw.lines[i]), "hash_ids", "not a list of integers",
                                 repr(ids)[:60]))
    return values, problems


def _numbers(source: np.ndarray) -> np.ndarray:
    import pandas as pd

    parsed = pd.to_numeric(pd.Series(source, dtype=object), errors="coerce")
    numbers = parsed.to_numpy(float, copy=True)
    is_bool = np.array([isinstance(v, (bool, np.bool_)) for v in source], dtype=bool)
    numbers[is_bool] = np.nan
    return numbers


def _integers(source: np.ndarray, minimum: int,
              maximum: int) -> tuple[np.ndarray, np.ndarray]:
    numbers = _numbers(source)
    why = np.full(len(source), "", dtype=object)
    with np.errstate(invalid="ignore"):
        why[numbers < minimum] = f"must be >= {minimum}"
        why[numbers > maximum] = f"must be <= {maximum}"
        why[np.isfinite(numbers) & (numbers != np.round(numbers))] = "not an integer"
    why[~np.isfinite(numbers)] = "not a number"
    return np.where(why == "", numbers, 0).astype(np.int64), why


def _arrivals(source: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrival instants as int64 nanoseconds (date-time) or floats in the file's own unit
    (re-based before scaling to seconds, which keeps epoch-millisecond gaps exact), and
    problems."""
    why = np.full(len(source), "", dtype=object)
    if unit == "datetime":
        import pandas as pd

        text = pd.Series([v if isinstance(v, str) else None for v in source], dtype=object)
        stamps = pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True)
        bad = stamps.isna().to_numpy()
        why[bad] = "not an ISO 8601 date-time"
        ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
        return np.where(bad, 0, ns), why
    numbers = _numbers(source)
    scale = TIME_UNITS[unit]
    with np.errstate(invalid="ignore"):
        why[numbers < 0] = "must be >= 0"
        why[np.spacing(np.abs(numbers)) * scale > ARRIVAL_RESOLUTION_S] = (
            f"too large: float64 cannot keep {ARRIVAL_RESOLUTION_S:g} s resolution there")
    why[~np.isfinite(numbers)] = "not a finite number"
    return np.where(why == "", numbers, 0.0), why


def _assemble(path: Path, fmt: str, raw: RawRows, values: dict, problems: list,
              num_filtered: int, spec: ColumnMapping,
              read_to_end: bool) -> tuple[Trace, LoadReport]:
    bad_lines = {line for line, *_ in problems}
    keep = np.array([line not in bad_lines for line in raw.lines], dtype=bool)
    if not keep.any():
        raise ValueError(f"{path}: no requests left to load ({len(problems)} bad rows, "
                         f"{num_filtered} filtered out of {raw.num_rows})")
    arrivals = values["arrival_at"][keep]
    order = np.argsort(arrivals, kind="stable")
    num_reordered = int(np.sum(arrivals < np.maximum.accumulate(arrivals)))
    origin_value = arrivals[order[0]]
    if spec.time_unit == "datetime":
        seconds = (arrivals - origin_value) / 1e9
        origin = str(np.datetime64(int(origin_value), "ns")) + "Z"
    else:
        scale = TIME_UNITS[spec.time_unit]
        seconds = (arrivals - origin_value) * scale
        origin = f"{origin_value * scale:.9g} s"
    ids = values["request_id"][keep] if "request_id" in values else raw.index[keep]
    check_unique(path, raw.unit, ids, raw.lines[keep], spec.request_id)
    tenant = tenants_of(raw)
    hashes = hashes_of(raw, fmt)
    trace = Trace(seconds[order], values["num_prompt_tokens"][keep][order],
                  values["num_output_tokens"][keep][order], ids[order], name=path.stem,
                  tenant=None if tenant is None else tenant[keep][order],
                  **({} if hashes is None else {"hash_ids": hashes[keep][order],
                                               "hash_block_size": MOONCAKE_BLOCK_SIZE}))
    reasons: dict[str, int] = {}
    seen: set[int] = set()
    for line, name, why, _ in problems:
        if line not in seen:
            seen.add(line)
            reasons[f"{name}: {why}"] = reasons.get(f"{name}: {why}", 0) + 1
    notes = (f"hash_ids carried: prefix blocks of {MOONCAKE_BLOCK_SIZE} tokens",) \
        if hashes is not None else ()
    report = LoadReport(str(path), fmt, raw.num_rows, len(trace), len(seen), reasons,
                        num_filtered, num_reordered, origin, notes, read_to_end)
    return trace, report


def hashes_of(raw: RawRows, fmt: str) -> np.ndarray | None:
    """Each row's ``hash_ids`` as a tuple (a row without the key: no hashes), for a Mooncake
    trace that has the column; else None."""
    if fmt != "mooncake" or "hash_ids" not in raw.columns:
        return None
    hashes = np.empty(len(raw.lines), dtype=object)
    hashes[:] = [tuple(ids) if isinstance(ids, list) else () for ids in raw.columns["hash_ids"]]
    return hashes


def tenants_of(raw: RawRows) -> np.ndarray | None:
    """The tenant of each row, as text, from the first ``TENANT_COLUMNS`` column present."""
    by_key = {norm_column_name(k): k for k in raw.columns}
    column = next((by_key[k] for k in TENANT_COLUMNS if k in by_key), None)
    if column is None:
        return None
    values = raw.columns[column]
    return np.array(["" if v is None or (isinstance(v, float) and v != v) else
                     str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
                     for v in values], dtype=object)


def check_unique(path: Path, unit: str, ids: np.ndarray, lines: np.ndarray,
                  column: str | None) -> None:
    _, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if np.any(counts > 1):
        dup = ids[first[np.flatnonzero(counts > 1)[0]]]
        line = int(lines[np.flatnonzero(ids == dup)[1]])
        raise TraceFormatError(path, f"{unit} {line}", column or "request_id",
                               f"duplicate request id {int(dup)}")
