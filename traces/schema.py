"""Requests in, records out: the schemas every mode shares.

A *trace* is a table of requests (arrival instant, prompt tokens, output tokens). A *run* of
any kind -- the simulator, the real mode, a replay against a live endpoint -- returns one
*record* per request: its instants, its final status and where it ran. Metrics
(``traces.metrics``) are pure functions of records, so every mode is measured the same way.

Conventions (see ``docs`` in README): instants end in ``_at`` and are seconds since the
start of the run; ``NaN`` means "never reached". Counts start with ``num_``.

Record columns, in order:

====================  =======  =========================================================
column                dtype    meaning
====================  =======  =========================================================
request_id            int64    id from the trace (unique within a run)
arrival_at            float64  a_r: the request reached the router
num_prompt_tokens     int64    prompt length
num_output_tokens     int64    output tokens asked for (n_r)
status                string   a ``Status`` value: ``ok`` or a named failure
prefill_instance      int64    index of the prefill instance, -1 if never placed
decode_instance       int64    index of the decode instance, -1 if never placed
prefill_start_at      float64  first prefill iteration containing the request began
prefill_end_at        float64  its KV cache and first token exist on the prefill side
transfer_start_at     float64  the decode side pulled the KV cache
transfer_end_at       float64  the KV cache landed in the decode instance's pool
first_token_at        float64  f_r: the first token reached the client
finished_at           float64  c_r: the last token reached the client (or the failure)
num_generated_tokens  int64    tokens delivered to the client
kv_bytes              int64    bytes of KV cache moved prefill -> decode (0 if none)
====================  =======  =========================================================

Optional columns (``OPTIONAL_COLUMNS``), present only where the trace carries them, after the
others: ``tenant`` (string), the customer or application that sent the request (a trace's
own column, e.g. Splitwise's ``application_id``, or a synthetic generator's customers);
``cell`` (int64), the router domain that served the request in a run of cells (``sim.runs.cells.run``).

A record's status is final: every request of a run ends in exactly one status.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable

import numpy as np


class Status(str, enum.Enum):
    """Final state of one request. Every status other than ``OK`` is a named failure."""

    OK = "ok"
    #: prompt + output KV can never fit any decode instance's KV capacity
    REJECTED_DECODE_CAPACITY = "rejected_decode_capacity"
    #: the prompt's KV cache can never fit any prefill instance's send buffer
    REJECTED_PREFILL_CAPACITY = "rejected_prefill_capacity"
    #: the prompt exceeds the prefill batch token budget or the model's context
    REJECTED_PROMPT_TOO_LONG = "rejected_prompt_too_long"
    #: the decode side could not allocate its receive buffer (e.g. NPU channel out of memory)
    FAILED_OUT_OF_MEMORY = "failed_out_of_memory"
    #: the KV transfer failed (dead peer, corrupted data, bad descriptor; in the simulator:
    #: every retry failed too, ``[faults]``)
    FAILED_TRANSFER = "failed_transfer"
    #: the instance holding the request was lost (simulator ``[faults] instance_loss``)
    FAILED_INSTANCE_LOST = "failed_instance_lost"
    #: the request did not finish within its deadline (real mode, replay)
    FAILED_TIMEOUT = "failed_timeout"
    #: any other error reported by a backend or endpoint
    FAILED_ERROR = "failed_error"
    #: a replayed stream ended early: no finish reason, fewer tokens than were forced, or the
    #: transfer broke mid-stream (the tokens that did arrive are counted)
    FAILED_TRUNCATED = "failed_truncated"
    #: the replay client itself ran out of a resource (open files, ports, memory), so the
    #: request says nothing about the server
    FAILED_CLIENT = "failed_client"
    #: the run ended (``--duration``) before the request finished
    UNFINISHED = "unfinished"


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace. ``num_output_tokens`` >= 1 (the first token counts)."""

    request_id: int
    arrival_at: float
    num_prompt_tokens: int
    num_output_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_at) or self.arrival_at < 0:
            raise ValueError(f"request {self.request_id}: arrival_at must be finite and >= 0, "
                             f"got {self.arrival_at}")
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_prompt_tokens must be >= 1, "
                             f"got {self.num_prompt_tokens}")
        if self.num_output_tokens < 1:
            raise ValueError(f"request {self.request_id}: num_output_tokens must be >= 1, "
                             f"got {self.num_output_tokens}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. Instants are ``NaN`` when never reached."""

    request_id: int
    arrival_at: float
    num_prompt_tokens: int
    num_output_tokens: int
    status: Status
    prefill_instance: int = -1
    decode_instance: int = -1
    prefill_start_at: float = math.nan
    prefill_end_at: float = math.nan
    transfer_start_at: float = math.nan
    transfer_end_at: float = math.nan
    first_token_at: float = math.nan
    finished_at: float = math.nan
    num_generated_tokens: int = 0
    kv_bytes: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival_at

    @property
    def tpot(self) -> float:
        """(c - f) / (n - 1); NaN for single-token requests (they meet any TPOT SLO)."""
        if self.num_generated_tokens <= 1:
            return math.nan
        return (self.finished_at - self.first_token_at) / (self.num_generated_tokens - 1)


RECORD_COLUMNS: dict[str, str] = {
    "request_id": "int64",
    "arrival_at": "float64",
    "num_prompt_tokens": "int64",
    "num_output_tokens": "int64",
    "status": "string",
    "prefill_instance": "int64",
    "decode_instance": "int64",
    "prefill_start_at": "float64",
    "prefill_end_at": "float64",
    "transfer_start_at": "float64",
    "transfer_end_at": "float64",
    "first_token_at": "float64",
    "finished_at": "float64",
    "num_generated_tokens": "int64",
    "kv_bytes": "int64",
}
OPTIONAL_COLUMNS: dict[str, str] = {"tenant": "string", "cell": "int64"}
INSTANT_COLUMNS = tuple(c for c in RECORD_COLUMNS if c.endswith("_at"))
STATUS_VALUES = tuple(s.value for s in Status)

assert tuple(RECORD_COLUMNS) == tuple(f.name for f in fields(RequestRecord))


def records_frame(columns: dict[str, Iterable]):
    """Build the canonical records DataFrame from column arrays (any order, all present)."""
    import pandas as pd

    missing = set(RECORD_COLUMNS) - set(columns)
    if missing:
        raise ValueError(f"records are missing columns {sorted(missing)}")
    frame = pd.DataFrame({name: np.asarray(columns[name]) for name in RECORD_COLUMNS})
    for name in OPTIONAL_COLUMNS:
        if columns.get(name) is not None:
            frame[name] = np.asarray(columns[name])
    return validate_records(frame)


def validate_records(frame):
    """Return ``frame`` with canonical dtypes; raise naming the column on a bad value."""
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"records are missing columns {missing}")
    optional = {k: v for k, v in OPTIONAL_COLUMNS.items() if k in frame.columns}
    frame = frame[list(RECORD_COLUMNS) + list(optional)].astype({**RECORD_COLUMNS, **optional})
    bad = ~frame["status"].isin(STATUS_VALUES)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(f"records row {row}: status {frame['status'].iloc[row]!r} is not one of "
                         f"{list(STATUS_VALUES)}")
    if frame["request_id"].duplicated().any():
        dup = frame["request_id"][frame["request_id"].duplicated()].iloc[0]
        raise ValueError(f"records: request_id {dup} appears more than once")
    return frame.reset_index(drop=True)


