"""Cells: a large cluster simulated as independent router domains, serially or in parallel.

A cell is a router domain with its own prefill and decode instances; no request crosses
cells, so each cell is one ordinary ``simulate`` run on its share of the trace, and C cells
run side by side on a process pool or on Ray (``sim.runs.sweep.iter_parallel``).

- **Instances** (``[cells]``, ``sim.config.CellsConfig``): ``instances = "split"`` divides
  [cluster]'s instances evenly (a count that does not divide is refused); ``"per-cell"`` gives
  every cell [cluster]'s instances. Records name instances globally: cell c's local instance
  i is ``c * per_cell + i``; ``[faults] instance_loss`` indexes decode instances the same way.
- **Split rule**: request r goes to cell ``splitmix64(request_id) mod C`` (``cell_of``). The
  hash is a fixed pseudo-random function of the id alone, blind to arrival instants and
  lengths, so the split is an independent random thinning of the arrival stream: every cell
  sees the whole trace's arrival process at 1/C of its rate (Poisson arrivals stay Poisson at
  rate/C, a trace's bursts and daily pattern reach every cell in proportion) and the same
  length mix. Round-robin on arrival order would not: it makes Poisson arrivals Erlang-C,
  far more regular than what a router domain sees (tested). A request's cell does not depend
  on the other requests, the run's seed or how the cells run.
- **Seeds**: cell k runs with seed ``cell_seed(seed, k)`` (numpy ``SeedSequence([seed, k])``),
  for what is random inside a cell (fault draws); the arrivals are the whole trace, drawn once
  with the run's seed and then split.
- **Records**: each cell returns its records as Parquet bytes, sorted by request id, with a
  ``cell`` column; the parent writes each to a file as it arrives and merges the files by
  streaming (``merge_records``), so no process holds every record. The merged summary is
  computed from the merged file one metric at a time (``sim.runs.cells.summary``).

A cell's records depend only on its config, its share and its seed, and the merge only on the
files, so the merged records and summary are the same bytes whichever way the cells ran.

With a ``sim.engine.stream.Stream`` (``--stream``) the cells stream instead (``sim.runs.cells.stream``):
each makes its own share, writes its own part of the records dataset, and the parent merges
their aggregates, not their records.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.config import ConfigError, RunConfig
from traces.trace import Trace

#: the split rule, as the summary states it
SPLIT_RULE = "cell = splitmix64(request_id) mod cells.count"
#: rows per batch when merging cell files (per file in memory at once), and per row group
#: of a cell's records
MERGE_BATCH_ROWS = 8_192
#: rows per row group of the merged records
ROW_GROUP_ROWS = 65_536


class CellError(RuntimeError):
    """A cell failed; the message names the cell, its share of the trace and its seed."""


def cell_of(request_id: np.ndarray, count: int) -> np.ndarray:
    """The cell of each request: splitmix64's finaliser of its id, modulo ``count``."""
    z = np.asarray(request_id, dtype=np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(count)).astype(np.int64)                 # [n]


def split_trace(trace: Trace, count: int) -> list[Trace]:
    """Each cell's share of ``trace`` (``cell_of``), in arrival order."""
    cells = cell_of(trace.request_id, count)
    order = np.argsort(cells, kind="stable")                        # arrival order within a cell
    bounds = np.searchsorted(cells[order], np.arange(count + 1))
    return [trace.select(order[bounds[k]:bounds[k + 1]]) for k in range(count)]


def cell_seed(seed: int, index: int) -> int:
    """Cell ``index``'s seed, derived from the run's (63 bits, a valid ``RunConfig.seed``)."""
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


def instances_per_cell(config: RunConfig) -> tuple[int, int]:
    """(prefill, decode) instances of one cell."""
    cl, cells = config.cluster, config.cells
    if cl.kind == "aggregated":          # its instances count as both (sim.engine.pools)
        n = cl.aggregated.num_instances
        n = n if cells.instances == "per-cell" else n // cells.count
        return n, n
    if cells.instances == "per-cell":
        return cl.prefill.num_instances, cl.decode.num_instances
    return cl.prefill.num_instances // cells.count, cl.decode.num_instances // cells.count


def whole_cluster(config: RunConfig) -> RunConfig:
    """``config`` with every cell's instances counted: the cluster that power and cost price."""
    if config.cells.instances == "split":
        return config
    count = config.cells.count
    return config.replace(**{f"cluster.{role}.num_instances": n * count
                             for role, n in _instance_counts(config).items()})


