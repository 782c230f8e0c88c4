"""Row readers for ``traces.loaders``: a trace file read a block of rows at a time.

Each reader opens one container (CSV, JSON lines, Parquet) and hands out ``RawRows`` blocks
with ``read(n)``: at most ``n`` more data rows (all the rest for ``None``), as object columns
with the source line (or Parquet row) of each. Nothing past the rows asked for is parsed, so
a loader that needs 1,000 requests of a 1,000,000-row file stops after about 1,000 rows.

Problems that belong to one row -- text that is not UTF-8, a wrong number of CSV fields, a
line that is not a JSON object, JSON nested deeper than ``MAX_JSON_DEPTH`` or with a repeated
key -- are returned with the block as ``(line, field, why, detail)`` for the loader to raise or
skip. Problems of the whole file (an empty file, a header that is not UTF-8 or repeats a
column) raise ``TraceFormatError`` at once.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: deepest JSON nesting a trace record may have (a record with a list of hash ids has 2)
MAX_JSON_DEPTH = 16


class TraceFormatError(ValueError):
    """A row of a trace file is malformed. ``where`` is ``line N`` or ``row N``."""

    def __init__(self, path, where: str, field_name: str, problem: str):
        self.path, self.where, self.field, self.problem = str(path), where, field_name, problem
        super().__init__(f"{path}: {where}: field {field_name!r}: {problem}")


@dataclass
class RawRows:
    """Rows as read: object columns, their source lines and data-row indices."""

    columns: dict[str, np.ndarray]
    lines: np.ndarray           # [n] int64, 1-based line (or row) of each row
    index: np.ndarray           # [n] int64, 0-based data-row index
    unit: str                   # "line" or "row"
    num_rows: int               # data rows read, good or bad
    bad: list[tuple[int, str, str, str]] = field(default_factory=list)  # (line, field, why, detail)

    def take(self, keep: np.ndarray) -> "RawRows":
        return RawRows({k: v[keep] for k, v in self.columns.items()}, self.lines[keep],
                       self.index[keep], self.unit, self.num_rows, self.bad)

    @classmethod
    def concat(cls, blocks: list["RawRows"]) -> "RawRows":
        names = dict.fromkeys(k for b in blocks for k in b.columns)
        columns = {k: np.concatenate([b.columns[k] if k in b.columns else _nones(len(b.lines))
                                      for b in blocks]) for k in names}
        return cls(columns, np.concatenate([b.lines for b in blocks]),
                   np.concatenate([b.index for b in blocks]), blocks[0].unit,
                   sum(b.num_rows for b in blocks), [p for b in blocks for p in b.bad])


def open_rows(path: Path, container: str):
    """A reader of ``path`` as ``"csv"``, ``"jsonl"`` or ``"parquet"``; close it when done."""
    return {"csv": CsvRows, "jsonl": JsonlRows, "parquet": ParquetRows}[container](path)


def first_line(path: Path) -> str:
    """The first non-blank line of a text file; a line that is not UTF-8 is refused."""
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        first = next((line for line in f if line.strip()), "")
    if not _is_utf8(first):
        raise TraceFormatError(path, "line 1", "text", "not UTF-8 text (is this a trace file?)")
    return first


class _Reader:
    unit = "line"
    exhausted = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()


class CsvRows(_Reader):
    """A CSV file with a header row; blank lines are not rows."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, newline="", encoding="utf-8-sig", errors="surrogateescape")
        self._reader = csv.reader(self._file)
        try:
            header = next(self._reader, None)
        except csv.Error as exc:
            self.close()
            raise TraceFormatError(path, "line 1", "header", f"unreadable CSV: {exc}") from None
        if not header:
            self.close()
            raise TraceFormatError(path, "line 1", "header", "file is empty")
        problem = _header_problem(header)
        if problem:
            self.close()
            raise TraceFormatError(path, "line 1", *problem)
        self.header, self._n = header, 0

    def read(self, limit: int | None) -> RawRows:
        rows, lines, index, bad, n0 = [], [], [], [], self._n
        width = len(self.header)
        while limit is None or self._n - n0 < limit:
            try:
                row = next(self._reader, None)
            except csv.Error as exc:
                bad.append((self._reader.line_num, "row", "unreadable CSV", str(exc)[:60]))
                self._n += 1
                continue
            if row is None:
                self.exhausted = True
                break
            if not row:
                continue
            if not _is_utf8("".join(row)):
                bad.append((self._reader.line_num, "text", "not UTF-8", _shown(",".join(row))))
            elif len(row) != width:
                bad.append((self._reader.line_num, "row", "wrong number of fields",
                            f"expected {width}, got {len(row)}"))
            else:
                rows.append(row)
                lines.append(self._reader.line_num)
                index.append(self._n)
            self._n += 1
        table = np.array(rows, dtype=object).reshape(len(rows), width)
        columns = {name: table[:, j] for j, name in enumerate(self.header)}
        return RawRows(columns, np.array(lines, np.int64), np.array(index, np.int64), "line",
                       self._n - n0, bad)


