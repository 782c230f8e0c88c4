"""Trace loaders: the request logs users bring, read into a ``Trace`` and a ``LoadReport``.

Formats (``FORMATS``), detected from the header / first record or chosen with ``format=``:

=========  ===============================================  ============  ======================
format     arrival, prompt, output columns                   arrival unit  notes
=========  ===============================================  ============  ======================
azure      TIMESTAMP, ContextTokens, GeneratedTokens         date-time     Azure LLM 2023 / 2024
burstgpt   Timestamp, Request tokens, Response tokens        seconds       Model, Log Type filter
mooncake   timestamp, input_length, output_length (JSONL)    milliseconds  hash_ids checked
splitwise  arrival_timestamp, prompt_size, token_size        seconds       Splitwise simulator
           (or Vidur's arrived_at, num_prefill_tokens, num_decode_tokens)
csv        ``mapping`` (default arrival_at, num_prompt_tokens, num_output_tokens; any unit)
jsonl      as csv, one JSON object per line
parquet    as csv
=========  ===============================================  ============  ======================

The contract every format keeps:

- Arrival instants are **re-based**: the earliest loaded request arrives at 0.0 s. The
  original first timestamp is kept in ``LoadReport.origin``.
- ``request_id`` is the row's 0-based index among the file's data rows (header and blank
  lines not counted), unless ``mapping`` names an id column; a record leads back to its row.
- Rows out of arrival order are sorted (stably) and counted in ``LoadReport.num_reordered``.
- A malformed row raises ``TraceFormatError`` naming file, line (``row`` for Parquet) and
  field. With ``skip_bad=True`` it is dropped and counted by reason. Values are never
  clipped or rewritten: a zero-token response is a bad row, not a one-token one.
- ``filters={column: value or values}`` keeps only matching rows (counted as filtered, not
  as bad). Column names match ignoring case, spaces and underscores (``log_type``).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from traces.bundled import resolve_trace
from traces.trace import Trace

FORMATS = ("azure", "burstgpt", "mooncake", "splitwise", "csv", "jsonl", "parquet")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "datetime": None}


class TraceFormatError(ValueError):
    """A row of a trace file is malformed. ``where`` is ``line N`` or ``row N``."""

    def __init__(self, path, where: str, field_name: str, problem: str):
        self.path, self.where, self.field, self.problem = str(path), where, field_name, problem
        super().__init__(f"{path}: {where}: field {field_name!r}: {problem}")


@dataclass(frozen=True)
class ColumnMapping:
    """Which source columns hold a request's arrival, lengths and (optionally) id."""

    arrival_at: str = "arrival_at"
    num_prompt_tokens: str = "num_prompt_tokens"
    num_output_tokens: str = "num_output_tokens"
    request_id: str | None = None
    time_unit: str = "s"

    def __post_init__(self) -> None:
        if self.time_unit not in TIME_UNITS:
            raise ValueError(f"time_unit {self.time_unit!r} is not one of {list(TIME_UNITS)}")

    @classmethod
    def of(cls, value: "ColumnMapping | dict | None") -> "ColumnMapping":
        if value is None or isinstance(value, ColumnMapping):
            return value or cls()
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(value) - allowed
        if unknown:
            raise ValueError(f"mapping keys {sorted(unknown)} are not among {sorted(allowed)}")
        return cls(**value)

    def fields(self) -> list[tuple[str, str]]:
        """(canonical name, source column) pairs, in validation order."""
        pairs = [("arrival_at", self.arrival_at), ("num_prompt_tokens", self.num_prompt_tokens),
                 ("num_output_tokens", self.num_output_tokens)]
        return pairs + ([("request_id", self.request_id)] if self.request_id else [])


_SPLITWISE = ColumnMapping("arrival_timestamp", "prompt_size", "token_size")
_VIDUR = ColumnMapping("arrived_at", "num_prefill_tokens", "num_decode_tokens")
_SPECS = {
    "azure": ColumnMapping("TIMESTAMP", "ContextTokens", "GeneratedTokens", time_unit="datetime"),
    "burstgpt": ColumnMapping("Timestamp", "Request tokens", "Response tokens"),
    "mooncake": ColumnMapping("timestamp", "input_length", "output_length", time_unit="ms"),
}


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

    def describe(self) -> str:
        lines = [f"{self.path} ({self.format}): {self.num_loaded} of {self.num_rows} rows loaded; "
                 f"first arrival ({self.origin}) re-based to 0.0 s"]
        if self.num_filtered:
            lines.append(f"  {self.num_filtered} rows left out by filters")
        if self.num_skipped:
            lines.append(f"  {self.num_skipped} bad rows skipped:")
            lines += [f"    {n} x {reason}" for reason, n in sorted(self.skipped_reasons.items())]
        if self.num_reordered:
            lines.append(f"  {self.num_reordered} rows were out of arrival order and were sorted")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class _Raw:
    """Rows as read: object columns, their source lines and data-row indices."""

    columns: dict[str, np.ndarray]
    lines: np.ndarray           # [n] int64, 1-based line (or row) of each row
    index: np.ndarray           # [n] int64, 0-based data-row index
    unit: str                   # "line" or "row"
    num_rows: int
    bad: list[tuple[int, str, str, str]] = field(default_factory=list)  # (line, field, why, detail)

    def take(self, keep: np.ndarray) -> "_Raw":
        return _Raw({k: v[keep] for k, v in self.columns.items()}, self.lines[keep],
                    self.index[keep], self.unit, self.num_rows, self.bad)