def _instance_counts(config: RunConfig) -> dict[str, int]:
    cl = config.cluster
    if cl.kind == "aggregated":
        return {"aggregated": cl.aggregated.num_instances}
    return {"prefill": cl.prefill.num_instances, "decode": cl.decode.num_instances}


def cell_config(config: RunConfig, index: int) -> RunConfig:
    """Cell ``index``'s own run: its instances, its seed, the instance losses it holds."""
    prefill, decode = instances_per_cell(config)
    losses = []
    for k, (g, at) in enumerate(config.faults.instance_loss):
        if g >= decode * config.cells.count:
            raise ConfigError(f"faults.instance_loss[{k}]: decode_index {g}, but the "
                              f"{config.cells.count} cells have {decode * config.cells.count} "
                              f"decode instances ({decode} each)")
        if g // decode == index:
            losses.append([g % decode, at])
    counts = ({"cluster.aggregated.num_instances": decode}
              if config.cluster.kind == "aggregated" else
              {"cluster.prefill.num_instances": prefill, "cluster.decode.num_instances": decode})
    return config.replace(**{"cells.count": 1, "cells.instances": "split",
                             "seed": cell_seed(config.seed, index), **counts,
                             "faults.instance_loss": losses})


@dataclass(frozen=True)
class CellJob:
    """One cell's run: what a worker needs, and nothing of the other cells."""

    index: int
    num_cells: int
    config: RunConfig           # the cell's own (``cell_config``)
    trace: Trace                # its share of the requests
    prefill_offset: int         # global index of its first prefill instance
    decode_offset: int

    @property
    def num_requests(self) -> int:
        return len(self.trace)


@dataclass(frozen=True)
class CellOutcome:
    """What a cell sends back: its records as Parquet bytes and its instances' stats, or the
    error it stopped on (``error``; records None)."""

    index: int
    records: bytes | None
    stats: dict
    slo_attainment: float
    simulated_time_s: float
    wall_time_s: float
    error: str | None = None


def cell_jobs(config: RunConfig, trace: Trace) -> list[CellJob]:
    """One job per cell that has requests."""
    prefill, decode = instances_per_cell(config)
    shares = split_trace(trace, config.cells.count)
    count = config.cells.count
    return [CellJob(k, count, cell_config(config, k), share, k * prefill, k * decode)
            for k, share in enumerate(shares) if len(share)]


def run_cell(job: CellJob) -> CellOutcome:
    """Simulate one cell (module level: it runs in pool and Ray workers). Never raises: an
    error comes back as text, with where it happened, for the parent to name the cell."""
    from sim.engine.cluster import simulate

    wall = time.perf_counter()
    try:
        result = simulate(job.config, job.trace)
        records = cell_records(result.records, job)
    except Exception as exc:        # crosses a process boundary; the parent raises CellError
        return CellOutcome(job.index, None, {}, math.nan, math.nan, time.perf_counter() - wall,
                           error=error_text(exc))
    stats = {k: v for k, v in result.stats.items() if k != "in_system"}
    return CellOutcome(job.index, records, stats, result.summary["slo_attainment"],
                       result.summary["simulated_time_s"], time.perf_counter() - wall)


def error_text(exc: BaseException) -> str:
    """An error as text that crosses a process boundary, with where it was raised."""
    origin = exc                # SimPy re-raises a process's error as a copy caused by it
    while origin.__cause__ is not None and origin.__cause__.__traceback__ is not None:
        origin = origin.__cause__
    where = traceback.extract_tb(origin.__traceback__)[-1]
    return (f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno} "
            f"in {where.name})")


def records_schema(columns):
    """Arrow schema of cell records with ``columns``: ``traces.schema``'s columns in their
    dtypes, optional ones (tenant) where present, then ``cell``."""
    import pyarrow as pa

    from traces.schema import OPTIONAL_COLUMNS, RECORD_COLUMNS

    dtypes = {**RECORD_COLUMNS, **OPTIONAL_COLUMNS, "cell": "int64"}
    return pa.schema([(name, pa.string() if dtypes[name] == "string"
                       else pa.from_numpy_dtype(np.dtype(dtypes[name]))) for name in columns])