class JsonlRows(_Reader):
    """One JSON object per line; the columns are every key seen so far."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, encoding="utf-8-sig", errors="surrogateescape")
        self._lineno = self._n = 0
        self._keys: dict[str, None] = {}

    def read(self, limit: int | None) -> RawRows:
        records, lines, index, bad, n0 = [], [], [], [], self._n
        while limit is None or self._n - n0 < limit:
            text = self._file.readline()
            if not text:
                self.exhausted = True
                break
            self._lineno += 1
            if not text.strip():
                continue
            record, problem = _json_record(text)
            if problem is None:
                records.append(record)
                lines.append(self._lineno)
                index.append(self._n)
            else:
                bad.append((self._lineno, *problem))
            self._n += 1
        self._keys.update(dict.fromkeys(k for record in records for k in record))
        columns = {k: np.array([r.get(k) for r in records] + [None], dtype=object)[:-1]
                   for k in self._keys}
        return RawRows(columns, np.array(lines, np.int64), np.array(index, np.int64), "line",
                       self._n - n0, bad)


class ParquetRows(_Reader):
    """A Parquet file, read a record batch at a time."""

    unit = "row"

    def __init__(self, path: Path, batch_rows: int = 65_536):
        import pyarrow.parquet as pq

        self.path = path
        self._file = pq.ParquetFile(path)
        names = self._file.schema_arrow.names
        problem = _header_problem(names)
        if problem:
            raise TraceFormatError(path, "row 0", *problem)
        self.header = names
        self._batches = self._file.iter_batches(batch_size=batch_rows)
        self._pending, self._n = None, 0

    def read(self, limit: int | None) -> RawRows:
        parts, got = [], 0
        while limit is None or got < limit:
            if self._pending is None:
                self._pending = next(self._batches, None)
                if self._pending is None:
                    self.exhausted = True
                    break
            want = len(self._pending) if limit is None else min(limit - got,
                                                                 len(self._pending))
            parts.append(self._pending.slice(0, want))
            self._pending = self._pending.slice(want) if want < len(self._pending) else None
            got += want
        columns = {name: np.concatenate([p.column(j).to_pandas().to_numpy(dtype=object)
                                         for p in parts]) if parts else _nones(0)
                   for j, name in enumerate(self.header)}
        index = np.arange(self._n, self._n + got, dtype=np.int64)
        self._n += got
        return RawRows(columns, index + 1, index, "row", got)

    def close(self) -> None:
        self._file.close()


def _header_problem(names) -> tuple[str, str] | None:
    for name in names:
        if not _is_utf8(name):
            return "header", f"column name {_shown(name)} is not UTF-8"
    seen = set()
    for name in names:
        if name in seen:
            return name, "duplicate column (each column must be named once)"
        seen.add(name)
    return None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    record = dict(pairs)
    if len(record) != len(pairs):
        keys = [k for k, _ in pairs]
        raise _DuplicateKey(next(k for k in keys if keys.count(k) > 1))
    return record


def _json_record(text: str):
    """(record, None) for a good line, else (None, (field, why, detail))."""
    if not _is_utf8(text):
        return None, ("text", "not UTF-8", _shown(text))
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        return None, ("json", "duplicate key", repr(exc.args[0])[:60])
    except RecursionError:
        return None, ("json", f"nested deeper than {MAX_JSON_DEPTH}", _shown(text))
    except ValueError as exc:
        return None, ("json", "not a JSON object", str(exc)[:60])
    if not isinstance(record, dict):
        return None, ("json", "not a JSON object", _shown(text))
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(record) > MAX_JSON_DEPTH:
        return None, ("json", f"nested deeper than {MAX_JSON_DEPTH}", _shown(text))
    return record, None


def _depth(value, level: int = 1) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    children = value.values() if isinstance(value, dict) else \
        value if isinstance(value, list) else ()
    return max((_depth(v, level + 1) for v in children
                if isinstance(v, (dict, list))), default=level)


def _is_utf8(text: str) -> bool:
    """False when decoding with ``surrogateescape`` met bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    return ascii(text.encode("utf-8", "surrogateescape")[:60])


def _nones(n: int) -> np.ndarray:
    return np.full(n, None, dtype=object)
