"""Run size against this machine's memory: a run that cannot finish is refused up front.

The estimate is the simulator's measured memory per request times the requests a run will
hold (its count, or rate x duration), once per run side by side (a sweep's workers).
"""

from __future__ import annotations

import dataclasses

from sim.config import ConfigError, RunConfig, WorkloadConfig

#: the simulator's memory per request, measured: a default Chatbot run of 400,000 requests
#: peaked at 287 MB and one of 800,000 at 448 MB (0.42 KB per request over ~130 MB of
#: imports and tables); budgeted at 1 KB per request (the records table, its parquet copy)
BYTES_PER_REQUEST = 1024
BASE_BYTES = 300e6
#: a streamed run (``sim.engine.stream``) holds only the requests in flight, two chunks of inputs
#: and a row group of records, whatever its length: budgeted at STREAM_BYTES, plus the
#: trace's columns (~40 B a request) when a trace held in memory supplies the requests (a
#: generator, or a trace file read in blocks by ``traces.trace_stream``, adds nothing).
#: Measured: default Chatbot runs of 10^6 and 10^7 requests streamed to Parquet both peaked
#: at ~225 MB (~125 MB of it imports). A run far past its capacity keeps a growing queue in
#: flight, which no budget fixed in advance covers.
STREAM_BYTES = 200e6
TRACE_BYTES_PER_REQUEST = 48
#: runs larger than this stream by default (``hawk simulate``; their percentiles are sketched)
STREAM_MIN_REQUESTS = 1_000_000


def expected_num_requests(workload: WorkloadConfig) -> float | None:
    """Requests a synthetic workload will generate (the Poisson mean where only a duration
    bounds it); None for a trace, whose length is known once it is read."""
    if workload.trace is not None:
        return None
    counts = [workload.num_requests] if workload.num_requests is not None else []
    if workload.duration_s is not None:
        counts.append(workload.rate * workload.duration_s)
    return float(min(counts))


def available_memory_bytes() -> float | None:
    """Memory this machine can still give a run (Linux MemAvailable); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_bytes(num_requests: float, streamed: bool = False, trace_held: bool = False) -> float:
    """Estimated peak memory of one run: in memory, per request; streamed, a fixed budget
    plus the trace's columns when it is held whole."""
    if not streamed:
        return BASE_BYTES + num_requests * BYTES_PER_REQUEST
    return BASE_BYTES + STREAM_BYTES + (num_requests * TRACE_BYTES_PER_REQUEST
                                        if trace_held else 0.0)


def check_run_size(num_requests: float, copies: int = 1, what: str = "the run",
                   extra_bytes: float = 0.0, streamed: bool = False,
                   trace_held: bool = False) -> None:
    """Refuse up front a run that cannot finish in this machine's memory, with the estimate.

    ``copies`` runs side by side (a sweep's worker processes) each hold ``num_requests``;
    ``extra_bytes`` is held once besides (a sweep's summaries). A ``streamed`` run holds a
    fixed amount (``run_bytes``)."""
    need = copies * run_bytes(num_requests, streamed, trace_held) + extra_bytes
    have = available_memory_bytes()
    if have is not None and need > have:
        side = f" x {copies} runs side by side" if copies > 1 else ""
        per = (f"{STREAM_BYTES / 1e6:.0f} MB streamed" + (
            f" + {TRACE_BYTES_PER_REQUEST} B per request of trace" if trace_held else "")
            if streamed else f"{BYTES_PER_REQUEST} B per request")
        raise ConfigError(
            f"{what}: {num_requests:,.0f} requests{side} need about {need / 1e9:,.1f} GB "
            f"({per} + {BASE_BYTES / 1e6:.0f} MB per run"
            f"{f' + {extra_bytes / 1e9:,.1f} GB of summaries' if extra_bytes else ''}), but "
            f"this machine has {have / 1e9:,.1f} GB available; simulate fewer requests "
            f"(num_requests, rate x duration_s)"
            + ("" if streamed else f", or stream the records (--stream; runs over "
               f"{STREAM_MIN_REQUESTS:,} requests stream by default)")
            + (", run fewer at once (--workers)" if copies > 1 else "")
            + (", or sweep fewer points (--rates, --seeds)" if extra_bytes else ""))


def check_sweep_size(config: RunConfig, rates, num_seeds: int, workers: int | None) -> None:
    """``check_run_size`` for a sweep: its largest point, once per worker running at once,
    plus the summaries of all points kept until the end (~10 KB each)."""
    import os

    points = len(rates) * max(num_seeds, 1)
    copies = min(points, workers or os.cpu_count() or 1)
    largest = expected_num_requests(dataclasses.replace(config.workload, rate=max(rates)))
    check_run_size(largest or 0, copies, f"the sweep of {points:,} points",
                   extra_bytes=points * 10_000)

