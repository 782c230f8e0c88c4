"""Streaming runs: per-request state only while a request is in the system, bounded memory.

A run of 10^7 requests does not fit the in-memory ``Ledger`` (~500 bytes a request, plus the
trace). ``StreamLedger`` offers the components the same columns, keyed by request position,
but holds only the requests loaded and not yet written out:

- Inputs (arrival, lengths, the router's verdict) are loaded a chunk at a time
  (``traces.chunks``) when the router first reads an arrival beyond those loaded.
- A request that ends (``fail``/``finish``) is written out at the second chunk load after its
  end: its record goes to a ``traces.record_stream.RecordWriter`` (a Parquet dataset, or
  nowhere) and every column forgets it. Components touch a request right after ending it
  (e.g. freeing its prefill buffer), never an event later; a read after the write-out raises.
- Each row group of records also feeds a ``traces.aggregate.RecordsAggregate``: the summary
  is computed from it (exact counts, sketched percentiles with a stated bound).

So memory is O(requests in flight + two chunks + one row group). Records come out in the
order requests end; sorted by ``request_id`` they equal the in-memory run's (tested), and a
cut run (``until``) is cut per record as ``Ledger.frame`` cuts it.

``hawk simulate`` streams runs of more than ``STREAM_MIN_REQUESTS`` requests (``--stream`` /
``--no-stream`` force it); smaller ones keep the exact in-memory path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.config import ConfigError
from sim.engine.ledger import INSTANTS, REJECTIONS
from sim.config.run_size import STREAM_MIN_REQUESTS, check_run_size
from traces.chunks import CHUNK_SIZE
from traces.record_stream import ROWS_PER_GROUP
from traces.schema import Status
from traces.trace import Trace

NAN = math.nan


@dataclass(frozen=True)
class Stream:
    """How a run streams: where its records go (a dataset directory, or None for none),
    rows per row group, requests per chunk of inputs, the percentile sketches' accuracy, and
    for a cell of a cluster (``sim.runs.cells.stream``) its ``place``: (cell index, its first
    prefill instance, its first decode instance), so that records name instances globally
    and carry a ``cell`` column as ``sim.runs.cells.run.cell_records`` writes them."""

    records_path: Path | None = None
    rows_per_group: int = ROWS_PER_GROUP
    chunk_size: int = CHUNK_SIZE
    relative_accuracy: float = 0.01
    place: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("rows_per_group", "chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"stream {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.relative_accuracy < 1:
            raise ConfigError(f"stream relative_accuracy must be in (0, 1), got "
                              f"{self.relative_accuracy}")
        if self.place is not None and (len(self.place) != 3 or min(self.place) < 0):
            raise ConfigError(f"stream place must be (cell, prefill offset, decode offset), "
                              f"each >= 0, got {self.place}")


def use_streaming(num_requests: float | None, flag: bool | None) -> bool:
    """``--stream``/``--no-stream`` when given, else stream runs over the threshold."""
    if flag is not None:
        return flag
    return num_requests is not None and num_requests > STREAM_MIN_REQUESTS


def request_source(config, trace, chunk_size: int):
    """The run's requests in chunks: ``trace`` (a ``Trace`` or a ``RequestSource``) if given,
    else the config's trace file read in blocks (``traces.trace_stream``) or its synthetic
    workload generated chunk by chunk."""
    from traces.chunks import RequestSource, trace_source, workload_source

    w = config.workload
    if isinstance(trace, RequestSource):
        return trace
    if trace is not None:
        return trace_source(trace, chunk_size)
    if w.trace is not None:
        from traces.trace_stream import TraceStream, stream_source

        return stream_source(TraceStream(Path(w.trace), num_requests=w.num_requests,
                                         duration_s=w.duration_s), chunk_size)
    return workload_source(w.name, w.rate, w.num_requests, w.duration_s, config.seed,
                           chunk_size)


def open_ledger(config, trace, stream: Stream, cut_at: float | None,
                monitored: bool) -> "StreamLedger":
    """The streaming ledger of a run (``sim.engine.cluster.simulate``), its writer and aggregate."""
    from traces.aggregate import RecordsAggregate
    from traces.record_stream import RecordWriter

    if monitored:
        raise ConfigError("monitor_interval_s samples requests in the system over the whole "
                          "trace; it needs the in-memory ledger (no streaming)")
    source = request_source(config, trace, stream.chunk_size)
    if source.has_tenant and config.cluster.policies.fairness != "fcfs":
        raise ConfigError(f"cluster.policies.fairness = {config.cluster.policies.fairness!r} "
                          f"reads the whole trace's tenants; run it without streaming")
    check_run_size(source.n, what=f"a streamed run of {source.n:,} requests", streamed=True,
                   trace_held=isinstance(trace, Trace))
    aggregate = RecordsAggregate(config.slo.ttft_s, config.slo.tpot_s, stream.relative_accuracy)
    writer = RecordWriter(stream.records_path, stream.rows_per_group, on_group=aggregate.add)
    return StreamLedger(source, writer, cut_at, aggregate, stream.place)


class _Inputs(dict):
    """Arrival instants keyed by request position; reading a position not yet loaded loads
    the chunks up to it (every column of them: the router reads an arrival first)."""

    __slots__ = ("load",)

    def __missing__(self, i: int):
        self.load(i)
        return dict.__getitem__(self, i)


class StreamLedger:
    """``sim.engine.ledger.Ledger``'s interface over the requests in the system only."""

    def __init__(self, source, writer, cut_at: float | None = None, aggregate=None,
                 place: tuple[int, int, int] | None = None):
        self.n, self.source, self.writer, self.cut_at = source.n, source, writer, cut_at
        self.place = place                    # a cell's (index, prefill, decode offsets)
        self.aggregate = aggregate            # fed by the writer's row groups, or None
        self.trace = None                     # no whole-trace columns (sim.engine.prefill reads none)
        self.arrival_at = _Inputs()          # the router reads a request's arrival first
        self.arrival_at.load = self._load
        self.prompt: dict[int, int] = {}
        self.output: dict[int, int] = {}
        self.reasons: dict[int, object] = {}
        self.status: dict[int, Status] = {}
        self.prefill_instance: dict[int, int] = {}
        self.decode_instance: dict[int, int] = {}
        for name in INSTANTS:
            setattr(self, name, {})
        self.join_iteration: dict[int, int] = {}
        self.kv_bytes: dict[int, int] = {}
        self._ids: dict[int, int] = {}
        self._tenant: dict[int, str] | None = {} if source.has_tenant else None
        self.num_ended = self.num_rejected = 0
        self.num_loaded = 0                   # requests loaded so far (positions < this)
        self._chunks = source.chunks()
        self._ended: list[int] = []           # ended since the latest load
        self._ended_before: list[int] = []    # ended between the two latest loads
        self._reject_codes = None

    @property
    def num_live(self) -> int:
        """Requests whose state the ledger holds (loaded, not yet written out)."""
        return len(self._ids)

    def judge(self, reject_codes) -> dict:
        """The router's verdicts, computed chunk by chunk as requests load."""
        self._reject_codes = reject_codes
        return self.reasons

    def num_in_system(self, now: float) -> int:
        raise ConfigError("monitoring requests in the system needs the in-memory ledger; "
                          "run without streaming (--no-stream)")

    def fail(self, i: int, status: Status, now: float) -> None:
        assert i not in self.status, f"request {i} already ended as {self.status[i]}"
        self.status[i] = status
        self.finished_at[i] = now
        self.num_ended += 1
        if status.value.startswith("rejected"):
            self.num_rejected += 1
        self._ended.append(i)

    def finish(self, i: int, now: float) -> None:
        assert i not in self.status, f"request {i} already ended as {self.status[i]}"
        self.status[i] = Status.OK
        self.finished_at[i] = now
        self.num_ended += 1
        self._ended.append(i)

    # -- loading and writing out ---------------------------------------------------------
    def _load(self, i: int) -> None:
        if i < self.num_loaded:
            raise RuntimeError(f"request at position {i} was read after its record was "
                               f"written out")
        if i >= self.n:
            raise IndexError(f"request position {i} is past the last ({self.n - 1})")
        while self.num_loaded <= i:
            self._write_out(self._ended_before)
            self._ended_before, self._ended = self._ended, []
            chunk = next(self._chunks)
            at = range(chunk.start, chunk.start + len(chunk))
            self.arrival_at.update(zip(at, chunk.arrival_at.tolist()))
            self.prompt.update(zip(at, chunk.num_prompt_tokens.tolist()))
            self.output.update(zip(at, chunk.num_output_tokens.tolist()))
            self._ids.update(zip(at, chunk.request_id.tolist()))
            if self._tenant is not None:
                self._tenant.update(zip(at, chunk.tenant.tolist()))
            codes = self._reject_codes(chunk.num_prompt_tokens, chunk.num_output_tokens)
            self.reasons.update(zip(at, [REJECTIONS[c] for c in codes.tolist()]))
            self.num_loaded += len(chunk)

    def _write_out(self, positions: list[int], status_of=None) -> None:
        """Hand the records of ``positions`` to the writer and forget them."""
        if not positions:
            return
        pop = dict.pop
        cols = {"request_id": [self._ids.pop(i) for i in positions],
                "arrival_at": [pop(self.arrival_at, i) for i in positions],
                "num_prompt_tokens": [self.prompt.pop(i) for i in positions],
                "num_output_tokens": [self.output.pop(i) for i in positions],
                "prefill_instance": [self.prefill_instance.pop(i, -1) for i in positions],
                "decode_instance": [self.decode_instance.pop(i, -1) for i in positions],
                "kv_bytes": [self.kv_bytes.pop(i, 0) for i in positions]}
        status = (status_of or self.status.pop)
        cols["status"] = np.array([status(i)._value_ for i in positions], dtype=object)
        for name in INSTANTS:
            column = getattr(self, name)
            cols[name] = np.array([column.pop(i, NAN) for i in positions])
        for i in positions:
            del self.reasons[i]
            self.join_iteration.pop(i, None)
        if self._tenant is not None:
            cols["tenant"] = np.array([self._tenant.pop(i) for i in positions], dtype=object)
        self._emit(cols)

    def _emit(self, cols: dict) -> None:
        """Cut the records as ``Ledger.frame`` does, then write them."""
        if self.cut_at is not None:
            late = cols["finished_at"] > self.cut_at
            cols["status"] = np.where(late, Status.UNFINISHED.value, cols["status"])
            for name in INSTANTS:
                values = cols[name]
                cols[name] = np.where(values > self.cut_at, NAN, values)
        outputs = np.asarray(cols["num_output_tokens"], dtype=np.int64)
        cols["num_generated_tokens"] = np.where(cols["status"] == Status.OK.value, outputs, 0)
        if self.place is not None:
            cell, *offsets = self.place
            for name, offset in zip(("prefill_instance", "decode_instance"), offsets):
                index = np.asarray(cols[name], dtype=np.int64)
                cols[name] = np.where(index >= 0, index + offset, index)
            cols["cell"] = np.full(len(outputs), cell, dtype=np.int64)
        self.writer.append(cols)

    def close(self, error: BaseException | None = None) -> None:
        """Write out every request: those ended, then (in a cut run) those still open and
        those that never arrived, as ``unfinished``. Raises if a request of an uncut run
        ended in no state or state was left behind."""
        if error is not None:
            self._write_out(self._ended_before + self._ended)
            self.writer.close(error)
            return
        self._write_out(self._ended_before + self._ended)
        self._ended_before, self._ended = [], []
        open_ = sorted(self._ids)
        if open_ and self.cut_at is None:
            self.writer.close(RuntimeError("a request ended in no state"))
            raise RuntimeError(f"request {self._ids[open_[0]]} ended in no state")
        self._write_out(open_, status_of=lambda i: Status.UNFINISHED)
        for chunk in self._chunks:               # never arrived before the cut
            k = len(chunk)
            cols = {"request_id": chunk.request_id, "arrival_at": chunk.arrival_at,
                    "num_prompt_tokens": chunk.num_prompt_tokens,
                    "num_output_tokens": chunk.num_output_tokens,
                    "status": np.full(k, Status.UNFINISHED.value, dtype=object),
                    "prefill_instance": np.full(k, -1), "decode_instance": np.full(k, -1),
                    "kv_bytes": np.zeros(k, dtype=np.int64),
                    **{name: np.full(k, NAN) for name in INSTANTS}}
            if self._tenant is not None:
                cols["tenant"] = chunk.tenant
            self._emit(cols)
        left = [name for name in ("arrival_at", "prompt", "output", "reasons", "status",
                                  "prefill_instance", "decode_instance", "join_iteration",
                                  "kv_bytes", "_ids", *INSTANTS) if getattr(self, name)]
        assert not left, f"state left behind in {left}"   # written after its write-out
        self.writer.close()

    def summary(self) -> tuple[dict, dict | None]:
        """(``metrics.summarize``'s keys, per-tenant rows or None) from the aggregate."""
        return self.aggregate.summary(), self.aggregate.tenant_rows()
