"""Cells that stream: each cell reads its own share and writes its own records; the parent
merges the cells' aggregates, never their records.

``sim.runs.cells.run`` runs cells on whole shares of a trace held by the parent and merges their
records into one sorted file. With a ``sim.engine.stream.Stream`` (``hawk simulate --cells N
--stream``) every cell is a streamed run instead (``sim.engine.stream``), and nothing the parent
holds grows with the requests:

- **Requests**: the run's requests are a ``traces.chunks.RequestSource`` with a picklable
  recipe: the config's synthetic workload generated chunk by chunk, a trace file read in
  blocks (``traces.trace_stream``), or a trace in memory (split in the parent as
  ``sim.runs.cells.run.split_trace`` splits it). The parent counts each cell's share in one pass over
  the chunks; each cell makes the source again in its worker and keeps its own requests by
  the same rule (``sim.runs.cells.run.cell_of``), in arrival order: the requests of
  ``sim.runs.cells.run.split_trace``'s share.
- **Records**: cell k writes ``records_path/cell-000k.parquet/`` (a dataset of row groups,
  ``traces.record_stream``), instances numbered globally, with its ``cell`` column; the whole
  ``records_path`` reads as one dataset (``traces.schema.read_records``, ``pandas``), whose
  ``_INCOMPLETE`` marker stays until every cell has ended. Rows come cell by cell in the order
  requests end; sorted by ``request_id`` they are the records ``sim.runs.cells.run`` merges (tested).
  With ``--ray ADDRESS`` the workers write there, so it must be a folder they share.
- **Summary**: each cell returns its ``traces.aggregate.RecordsAggregate`` (exact counts and
  sums, a DDSketch per latency) and the parent merges them in cell order
  (``sim.runs.cells.summary.aggregate_summary``). A merged DDSketch is the sketch of all the
  values, so percentiles keep the stated relative-error bound (the summary's
  ``percentiles`` entry), and the summary is the same bytes however the cells ran.

Measured: ``hawk simulate --cells 16 --cell-instances per-cell --rate 8 --workers 2
--num-requests 10000000 --stream`` peaked at 45 MB resident in the parent and 285 MB in the
largest worker (the same parent peak, 43 MB, at 200,000 requests).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.runs.cells.run import (CellError, cell_config, cell_of, cells_section, failed, instances_per_cell,
                       pooled_stats, split_trace, whole_cluster, error_text, CellsResult)
from sim.config import ConfigError, RunConfig
from traces.chunks import RequestSource, rechunk, trace_source
from traces.trace import Trace


@dataclass(frozen=True)
class StreamedCellJob:
    """One streamed cell: its config, the recipe of the run's requests and its count of
    them, where its records go and how it streams (``sim.engine.stream.Stream``, its place set)."""

    index: int
    num_cells: int
    config: RunConfig
    recipe: object              # recipe(chunk_size=...) -> RequestSource (all cells' requests)
    num_requests: int
    stream: object              # sim.engine.stream.Stream


@dataclass(frozen=True)
class StreamedCellOutcome:
    index: int
    aggregate: object           # traces.aggregate.RecordsAggregate, or None on an error
    stats: dict
    slo_attainment: float
    simulated_time_s: float
    wall_time_s: float
    error: str | None = None


def cell_share(recipe, index: int, count: int, n: int, chunk_size: int) -> RequestSource:
    """Cell ``index``'s ``n`` requests of the source ``recipe`` makes, in arrival order."""
    whole = recipe(chunk_size=chunk_size)

    def chunks():
        parts = (_keep(chunk, cell_of(chunk.request_id, count) == index)
                 for chunk in whole.chunks())
        yield from rechunk(parts, chunk_size, n)

    return RequestSource(n, f"{whole.name} cell {index}", chunks, whole.has_tenant)


def _keep(chunk, mask: np.ndarray) -> dict:
    return {"request_id": chunk.request_id[mask], "arrival_at": chunk.arrival_at[mask],
            "num_prompt_tokens": chunk.num_prompt_tokens[mask],
            "num_output_tokens": chunk.num_output_tokens[mask],
            "tenant": None if chunk.tenant is None else chunk.tenant[mask]}


def run_streamed_cell(job: StreamedCellJob) -> StreamedCellOutcome:
    """Simulate one cell, streaming (module level: it runs in pool and Ray workers). Never
    raises: an error comes back as text for the parent to name the cell."""
    from sim.engine.cluster import simulate

    wall = time.perf_counter()
    try:
        source = cell_share(job.recipe, job.index, job.num_cells, job.num_requests,
                            job.stream.chunk_size)
        result = simulate(job.config, source, stream=job.stream)
    except Exception as exc:        # crosses a process boundary; the parent raises CellError
        return StreamedCellOutcome(job.index, None, {}, math.nan, math.nan,
                                   time.perf_counter() - wall, error=error_text(exc))
    stats = {k: v for k, v in result.stats.items() if k != "in_system"}
    return StreamedCellOutcome(job.index, result.aggregate, stats,
                               result.summary["slo_attainment"],
                               result.summary["simulated_time_s"], time.perf_counter() - wall)


