"""Run size against this machine: a run that cannot finish is refused up front, and one that
will take a while says so before it starts.

Memory: the simulator's measured memory per request times the requests a run will hold (its
count, or rate x duration), once per run side by side (a sweep's workers). Time: the measured
wall time per simulated request on this machine (``SECONDS_PER_REQUEST``), so a command can
print its estimate and refuse a run past a wall-time limit its user can raise.
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
#: memory of a trace file loaded whole (``traces.loaders.load_trace``: its raw columns, the
#: parsed values and the trace), measured as peak RSS over the imports: a 2,000,000-row CSV
#: of arrival_at, num_prompt_tokens, num_output_tokens (38 MB) peaked 1,134 MB above them
#: (581 B a row), its first 500,000 rows 286 MB (585 B a row); budgeted at 1 KB a row, for
#: wider rows (JSONL, tenants, prefix hashes)
TRACE_LOAD_BYTES_PER_ROW = 1024
#: runs larger than this stream by default (``hawk simulate``; their percentiles are sketched)
STREAM_MIN_REQUESTS = 1_000_000


#: wall time per simulated request on this machine, measured on 2 cores (Python 3.11). Alone
#: on the machine, default Chatbot runs of 200,000 requests took 4.2 s in memory and 5.3 s
#: streamed, start-up included, and a run of 10^7 streamed 235 s (23.5 us a request). Shared
#: with other work, as the machine usually is: a run of 10^6 in memory took 59 s wall for
#: 18.5 s of CPU (``/usr/bin/time -v hawk simulate --num-requests 1000000 --no-stream``, load
#: average 3.4), and one of 10^8 about 1.5 hours (54 us). Budgeted at the shared figure, 55 us;
#: an overloaded run (preemption, long queues) takes longer still.
SECONDS_PER_REQUEST = 55e-6
START_UP_S = 0.5
#: wall time to read and check one row of a trace file (``traces.trace_stream``), measured on
#: 2 cores at load average 1.4: the scan of a 300,000-row CSV (6.6 MB) took 8.8 us a row and
#: the run's second read 6.5 us; budgeted at 9 us a row a read
SECONDS_PER_TRACE_ROW = 9e-6
#: past this estimate a command announces its run (requests, time, memory) on stderr
ANNOUNCE_AFTER_S = 5.0
#: past this estimate a command refuses, unless its --max-wall-s allows it
DEFAULT_MAX_WALL_S = 3600.0


def estimated_wall_s(num_requests: float, copies_in_turn: float = 1.0) -> float:
    """Wall seconds to simulate ``num_requests``, ``copies_in_turn`` times one after another."""
    return START_UP_S + copies_in_turn * num_requests * SECONDS_PER_REQUEST


def describe_duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``1.5 h``, ``3.2 days``: a rough duration for an estimate."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}" if seconds < 100 * size else \
                f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.0f} s"


def describe_estimate(what: str, num_requests: float, wall_s: float,
                      peak_bytes: float | None = None) -> str:
    """``hawk simulate: about 5,000,000 requests, ~4 min on this machine, ~400 MB peak``."""
    memory = "" if peak_bytes is None else f", ~{peak_bytes / 1e6:,.0f} MB peak"
    return (f"{what}: about {num_requests:,.0f} requests, ~{describe_duration(wall_s)} on this "
            f"machine{memory}")


def check_run_time(num_requests: float, max_wall_s: float | None, what: str = "the run",
                   copies_in_turn: float = 1.0, flag: str = "--max-wall-s",
                   in_parallel: int = 1, extra_s: float = 0.0) -> float:
    """The run's estimated wall seconds; ``ConfigError`` naming the estimate and ``flag``
    when it exceeds ``max_wall_s`` (None: no limit). ``copies_in_turn`` runs of
    ``num_requests`` (a sweep's points), ``in_parallel`` of them at a time (its workers),
    after ``extra_s`` of other work (reading a trace file)."""
    wall = estimated_wall_s(num_requests, copies_in_turn / max(in_parallel, 1)) + extra_s
    if max_wall_s is not None and wall > max_wall_s:
        at_once = f", {in_parallel} at a time" if in_parallel > 1 else ""
        raise ConfigError(
            f"{what}: {num_requests * copies_in_turn:,.0f} simulated requests{at_once} would "
            f"take about {describe_duration(wall)} on this machine "
            f"({SECONDS_PER_REQUEST * 1e6:.0f} us a request), past the "
            f"{describe_duration(max_wall_s)} limit; simulate fewer requests, or allow it "
            f"with {flag} {wall * 1.5:.0f}")
    return wall


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


def check_memory_limit(need_bytes: float, max_bytes: float | None, what: str,
                       detail: str, remedy: str, flag: str = "--max-memory-gb") -> None:
    """``ConfigError`` naming the estimate, ``detail`` (how it was made), ``remedy`` and
    ``flag`` when ``need_bytes`` exceeds ``max_bytes`` (None: this machine's available
    memory; no limit where that is unknown)."""
    limit = available_memory_bytes() if max_bytes is None else max_bytes
    if limit is None or need_bytes <= limit:
        return
    whose = "this machine's available memory" if max_bytes is None else f"the {flag} limit"
    raise ConfigError(f"{what}: needs about {need_bytes / 1e9:,.1f} GB ({detail}), past "
                      f"{whose} of {limit / 1e9:,.1f} GB; {remedy}, or allow it with {flag} "
                      f"{need_bytes * 1.2 / 1e9:.3g}")


def check_trace_load(rows: float, run_peak_bytes: float, max_bytes: float | None,
                     what: str, remedy: str) -> float:
    """Before a trace file of about ``rows`` rows is loaded whole, then run (its runs peaking
    at ``run_peak_bytes``): the estimated peak bytes, refused past ``max_bytes``."""
    need = rows * TRACE_LOAD_BYTES_PER_ROW + run_peak_bytes
    check_memory_limit(need, max_bytes, what,
                       f"{rows:,.0f} rows loaded whole at {TRACE_LOAD_BYTES_PER_ROW} B a row + "
                       f"{run_peak_bytes / 1e9:,.1f} GB of runs", remedy)
    return need


def check_sweep_size(config: RunConfig, rates, num_seeds: int, workers: int | None) -> None:
    """``check_run_size`` for a sweep: its largest point, once per worker running at once,
    plus the summaries of all points kept until the end (~10 KB each)."""
    import os

    points = len(rates) * max(num_seeds, 1)
    copies = min(points, workers or os.cpu_count() or 1)
    largest = expected_num_requests(dataclasses.replace(config.workload, rate=max(rates)))
    check_run_size(largest or 0, copies, f"the sweep of {points:,} points",
                   extra_bytes=points * 10_000)

