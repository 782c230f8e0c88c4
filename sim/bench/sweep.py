"""Benchmark of the paper's full serving sweep run in parallel: wall time and speed-up.

The sweep is the paper's six configurations (``sim.paper.experiments.CONFIGS``) x its two workloads x 19
rates (evenly spaced over each workload's swept range in the ``paper`` profile) x 3 seeds =
684 simulations of the profile's request count each. It runs once per worker count (a process
pool, or Ray with ``--ray``; a local Ray cluster's start-up is timed with its run), checks that
every run gives the same summaries, and reports wall time and speed-up over the first count:

    python -m sim.bench.sweep --workers 1,2 [--ray [ADDRESS]] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

NUM_RATES = 19
NUM_SEEDS = 3


def paper_jobs(num_rates: int = NUM_RATES, num_seeds: int = NUM_SEEDS,
               num_requests: int | None = None) -> list[tuple]:
    """(config, rate, seed) of every point of the paper's full sweep."""
    from sim.paper.experiments import CONFIGS, WORKLOADS, serving_config, sweep_settings

    jobs = []
    for workload in WORKLOADS:
        opts = sweep_settings(workload, quick=False)
        rates = np.linspace(min(opts["rates"]), max(opts["rates"]), num_rates).round(6)
        n = num_requests or opts["num_requests"]
        for name in CONFIGS:
            config = serving_config(name, workload).replace(**{"workload.num_requests": n})
            jobs += [(config, float(r), s) for r in rates for s in range(num_seeds)]
    return jobs


def run(workers=(1, 2), ray_address: str | None = None, num_rates: int = NUM_RATES,
        num_seeds: int = NUM_SEEDS, num_requests: int | None = None,
        progress: bool = True) -> dict:
    from sim.runs.sweep import _run_point, run_parallel
    from traces.jsonout import dumps

    jobs = paper_jobs(num_rates, num_seeds, num_requests)
    rows, reference = [], None
    for count in workers:
        wall = time.perf_counter()
        points = run_parallel(_run_point, jobs, count, progress, ray_address,
                              desc=f"{count} worker(s)")
        wall = time.perf_counter() - wall
        if ray_address == "local":          # the next count starts its own local cluster
            import ray

            ray.shutdown()
        same = [dumps({k: v for k, v in p.summary.items() if k != "sim_wall_time_s"})
                for p in points]
        reference = reference or same
        rows.append({"workers": count, "wall_s": wall, "identical": same == reference})
    for row in rows:
        row["speedup"] = rows[0]["wall_s"] / row["wall_s"]
    return {"num_simulations": len(jobs), "shape": f"6 configurations x 2 workloads x "
            f"{num_rates} rates x {num_seeds} seeds", "engine": "ray" if ray_address else
            "process pool", "runs": rows}


def format_report(report: dict) -> str:
    lines = [f"paper sweep: {report['shape']} = {report['num_simulations']} simulations, "
             f"{report['engine']}"]
    for r in report["runs"]:
        lines.append(f"  {r['workers']} worker(s): {r['wall_s']:8.1f} s wall, speed-up "
                     f"{r['speedup']:.2f}x, results identical to the first: {r['identical']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="worker counts to time (default 1,2)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS")
    p.add_argument("--rates", type=int, default=NUM_RATES)
    p.add_argument("--seeds", type=int, default=NUM_SEEDS)
    p.add_argument("--num-requests", type=int, help="per simulation (default: the profile's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        workers = tuple(int(x) for x in args.workers.split(","))
        if min(workers) < 1 or args.rates < 1 or args.seeds < 1:
            raise ValueError
    except ValueError:
        print(f"{p.prog}: error: --workers, --rates and --seeds take integers >= 1",
              file=sys.stderr)
        return 2
    report = run(workers, args.ray, args.rates, args.seeds, args.num_requests,
                 progress=not args.json)
    if args.json:
        from traces.jsonout import dumps

        print(dumps(report))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
