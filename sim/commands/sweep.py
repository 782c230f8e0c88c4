"""``hawk sweep``: SLO attainment over a range of rates (``sim.runs.sweep``), the table it
prints, the knee and an optional plot."""

from __future__ import annotations

from pathlib import Path

from sim.commands.args import (add_common, add_max_wall, add_profile, add_ray, add_workers,
                               announce, config_from_args, fraction, whole_number)


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="SLO attainment over a range of rates, and the knee")
    add_common(p)
    p.add_argument("--rates", default="0.1:1.0:0.05", help="start:stop:step or a,b,c (req/s)")
    p.add_argument("--seeds", type=whole_number("--seeds"), default=1,
                   help="seeds per rate (default 1)")
    p.add_argument("--target", type=fraction("--target"), default=0.9,
                   help="attainment target, in (0, 1] (default 0.9)")
    add_workers(p)
    add_ray(p, "the points")
    p.add_argument("--plot", type=Path, help="write a PNG of attainment and latencies vs rate")
    add_profile(p)
    add_max_wall(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.config import ConfigError, provenance
    from sim.config.run_size import check_sweep_size
    from sim.runs.sweep import parse_rates, plot_sweep, summarize_sweep, sweep
    from traces.jsonout import dumps, writable_file

    config = config_from_args(args)
    if config.workload.trace is not None:
        raise ConfigError(f"workload.trace = {config.workload.trace!r}: a sweep varies the "
                          f"Poisson rate, which a trace's own arrivals replace; sweep "
                          f"'hawk simulate --trace ... --rate-scale' instead")
    rates = parse_rates(args.rates)
    check_sweep_size(config, rates, args.seeds, args.workers)
    _announce(args, config, rates)
    if args.plot is not None:
        writable_file(args.plot, "--plot")
    seeds = range(config.seed, config.seed + args.seeds)
    points = sweep(config, rates, seeds, workers=args.workers, progress=not args.json,
                   ray_address=args.ray)
    summary = summarize_sweep(points, args.target)
    summary["config"] = provenance(config)      # the swept config; each point sets rate, seed
    if args.plot is not None:
        plot_sweep(summary, args.plot, title=f"{config.workload.name}: {config.cluster.prefill.device}"
                                              f" -> {config.cluster.decode.device}",
                   slo=(config.slo.ttft_s, config.slo.tpot_s))
    print(dumps(summary) if args.json else format_sweep(summary))
    if args.plot is not None and not args.json:
        print(f"plot written to {args.plot}")
    return 0


def _announce(args, config, rates) -> None:
    """The sweep's estimate: points x requests at the mean rate, one point per worker at a
    time; refused past ``--max-wall-s``."""
    import dataclasses
    import os

    from sim.config.run_size import expected_num_requests, run_bytes

    points = len(rates) * args.seeds
    mean_rate = sum(rates) / len(rates)
    per_point = expected_num_requests(dataclasses.replace(config.workload, rate=mean_rate))
    workers = min(points, args.workers or os.cpu_count() or 1)
    announce("hawk sweep", per_point, args.max_wall_s, copies_in_turn=points,
             in_parallel=workers, peak_bytes=workers * run_bytes(per_point), quiet=args.json,
             what=f"the sweep of {points:,} points")


def format_sweep(summary: dict) -> str:
    """The sweep's table, one row per rate, then the knee and what failed."""
    from sim.commands.simulate import percent
    from sim.runs.sweep import describe_knee
    from traces import metrics

    lines = [f"{'rate':>8} {'attainment':>11} {'P90 TTFT s':>11} {'P90 TPOT s':>11} "
             f"{'tok/s':>9} {'prefill':>8} {'link':>5} {'slots':>7} {'failed':>7}"]
    for r in summary["rows"]:
        lines.append(f"{r['rate']:>8g} {100 * r['slo_attainment']:>10.1f}% {r['ttft_p90_s']:>11.3f} "
                     f"{r['tpot_p90_s']:>11.4f} {r['output_tokens_per_s']:>9.1f} "
                     f"{percent(r['prefill_utilization']):>8} {percent(r['link_utilization']):>5} "
                     f"{percent(r['decode_occupancy']):>7} {r['num_failed']:>7.1f}")
    lines.append(describe_knee(summary))
    for k, reason in enumerate(metrics.failure_reasons(summary["statuses"])):
        lines.append(("failures over the sweep: " if k == 0 else " " * 24) + reason)
    return "\n".join(lines)
