"""``python -m sim.bench.cells``: a cells run's wall time on 1 and on 2 workers, and the speed-up.

The cluster is ``--cells`` cells (16) of one prefill and one decode instance each (the Chatbot
scenario's, ``cells.instances = "per-cell"``), fed Poisson Chatbot arrivals at
``--rate-per-cell`` (0.5 req/s, near one cell's knee) times the number of cells, split by
request id (``sim.runs.cells.run``). Each worker count runs in a fresh interpreter, one after another
in this same invocation, and reports its wall time (trace, cells, merge and summary: the whole
``simulate_cells``), its peak resident memory and that of its largest worker process. The
speed-up is the 1-worker wall time over the N-worker one, measured here, on this machine's
load: beside it each run's CPU seconds (its own and its workers'), since on a machine busy
with other work the speed-up is capped by the CPU share the run gets. ``--num-requests 10000000`` is the issue's size (minutes); the default is smaller.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys

DEFAULT_NUM_REQUESTS = 200_000


def run_once(num_requests: int, cells: int, workers: int, rate_per_cell: float,
             seed: int = 0, stream: bool = False) -> dict:
    """One cells run in this process; wall time and peak memory (this process, its largest
    worker process once they have ended). ``stream``: every cell streams
    (``sim.runs.cells.stream``: the parent merges aggregates, not records; no merge phase)."""
    from sim.config import RunConfig

    config = RunConfig().replace(**{"cells.count": cells, "cells.instances": "per-cell",
                                    "workload.num_requests": num_requests,
                                    "workload.rate": rate_per_cell * cells, "seed": seed})
    if stream:
        from sim.runs.cells.stream import simulate_cells_streamed

        result = simulate_cells_streamed(config, workers=workers)
    else:
        from sim.runs.cells.run import simulate_cells

        result = simulate_cells(config, workers=workers)
    from sim.bench.speed import own_peak_rss_kb

    kb = 1024
    mine, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return {"workers": workers, "streamed": stream,
            "num_requests": result.summary["num_requests"],
            "wall_time_s": result.timing["wall_time_s"],
            # CPU seconds of this process and its workers: on a machine busy with other work
            # the wall-time speed-up is capped by the CPU share the run gets
            "cpu_s": mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime,
            **{k: result.timing.get(k, 0.0)         # (a streamed run merges no records)
               for k in ("split_s", "cells_s", "merge_s", "summary_s")},
            "cells_cpu_s": sum(result.timing["cell_wall_time_s"]),
            "parent_peak_rss_mb": own_peak_rss_kb() * kb / 1e6,   # not its parent's
            # a forked worker's resident set counts the pages it shares with the parent
            "worker_peak_rss_mb": children.ru_maxrss * kb / 1e6,
            "slo_attainment": result.summary["slo_attainment"]}


def run(num_requests: int = DEFAULT_NUM_REQUESTS, cells: int = 16, workers=(1, 2),
        rate_per_cell: float = 0.5, seed: int = 0, stream: bool = False) -> dict:
    """Each worker count in a fresh interpreter, in turn; the speed-up over the first."""
    runs = []
    for w in workers:
        out = subprocess.run(
            [sys.executable, "-m", "sim.bench.cells", "--one", "--num-requests",
             str(num_requests), "--cells", str(cells), "--workers", str(w), "--rate-per-cell",
             str(rate_per_cell), "--seed", str(seed)] + (["--stream"] if stream else []),
            capture_output=True, text=True, check=False, env=_same_package_env())
        if out.returncode != 0:
            raise RuntimeError(f"the {w}-worker run failed:\n{out.stderr[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = runs[0]["wall_time_s"]
    for r in runs:
        r["speedup"] = base / r["wall_time_s"]
    return {"num_requests": num_requests, "cells": cells, "rate_per_cell": rate_per_cell,
            "streamed": stream, "runs": runs}


def _same_package_env() -> dict:
    """The environment, with this very package first on the path (a checkout may shadow the
    installed one)."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def format_report(report: dict) -> str:
    lines = [f"{report['num_requests']:,} requests over {report['cells']} cells "
             f"({report['rate_per_cell']:g} req/s per cell"
             f"{'; every cell streams' if report.get('streamed') else ''})",
             f"  {'workers':>7} {'wall s':>9} {'speed-up':>8} {'CPU s':>8} {'parent MB':>10} "
             f"{'worker MB':>10} {'attainment':>10}"]
    for r in report["runs"]:
        lines.append(f"  {r['workers']:>7} {r['wall_time_s']:>9.1f} {r['speedup']:>7.2f}x "
                     f"{r.get('cpu_s', math.nan):>8.1f} "
                     f"{r['parent_peak_rss_mb']:>10.0f} {r['worker_peak_rss_mb']:>10.0f} "
                     f"{100 * r['slo_attainment']:>9.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.cells", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                   help=f"requests over all cells (default {DEFAULT_NUM_REQUESTS:,}; the "
                        f"issue's figure is 10000000)")
    p.add_argument("--cells", type=int, default=16)
    p.add_argument("--workers", default="1,2", help="worker counts to time (default 1,2)")
    p.add_argument("--rate-per-cell", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true",
                   help="every cell streams its records (sim.runs.cells.stream): the parent holds "
                        "aggregates, not records")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # one run, as JSON
    args = p.parse_args(argv)
    try:
        workers = [int(x) for x in args.workers.split(",")]
    except ValueError:
        p.error(f"--workers {args.workers!r}: expected comma-separated integers")
    if min(workers) < 1 or args.num_requests < 1 or args.cells < 1:
        p.error("--workers, --num-requests and --cells must be >= 1")
    if args.one:
        print(json.dumps(run_once(args.num_requests, args.cells, workers[0],
                                  args.rate_per_cell, args.seed, args.stream)))
        return 0
    report = run(args.num_requests, args.cells, workers, args.rate_per_cell, args.seed,
                 args.stream)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