def load_trace(path, format: str | None = None, *, skip_bad: bool = False,
               mapping: "ColumnMapping | dict | None" = None,
               filters: dict[str, Any] | None = None) -> tuple[Trace, LoadReport]:
    """Read ``path`` as ``format`` (None: detect) into a re-based ``Trace`` and its report."""
    path = resolve_trace(path)          # a bare name may be a bundled trace (traces/data/)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    fmt = detect_format(path) if format is None else format
    if fmt not in FORMATS:
        raise ValueError(f"trace format {fmt!r} is not one of {list(FORMATS)}")
    if mapping is not None and fmt not in ("csv", "jsonl", "parquet"):
        raise ValueError(f"mapping applies to csv, jsonl and parquet traces, not {fmt!r}")
    raw = _READERS[_container(fmt)](path)
    spec = _spec(fmt, raw, ColumnMapping.of(mapping), path)
    raw, num_filtered = _apply_filters(raw, filters or {}, path)
    values, bad = _convert(raw, spec, path, fmt)
    problems = sorted(raw.bad + bad, key=lambda p: p[0])
    if problems and not skip_bad:
        line, name, why, detail = problems[0]
        raise TraceFormatError(path, f"{raw.unit} {line}", name, f"{why}: {detail}")
    return _assemble(path, fmt, raw, values, problems, num_filtered, spec)


