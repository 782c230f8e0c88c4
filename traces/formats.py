"""Trace formats: the columns each format reads, and a file's format detected from its header.

``FORMATS``, detected from the header / first record (``detect_format``) or chosen with
``format=`` (``traces.loaders`` reads them all, under one contract):

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

A format is a ``ColumnMapping`` (which columns hold a request's arrival, lengths and id, and the
arrival's unit) read from a container (``traces.readers``: CSV, JSON lines or Parquet rows).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from traces.readers import RawRows, TraceFormatError, first_line

FORMATS = ("azure", "burstgpt", "mooncake", "splitwise", "csv", "jsonl", "parquet")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "datetime": None}


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

    @classmethod
    def parse(cls, text: str) -> "ColumnMapping":
        """``--columns`` text: ``arrival_at=ts,num_prompt_tokens=in,time_unit=ms`` (the keys
        are this class's fields; those not named keep their defaults)."""
        pairs = {}
        for item in (i.strip() for i in text.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ValueError(f"--columns takes FIELD=COLUMN pairs separated by commas "
                                 f"(fields {sorted(cls.__dataclass_fields__)}), got {item!r}")
            pairs[key.strip()] = value.strip()
        return cls.of(pairs)

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


def detect_format(path) -> str:
    """The format of ``path`` from its suffix and header (or first JSON record)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return _by_columns(pq.read_schema(path).names) or "parquet"
    first = first_line(path)
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson") or first.lstrip().startswith("{"):
        try:
            keys = list(json.loads(first))
        except (ValueError, TypeError, RecursionError):
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


def container_of(fmt: str) -> str:
    return {"mooncake": "jsonl", "jsonl": "jsonl", "parquet": "parquet"}.get(fmt, "csv")


def column_spec(fmt: str, raw: RawRows, mapping: ColumnMapping, path: Path) -> ColumnMapping:
    if fmt == "splitwise":
        spec = _VIDUR if _has(raw.columns, _VIDUR) else _SPLITWISE
    else:
        spec = _SPECS.get(fmt, mapping)
    missing = [col for _, col in spec.fields() if col not in raw.columns]
    if missing:
        hint = (" (name the columns: --columns arrival_at=COL,num_prompt_tokens=COL,"
                "num_output_tokens=COL[,time_unit=ms], or mapping= in Python)"
                if fmt in ("csv", "jsonl", "parquet") else "")
        raise TraceFormatError(path, f"{raw.unit} 1", missing[0],
                               f"column missing; found {sorted(raw.columns)}{hint}")
    return spec