def streamed_jobs(config: RunConfig, requests, stream, records_path: Path | None
                  ) -> list[StreamedCellJob]:
    """One job per cell that has requests: ``requests`` is a ``Trace`` (split here), a
    ``RequestSource`` or None (the config's workload, generated in each cell)."""
    from sim.engine.stream import request_source

    count = config.cells.count
    prefill, decode = instances_per_cell(config)
    if isinstance(requests, Trace):
        shares = split_trace(requests, count)
        recipes = [trace_source(share).recipe for share in shares]
        sizes = [len(share) for share in shares]
    else:
        source = request_source(config, requests, stream.chunk_size)
        if source.recipe is None:
            raise ConfigError(f"the requests of {source.name} cannot be made again in a "
                              f"cell's worker (no recipe)")
        sizes = np.zeros(count, dtype=np.int64)
        for chunk in source.chunks():            # one pass: each cell's count
            sizes += np.bincount(cell_of(chunk.request_id, count), minlength=count)
        recipes = [source.recipe] * count
    jobs = []
    for k in range(count):
        if not sizes[k]:
            continue
        path = None if records_path is None else Path(records_path) / f"cell-{k:04d}.parquet"
        cell_stream = dataclasses.replace(stream, records_path=path,
                                          place=(k, k * prefill, k * decode))
        jobs.append(StreamedCellJob(k, count, cell_config(config, k), recipes[k],
                                    int(sizes[k]), cell_stream))
    return jobs


def simulate_cells_streamed(config: RunConfig, requests=None, stream=None, *, workers=None,
                            ray_address=None, records_path=None,
                            progress: bool = False) -> CellsResult:
    """``sim.runs.cells.run.simulate_cells`` with every cell streaming (module docstring): ``requests``
    a ``Trace``, a ``traces.chunks.RequestSource`` or None (the config's workload);
    ``stream`` how each cell streams (default ``sim.engine.stream.Stream()``); its records path is
    replaced by the cell's part of ``records_path``."""
    if stream is None:
        from sim.engine.stream import Stream

        stream = Stream()
    from sim.runs.cells.summary import aggregate_summary
    from sim.runs.sweep import iter_parallel
    from traces.aggregate import RecordsAggregate
    from traces.schema import INCOMPLETE, clear_records

    clock = [time.perf_counter()]
    jobs = streamed_jobs(config, requests, stream, records_path)
    del requests
    split_s = time.perf_counter() - clock[0]
    if records_path is not None:
        records_path = Path(records_path)
        clear_records(records_path)
        records_path.mkdir(parents=True)
        (records_path / INCOMPLETE).write_text("the cells writing these records have not "
                                               "all ended\n")
    outcomes: dict[int, StreamedCellOutcome] = {}
    try:
        for k, outcome in iter_parallel(run_streamed_cell, jobs, workers, progress,
                                        ray_address, desc="cells"):
            if outcome.error is not None:
                raise failed(jobs[k], outcome)
            outcomes[k] = outcome
    except Exception as exc:
        if records_path is not None:
            (records_path / INCOMPLETE).write_text(f"the run of cells stopped: {exc}\n")
        if isinstance(exc, CellError):
            raise
        from concurrent.futures.process import BrokenProcessPool

        if isinstance(exc, BrokenProcessPool):
            running = [jobs[k].index for k in range(len(jobs)) if k not in outcomes]
            raise CellError(f"a worker process died while running cells {running} (out of "
                            f"memory? run fewer at once with --workers): {exc}") from exc
        raise
    if records_path is not None:
        (records_path / INCOMPLETE).unlink()
    cells_s = time.perf_counter() - clock[0] - split_s
    ordered = [outcomes[k] for k in sorted(outcomes)]
    aggregate = RecordsAggregate(config.slo.ttft_s, config.slo.tpot_s, stream.relative_accuracy)
    for outcome in ordered:                      # cell order: the same bytes however run
        aggregate.merge(outcome.aggregate)
    summary = aggregate_summary(aggregate, config, whole_cluster(config),
                                pooled_stats(config, jobs, ordered),
                                max(o.simulated_time_s for o in ordered))
    summary["cells"] = cells_section(config, jobs, ordered)
    wall = time.perf_counter() - clock[0]
    timing = {"wall_time_s": wall, "split_s": split_s, "cells_s": cells_s,
              "summary_s": wall - split_s - cells_s,
              "backend": "ray" if ray_address is not None else "processes",
              "workers": workers, "ray_address": ray_address, "streamed": True,
              "cell_wall_time_s": [o.wall_time_s for o in ordered]}
    return CellsResult(config, summary, records_path, timing)