def cell_records(frame, job: CellJob) -> bytes:
    """A cell's records as Parquet bytes: sorted by request id, instances numbered globally,
    the cell's index in a ``cell`` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = frame.sort_values("request_id", kind="stable").reset_index(drop=True)
    for column, offset in (("prefill_instance", job.prefill_offset),
                           ("decode_instance", job.decode_offset)):
        placed = frame[column] >= 0
        frame.loc[placed, column] = frame.loc[placed, column] + offset
    frame["cell"] = job.index
    schema = records_schema(frame.columns)
    table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    sink = pa.BufferOutputStream()
    # row groups of a merge batch: the merge decodes one row group per file at a time
    pq.write_table(table.replace_schema_metadata(None), sink, compression="zstd",
                   row_group_size=MERGE_BATCH_ROWS)
    return sink.getvalue().to_pybytes()


def merge_records(paths: list[Path], out: Path, batch_rows: int = MERGE_BATCH_ROWS) -> int:
    """Merge record files, each sorted by request id, into ``out`` sorted by request id,
    streaming: one row group per file decoded at a time, row groups of ``ROW_GROUP_ROWS``
    written. Returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [pq.ParquetFile(p, pre_buffer=False) for p in paths]   # not the whole file
    readers = [f.iter_batches(batch_size=batch_rows) for f in files]
    buffers = [_next_table(r) for r in readers]
    pending, num_pending, rows = [], 0, 0
    with pq.ParquetWriter(out, files[0].schema_arrow, compression="zstd") as writer:
        while any(b is not None for b in buffers):
            live = [k for k, b in enumerate(buffers) if b is not None]
            # no later row of any file is at or below the smallest last id of the buffers
            bound = min(buffers[k]["request_id"][-1].as_py() for k in live)
            parts = []
            for k in live:
                ids = buffers[k]["request_id"].to_numpy()
                cut = int(np.searchsorted(ids, bound, side="right"))
                parts.append(buffers[k].slice(0, cut))
                rest = buffers[k].slice(cut)
                buffers[k] = rest if rest.num_rows else _next_table(readers[k])
            table = pa.concat_tables(parts)
            pending.append(table.take(np.argsort(table["request_id"].to_numpy(),
                                                 kind="stable")))
            num_pending += table.num_rows
            if num_pending >= ROW_GROUP_ROWS or all(b is None for b in buffers):
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                rows += num_pending
                pending, num_pending = [], 0
    return rows


def _next_table(reader):
    import pyarrow as pa

    for batch in reader:
        if batch.num_rows:
            return pa.Table.from_batches([batch])
    return None


@dataclass(frozen=True)
class CellsResult:
    config: RunConfig
    summary: dict               # merged, the same bytes however the cells ran
    records_path: Path | None   # the merged records (None: not kept)
    timing: dict                # wall time of the run and of each cell, workers, backend


def simulate_cells(config: RunConfig, trace: Trace | None = None, *, workers: int | None = None,
                   ray_address: str | None = None, records_path: Path | None = None,
                   progress: bool = False) -> CellsResult:
    """Run ``trace`` (default: the config's workload) through ``config.cells.count`` cells,
    on ``workers`` local processes (1: in this process) or on Ray (``ray_address``, as
    ``sim.runs.sweep.run_parallel``). ``records_path``: where the merged records go (Parquet);
    without it they are merged in a temporary folder for the summary and removed.
    (``sim.runs.cells.stream.simulate_cells_streamed``: the same with every cell streaming.)"""
    from sim.runs.cells.summary import merged_summary
    from sim.runs.sweep import iter_parallel

    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return clock[-1] - clock[-2]

    trace = trace if trace is not None else cells_trace(config, workers)
    jobs = cell_jobs(config, trace)
    del trace                   # the shares hold the requests from here on
    phases = {"split_s": lap()}
    with tempfile.TemporaryDirectory(prefix="hawk-cells-") as tmp:
        paths, outcomes = _run_jobs(jobs, Path(tmp), workers, ray_address, progress,
                                    iter_parallel)
        phases["cells_s"] = lap()
        merged = Path(records_path) if records_path is not None else Path(tmp) / "records.parquet"
        merge_records(paths, merged)
        phases["merge_s"] = lap()
        summary = merged_summary(merged, config, whole_cluster(config),
                                 pooled_stats(config, jobs, outcomes),
                                 max(o.simulated_time_s for o in outcomes))
        summary["cells"] = cells_section(config, jobs, outcomes)
        phases["summary_s"] = lap()
    timing = {"wall_time_s": clock[-1] - clock[0], **phases,
              "backend": "ray" if ray_address is not None else "processes",
              "workers": workers, "ray_address": ray_address,
              "cell_wall_time_s": [o.wall_time_s for o in outcomes]}
    return CellsResult(config, summary, Path(records_path) if records_path else None, timing)