def records_from_list(records: Iterable[RequestRecord]):
    """DataFrame from ``RequestRecord`` objects."""
    rows = [asdict(r) for r in records]
    cols = {name: [row[name] for row in rows] for name in RECORD_COLUMNS}
    cols["status"] = [Status(s).value for s in cols["status"]]
    return records_frame(cols)


def iter_records(frame) -> Iterable[RequestRecord]:
    """Frozen ``RequestRecord`` objects from a records DataFrame."""
    for row in frame.itertuples(index=False):
        values = {k: v for k, v in row._asdict().items() if k not in OPTIONAL_COLUMNS}
        values["status"] = Status(values["status"])
        yield RequestRecord(**{k: (v.item() if hasattr(v, "item") else v)
                               for k, v in values.items()})


def write_records(frame, path: str | Path) -> Path:
    """Write records to ``.parquet`` or ``.csv`` (chosen by suffix). Deterministic bytes."""
    path = Path(path)
    frame = validate_records(frame)
    if path.is_dir():                      # a streamed run's dataset (traces.record_stream)
        clear_records(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(frame, preserve_index=False)
        table = table.replace_schema_metadata(None)
        pq.write_table(table, path, compression="zstd")
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False, float_format="%.9f", lineterminator="\n")
    else:
        raise ValueError(f"{path}: records are written as .parquet or .csv, got {path.suffix!r}")
    return path


def read_records(path: str | Path):
    """Read records written by ``write_records`` (or by any mode, or streamed as a dataset
    directory by ``traces.record_stream``) and validate them."""
    import pandas as pd

    path = Path(path)
    if path.suffix == ".parquet":
        if path.is_dir():                  # a dataset of row groups (traces.record_stream)
            check_complete(path)
        frame = pd.read_parquet(path)
    elif path.suffix == ".csv":
        frame = pd.read_csv(path, keep_default_na=True)
    else:
        raise ValueError(f"{path}: records are read from .parquet or .csv, got {path.suffix!r}")
    try:
        return validate_records(frame)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


#: stands in a streamed records dataset until its writer closes it (``traces.record_stream``)
INCOMPLETE = "_INCOMPLETE"


def clear_records(path) -> None:
    """Remove records written at ``path`` before (a file, or a dataset directory of them)."""
    import shutil

    path = Path(path)
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        stray = [n for n in names if not (n == INCOMPLETE or n.endswith(".parquet"))]
        if stray:
            raise ValueError(f"{path}: not a records dataset (holds {sorted(stray)[:3]}); "
                             f"refusing to replace it")
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def check_complete(path) -> None:
    """Raise naming the reason when the dataset at ``path`` was left incomplete."""
    marker = Path(path) / INCOMPLETE
    if marker.exists():
        raise ValueError(f"{path}: records are incomplete ({marker.read_text().strip()}); the "
                         f"complete files read with pyarrow.dataset.dataset({str(path)!r})")