def detect_format(path) -> str:
    """The format of ``path`` from its suffix and header (or first JSON record)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return _by_columns(pq.read_schema(path).names) or "parquet"
    with open(path, newline="", encoding="utf-8-sig") as f:
        first = next((line for line in f if line.strip()), "")
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson") or first.lstrip().startswith("{"):
        try:
            keys = list(json.loads(first))
        except (ValueError, TypeError):
            raise TraceFormatError(path, "line 1", "json", "first record is not a JSON object")
        return "mooncake" if _has(keys, _SPECS["mooncake"]) else "jsonl"
    header = next(csv.reader([first]), [])
    return _by_columns(header) or "csv"


def _by_columns(columns) -> str | None:
    for name in ("azure", "burstgpt", "mooncake"):
        if _has(columns, _SPECS[name]):
            return name
    if _has(columns, _SPLITWISE) or _has(columns, _VIDUR):
        return "splitwise"
    return None


def _has(columns, spec: ColumnMapping) -> bool:
    return all(col in columns for _, col in spec.fields())


def _container(fmt: str) -> str:
    return {"mooncake": "jsonl", "jsonl": "jsonl", "parquet": "parquet"}.get(fmt, "csv")


def _spec(fmt: str, raw: _Raw, mapping: ColumnMapping, path: Path) -> ColumnMapping:
    if fmt == "splitwise":
        spec = _VIDUR if _has(raw.columns, _VIDUR) else _SPLITWISE
    else:
        spec = _SPECS.get(fmt, mapping)
    missing = [col for _, col in spec.fields() if col not in raw.columns]
    if missing:
        hint = " (give mapping= to name the columns)" if fmt in ("csv", "jsonl", "parquet") else ""
        raise TraceFormatError(path, f"{raw.unit} 1", missing[0],
                               f"column missing; found {sorted(raw.columns)}{hint}")
    return spec


def _read_csv(path: Path) -> _Raw:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise TraceFormatError(path, "line 1", "header", "file is empty")
        rows, lines, index, bad, n = [], [], [], [], 0
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                bad.append((reader.line_num, "row", "wrong number of fields",
                            f"expected {len(header)}, got {len(row)}"))
            else:
                rows.append(row)
                lines.append(reader.line_num)
                index.append(n)
            n += 1
    table = np.array(rows, dtype=object).reshape(len(rows), len(header))
    columns = {name: table[:, j] for j, name in enumerate(header)}
    return _Raw(columns, np.array(lines, np.int64), np.array(index, np.int64), "line", n, bad)


def _read_jsonl(path: Path) -> _Raw:
    records, lines, index, bad, n = [], [], [], [], 0
    with open(path, encoding="utf-8-sig") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as exc:
                record = exc
            if isinstance(record, dict):
                records.append(record)
                lines.append(lineno)
                index.append(n)
            else:
                bad.append((lineno, "json", "not a JSON object", str(record)[:60]))
            n += 1
    keys = dict.fromkeys(k for record in records for k in record)
    columns = {k: np.array([r.get(k) for r in records] + [None], dtype=object)[:-1] for k in keys}
    return _Raw(columns, np.array(lines, np.int64), np.array(index, np.int64), "line", n, bad)


def _read_parquet(path: Path) -> _Raw:
    import pandas as pd

    frame = pd.read_parquet(path)
    n = len(frame)
    columns = {str(k): frame[k].to_numpy(dtype=object) for k in frame.columns}
    return _Raw(columns, np.arange(1, n + 1, dtype=np.int64), np.arange(n, dtype=np.int64),
                "row", n)


_READERS = {"csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}


def _apply_filters(raw: _Raw, filters: dict[str, Any], path: Path) -> tuple[_Raw, int]:
    keep = np.ones(len(raw.lines), dtype=bool)
    by_key = {_norm(k): k for k in raw.columns}
    for key, wanted in filters.items():
        column = by_key.get(_norm(key))
        if column is None:
            raise ValueError(f"{path}: filter column {key!r} is not among {sorted(raw.columns)}")
        options = [wanted] if isinstance(wanted, (str, int, float)) else list(wanted)
        allowed = {str(v) for v in options}
        keep &= np.array([str(v) in allowed for v in raw.columns[column]], dtype=bool)
    return raw.take(keep), int((~keep).sum())


def _norm(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "")


def _convert(raw: _Raw, spec: ColumnMapping, path: Path, fmt: str):
    """Parse each mapped column; return values and (line, field, why, detail) problems."""
    values, problems = {}, []
    for name, column in spec.fields():
        source = raw.columns[column]
        if name == "arrival_at":
            parsed, why = _arrivals(source, spec.time_unit)
        else:
            parsed, why = _integers(source, minimum=0 if name == "request_id" else 1)
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


def _integers(source: np.ndarray, minimum: int) -> tuple[np.ndarray, np.ndarray]:
    numbers = _numbers(source)
    why = np.full(len(source), "", dtype=object)
    with np.errstate(invalid="ignore"):
        why[numbers < minimum] = f"must be >= {minimum}"
        why[np.isfinite(numbers) & (numbers != np.round(numbers))] = "not an integer"
    why[~np.isfinite(numbers)] = "not a number"
    return np.where(why == "", numbers, 0).astype(np.int64), why


def _arrivals(source: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrival instants as int64 nanoseconds (date-time) or float seconds, and problems."""
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
    why[~np.isfinite(numbers)] = "not a finite number"
    return np.where(why == "", numbers * TIME_UNITS[unit], 0.0), why


def _assemble(path: Path, fmt: str, raw: _Raw, values: dict, problems: list,
              num_filtered: int, spec: ColumnMapping) -> tuple[Trace, LoadReport]:
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
        seconds = arrivals - origin_value
        origin = f"{origin_value:.9g} s"
    ids = values["request_id"][keep] if "request_id" in values else raw.index[keep]
    _check_unique(path, raw.unit, ids, raw.lines[keep], spec.request_id)
    trace = Trace(seconds[order], values["num_prompt_tokens"][keep][order],
                  values["num_output_tokens"][keep][order], ids[order], name=path.stem)
    reasons: dict[str, int] = {}
    seen: set[int] = set()
    for line, name, why, _ in problems:
        if line not in seen:
            seen.add(line)
            reasons[f"{name}: {why}"] = reasons.get(f"{name}: {why}", 0) + 1
    notes = ("hash_ids checked but not carried (the Trace has no prefix-hash column)",) \
        if fmt == "mooncake" and "hash_ids" in raw.columns else ()
    report = LoadReport(str(path), fmt, raw.num_rows, len(trace), len(seen), reasons,
                        num_filtered, num_reordered, origin, notes)
    return trace, report


def _check_unique(path: Path, unit: str, ids: np.ndarray, lines: np.ndarray,
                  column: str | None) -> None:
    _, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if np.any(counts > 1):
        dup = ids[first[np.flatnonzero(counts > 1)[0]]]
        line = int(lines[np.flatnonzero(ids == dup)[1]])
        raise TraceFormatError(path, f"{unit} {line}", column or "request_id",
                               f"duplicate request id {int(dup)}")