def pooled_stats(config: RunConfig, jobs: list[CellJob], outcomes: list[CellOutcome]) -> dict:
    """Every instance's stats in global order (a cell without requests: idle instances), the
    busiest NIC's busy time, summed bytes and failed attempts."""
    prefill, decode = instances_per_cell(config)
    by_index = {j.index: o.stats for j, o in zip(jobs, outcomes)}
    idle = {"prefill_busy_s": [0.0] * prefill, "prefill_batches": [0] * prefill,
            "decode_busy_s": [0.0] * decode, "decode_iterations": [0] * decode,
            "decode_preemptions": [0] * decode, "link_busy_s": 0.0, "link_bytes": 0,
            "failed_transfer_attempts": 0}
    cells = [by_index.get(k, idle) for k in range(config.cells.count)]
    keys = ("prefill_busy_s", "prefill_batches", "decode_busy_s", "decode_iterations",
            "decode_preemptions")
    if config.cluster.kind == "aggregated":
        keys += ("aggregated_busy_s",)
        idle["aggregated_busy_s"] = idle["decode_busy_s"]
    out = {key: [v for c in cells for v in c[key]] for key in keys}
    out["link_busy_s"] = max(c["link_busy_s"] for c in cells)      # busiest NIC
    out["link_bytes"] = sum(c["link_bytes"] for c in cells)
    out["failed_transfer_attempts"] = sum(c["failed_transfer_attempts"] for c in cells)
    for key in ("prefix_cache", "decode_prefix_cache"):     # sim.engine.prefix_cache
        caches = [c[key] for c in cells if key in c]
        if caches:
            out[key] = {k: sum(c[k] for c in caches) for k in caches[0]}
    return out


def cells_section(config: RunConfig, jobs: list[CellJob], outcomes: list[CellOutcome]) -> dict:
    """The summary's ``cells``: layout, split rule, and per cell its requests, seed,
    simulated time and SLO attainment (a cell without requests: 0, None, 0, NaN)."""
    prefill, decode = instances_per_cell(config)
    by_index = {j.index: (j, o) for j, o in zip(jobs, outcomes)}
    cells = [by_index.get(k) for k in range(config.cells.count)]
    return {"count": config.cells.count, "instances": config.cells.instances,
            "prefill_instances_per_cell": prefill, "decode_instances_per_cell": decode,
            "split_rule": SPLIT_RULE,
            "num_requests": [c[0].num_requests if c else 0 for c in cells],
            "seed": [c[0].config.seed if c else None for c in cells],
            "simulated_time_s": [c[1].simulated_time_s if c else 0.0 for c in cells],
            "slo_attainment": [c[1].slo_attainment if c else math.nan for c in cells]}


def cells_trace(config: RunConfig, workers: int | None) -> Trace:
    """The config's workload, its size checked against memory as cells hold it: each cell
    process a share, ``workers`` of them at once (``sim.config.run_size``)."""
    import os

    from sim.engine.cluster import workload_trace
    from sim.config.run_size import check_run_size, expected_num_requests
    from traces.workloads import make_workload

    w, count = config.workload, config.cells.count
    if w.trace is not None:
        return workload_trace(config)
    side_by_side = min(count, workers or os.cpu_count() or 1)
    check_run_size(expected_num_requests(w) / count, side_by_side,
                   f"each of {count} cells, {side_by_side} at once")
    return make_workload(w.name, w.rate, w.num_requests, w.duration_s, seed=config.seed)


def failed(job, outcome) -> CellError:
    """The error of a cell that failed, naming the cell, its share and its seed."""
    return CellError(f"cell {job.index} of {job.num_cells} ({job.num_requests:,} requests, "
                     f"seed {job.config.seed}) failed: {outcome.error}")


def _run_jobs(jobs: list[CellJob], folder: Path, workers, ray_address, progress,
              iter_parallel) -> tuple[list[Path], list[CellOutcome]]:
    """Each cell's records file in ``folder`` (in cell order) and its outcome, records
    dropped: a file is written as its cell finishes, so the parent holds few at once."""
    from concurrent.futures.process import BrokenProcessPool

    paths, outcomes = {}, {}
    try:
        for k, outcome in iter_parallel(run_cell, jobs, workers, progress, ray_address,
                                        desc="cells"):
            job = jobs[k]
            if outcome.error is not None:
                raise failed(job, outcome)
            paths[k] = folder / f"cell-{job.index:04d}.parquet"
            paths[k].write_bytes(outcome.records)
            outcomes[k] = dataclasses.replace(outcome, records=None)
    except BrokenProcessPool as exc:
        running = [jobs[k].index for k in range(len(jobs)) if k not in outcomes]
        raise CellError(f"a worker process died while running cells {running} (out of "
                        f"memory? run fewer at once with --workers): {exc}") from exc
    order = sorted(paths)
    return [paths[k] for k in order], [outcomes[k] for k in order]
