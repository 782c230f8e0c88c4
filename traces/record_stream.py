"""Records written as they come: a Parquet dataset of row groups, in bounded memory.

``RecordWriter(path)`` makes ``path`` a directory of Parquet files (``part-00000.parquet``,
...), each a run of row groups of ``rows_per_group`` records; ``pandas.read_parquet(path)``,
``pyarrow.dataset.dataset(path)`` and ``traces.schema.read_records(path)`` read it as one
table. Rows come in the order they are appended (a simulator appends requests as they end),
with the column types of ``traces.schema.write_records``, so the records sorted by
``request_id`` are the same table a run held in memory would write. ``on_group`` sees each
row group's records DataFrame (a streaming summary, ``traces.aggregate``); with ``path``
None the writer only groups records for it and writes nothing.

Interrupted writes: the file being written is hidden (``.part-00003.parquet``, which readers
skip) until it is complete, and ``_INCOMPLETE`` stands in the directory from the start until
``close()``. A run stopped by an exception closes what it had (its buffered rows too) and
leaves ``_INCOMPLETE`` naming the error; a killed one leaves it as it was. Either way the
complete files are a readable dataset, and ``read_records`` refuses it with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from traces.schema import INCOMPLETE, check_complete, clear_records, records_frame  # noqa: F401

#: records per row group and row groups per file: 65,536 records are ~6 MB in memory
ROWS_PER_GROUP = 65_536
GROUPS_PER_FILE = 16


class RecordWriter:
    """Append record columns; a row group is written whenever ``rows_per_group`` are buffered.

    Use as a context manager (or call ``close``): leaving on an exception keeps the records
    written so far readable and marks the dataset incomplete."""

    def __init__(self, path, rows_per_group: int = ROWS_PER_GROUP,
                 groups_per_file: int = GROUPS_PER_FILE, on_group=None):
        if rows_per_group < 1 or groups_per_file < 1:
            raise ValueError(f"rows_per_group and groups_per_file must be >= 1, got "
                             f"{rows_per_group} and {groups_per_file}")
        self.on_group = on_group           # each row group's records DataFrame, or None
        self.path = None if path is None else Path(path)
        self.rows_per_group, self.groups_per_file = rows_per_group, groups_per_file
        self.num_rows = 0                  # records written to row groups so far
        self._buffer: list[dict] = []      # appended column chunks not yet written
        self._buffered = 0
        self._writer = None                # pyarrow.parquet.ParquetWriter of the open file
        self._groups = 0                   # row groups in the open file
        self._files = 0
        self.closed = False
        if self.path is not None:
            clear_records(self.path)
            self.path.mkdir(parents=True)
            (self.path / INCOMPLETE).write_text("the run writing these records has not ended\n")

    def append(self, columns: dict) -> None:
        """Buffer record columns (``traces.schema.RECORD_COLUMNS``, equal lengths)."""
        k = len(columns["request_id"])
        if k == 0:
            return
        self._buffer.append(columns)
        self._buffered += k
        while self._buffered >= self.rows_per_group:
            self._write_group(self.rows_per_group)

    def close(self, error: BaseException | None = None) -> None:
        """Write what is buffered and close the dataset: complete, or marked incomplete with
        ``error``."""
        if self.closed:
            return
        self.closed = True
        try:
            while self._buffered:
                self._write_group(min(self._buffered, self.rows_per_group))
        finally:
            self._close_file()
            if self.path is None:
                pass
            elif error is None:
                (self.path / INCOMPLETE).unlink()
            else:
                (self.path / INCOMPLETE).write_text(
                    f"the run stopped after {self.num_rows:,} records: "
                    f"{type(error).__name__}: {error}\n")

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(error)

    def _write_group(self, k: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        frame = records_frame(self._take(k))
        self.num_rows += k
        if self.on_group is not None:
            self.on_group(frame)
        if self.path is None:
            return
        table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._hidden(), table.schema, compression="zstd")
        self._writer.write_table(table, row_group_size=k)
        self._groups += 1
        if self._groups == self.groups_per_file:
            self._close_file()

    def _take(self, k: int) -> dict:
        """The first ``k`` buffered rows as one set of columns."""
        parts, taken = [], 0
        while taken < k:
            head = self._buffer[0]
            m = len(head["request_id"])
            if taken + m <= k:
                parts.append(self._buffer.pop(0))
                taken += m
            else:
                cut = k - taken
                parts.append({c: v[:cut] for c, v in head.items()})
                self._buffer[0] = {c: v[cut:] for c, v in head.items()}
                taken = k
        self._buffered -= k
        return {c: np.concatenate([np.asarray(p[c]) for p in parts]) for c in parts[0]}

    def _hidden(self) -> Path:
        return self.path / f".part-{self._files:05d}.parquet"

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        self._hidden().rename(self.path / f"part-{self._files:05d}.parquet")
        self._files += 1
        self._groups = 0
