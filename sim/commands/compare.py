"""``hawk compare``: a paired comparison of two configurations, or of two recorded runs, with
bootstrap confidence intervals and a verdict (``sim.runs.compare``)."""

from __future__ import annotations

from pathlib import Path

from sim.commands.args import (add_max_memory, add_max_wall, add_ray, add_workers, announce,
                               whole_number)
from traces.trace_flags import add_columns_arg


def add_parser(sub) -> None:
    from traces.workloads import WORKLOADS

    p = sub.add_parser("compare", help="paired comparison of two configurations (or two "
                       "recorded runs) with bootstrap confidence intervals and a verdict")
    p.add_argument("--baseline", type=Path, required=True,
                   help="A.toml, or a recorded run (directory or records file)")
    p.add_argument("--candidate", type=Path, required=True,
                   help="B.toml, or a recorded run (directory or records file)")
    p.add_argument("--trace", type=Path, help="a trace file both arms replay")
    add_columns_arg(p)
    p.add_argument("--workload", choices=sorted(WORKLOADS) + ["bursty"],
                   help="a paper workload, or 'bursty': quiet customers beside a bursting one")
    p.add_argument("--rate", type=float, help="workload rate, req/s (default 0.5)")
    p.add_argument("--num-requests", type=int, help="requests per run")
    p.add_argument("--duration", type=float, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=whole_number("--repeats"), default=5,
                   help="paired repeats on fresh arrivals (--workload; default 5)")
    p.add_argument("--seed", type=int, help="first repeat's seed (default 0)")
    p.add_argument("--vary", action="append", metavar="KEY",
                   help="a setting (or prefix) the configs may differ in, or a group: "
                        "'policies' (the default) or 'deployment' (the cluster's shape: "
                        "aggregated vs disaggregated, devices, instances, link, routing; the "
                        "default where cluster.kind differs); repeatable")
    p.add_argument("--allow-diff", action="store_true", help="allow any other difference")
    p.add_argument("--limits", type=Path, help="TOML: improve = METRIC, [limits] METRIC = "
                   "worst allowed change, tenants, confidence")
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO for recorded runs")
    p.add_argument("--tpot-slo", type=float, help="TPOT SLO for recorded runs")
    add_workers(p)
    add_ray(p)
    p.add_argument("--out", type=Path, help="write both arms' records and the comparison here")
    p.add_argument("--json", action="store_true")
    add_max_wall(p)
    add_max_memory(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.config import ConfigError
    from sim.runs import compare as cmp
    from traces.jsonout import dumps, writable_dir

    limits = cmp.load_limits(args.limits) if args.limits else cmp.Limits()
    if args.out is not None:
        writable_dir(args.out)
    if args.baseline.suffix == ".toml" or args.candidate.suffix == ".toml":
        runs, slo, head, shapes = _compare_simulated(args, cmp)
        if shapes and args.limits is None:  # does the other deployment pay off?
            limits = cmp.DEPLOYMENT_LIMITS
    else:                                   # recorded runs: real mode or replay
        if args.trace or args.workload:
            raise ConfigError("recorded runs already hold their requests; --trace and "
                              "--workload are for two .toml configurations")
        runs, shapes = [(cmp.load_recorded(args.baseline), cmp.load_recorded(args.candidate))], None
        base = runs[0][0][1]
        slo = (args.ttft_slo or base.get("ttft_slo_s") or 2.0,
               args.tpot_slo or base.get("tpot_slo_s") or 0.2)
        head = f"recorded runs {args.baseline} vs {args.candidate}, paired by request id"
    result = cmp.compare(runs, *slo, limits, seed=args.seed or 0)
    result["inputs"] = head
    if args.baseline.suffix == ".toml" and shapes:
        result["deployments"] = dict(zip(("baseline", "candidate"), shapes))
    if args.out is not None:
        cmp.write_outputs(args.out, runs, result)
    if args.json:
        print(dumps(result))
    else:
        print(head)
        print(format_result(result))
        if args.out is not None:
            print(f"records of both arms, comparison.json and regressed.csv written to "
                  f"{args.out}/")
    return 0


def _compare_simulated(args, cmp):
    """Both configs' diff (refused if hidden), their inputs, and the paired runs."""
    from sim.config import ConfigError, load_config

    baseline, candidate = load_config(args.baseline), load_config(args.candidate)
    diff = cmp.config_diff(baseline, candidate)
    vary = cmp.allowed_keys(diff, tuple(args.vary) if args.vary else None)
    shapes = None
    if "cluster.kind" in vary:                  # a deployment comparison
        from sim.runs.verdict import describe

        shapes = (describe(baseline), describe(candidate))
    if not args.json:
        if shapes:
            print(format_deployments(*shapes))
            diff_shown = cmp.shared_differences(diff)
        print(f"{args.baseline} -> {args.candidate} differ in:\n" + (
            format_diff(diff_shown if shapes else diff) if diff else "  nothing"))
    cmp.check_diff(diff, vary, args.allow_diff)
    if (args.trace is None) == (args.workload is None):
        raise ConfigError("give one of --trace FILE or --workload NAME")
    seed = args.seed or 0
    if args.trace is not None:
        from traces.loaders import load_trace

        _check_trace_memory(args)
        trace, _ = load_trace(args.trace, mapping=args.columns, max_requests=args.num_requests)
        if args.num_requests is not None:
            trace = trace.head(args.num_requests)
        inputs = cmp.Inputs(trace=trace)
        head = f"trace {args.trace} ({len(trace)} requests), one run per arm"
    else:
        inputs = cmp.Inputs(workload=args.workload, rate=args.rate or 0.5,
                            num_requests=args.num_requests, duration_s=args.duration)
        head = (f"workload {args.workload} @ {inputs.rate:g} req/s, {args.repeats} repeats "
                f"(seeds {seed}..{seed + args.repeats - 1}), both arms on the same arrivals")
    repeats = 1 if args.trace is not None else args.repeats
    _announce(args, baseline, inputs, repeats)
    runs = cmp.run_pairs(baseline, candidate, inputs, repeats, seed, args.workers,
                         progress=not args.json, ray_address=args.ray)
    return runs, (baseline.slo.ttft_s, baseline.slo.tpot_s), head, shapes


def format_deployments(baseline: str, candidate: str) -> str:
    """The two deployments compared, one line each (same model, profile, SLOs, requests)."""
    return (f"comparing deployments on the same requests and seeds:\n"
            f"  baseline   {baseline}\n  candidate  {candidate}")


def _check_trace_memory(args) -> None:
    """Before ``--trace`` is loaded whole: its rows (estimated from its size, cut by
    ``--num-requests``) read, then both arms' runs, refused past ``--max-memory-gb`` and
    ``--max-wall-s`` (the estimate is printed once the trace is read, ``_announce``)."""
    import os

    from sim.config.run_size import (SECONDS_PER_TRACE_ROW, check_run_time, check_trace_load,
                                     run_bytes)
    from traces.trace_stream import estimate_rows

    rows = estimate_rows(args.trace)
    n = rows if args.num_requests is None else min(rows, args.num_requests)
    workers = min(2, args.workers or os.cpu_count() or 1)
    what = f"hawk compare --trace {args.trace.name} (about {rows:,} rows by its size)"
    check_trace_load(n, workers * run_bytes(n), args.max_memory_bytes, what,
                     "compare fewer requests (--num-requests)")
    check_run_time(n, args.max_wall_s, what, copies_in_turn=2, in_parallel=workers,
                   extra_s=n * SECONDS_PER_TRACE_ROW)


def _announce(args, baseline, inputs, repeats: int) -> None:
    """Both arms' estimate: 2 x repeats runs, one per worker at a time."""
    import dataclasses
    import os

    from sim.config.run_size import expected_num_requests, run_bytes

    if inputs.trace is not None:
        per_run = float(len(inputs.trace))
    elif inputs.workload == "bursty":
        per_run = inputs.rate * (inputs.duration_s or 1200.0)
        per_run = min(per_run, inputs.num_requests) if inputs.num_requests else per_run
    else:
        workload = dataclasses.replace(baseline.workload, rate=inputs.rate, trace=None)
        if inputs.num_requests is not None or inputs.duration_s is not None:
            workload = dataclasses.replace(workload, num_requests=inputs.num_requests,
                                           duration_s=inputs.duration_s)
        per_run = expected_num_requests(workload)
    workers = min(2 * repeats, args.workers or os.cpu_count() or 1)
    announce("hawk compare", per_run, args.max_wall_s, copies_in_turn=2 * repeats,
             in_parallel=workers, peak_bytes=workers * run_bytes(per_run), quiet=args.json,
             what=f"the comparison's {2 * repeats} runs")


def format_diff(diff) -> str:
    """The settings two configurations differ in, one per line: baseline -> candidate."""
    if not diff:
        return "  nothing beyond the pools above"
    width = max(len(k) for k, _, _ in diff)
    return "\n".join(f"  {k:<{width}}  {a!r} -> {b!r}" for k, a, b in diff)


def format_result(result: dict, top: int = 5) -> str:
    """The effects with their CIs, the verdict and its reasons, the most regressed requests."""
    conf = 100 * result["limits"]["confidence"]
    lines = [f"paired over {result['unit']}; difference = candidate - baseline, "
             f"{conf:g}% bootstrap CI",
             f"  {'metric':<34} {'baseline':>10} {'candidate':>10} {'difference':>11}  CI"]
    for key, e in result["effects"].items():
        lines.append(f"  {key:<34} {e['baseline']:>10.4g} {e['candidate']:>10.4g} "
                     f"{e['difference']:>+11.4g}  [{e['ci_low']:+.4g}, {e['ci_high']:+.4g}]")
    v = result["verdict"]
    lines.append(f"verdict: keep the {v['keep']} (improve {result['limits']['improve']}"
                 + (f"; limits {result['limits']['limits']})" if result['limits']['limits']
                    else ")"))
    lines += [f"  - {r}" for r in v["reasons"]]
    if not result["regressed"]:
        lines.append("no request got worse (first repeat)")
    else:
        lines.append(f"most regressed requests (first repeat, {len(result['regressed'])} "
                     f"saved):")
        for r in result["regressed"][:top]:
            who = f" [{r['tenant']}]" if "tenant" in r else ""
            lines.append(f"  request {r['request_id']}{who}: {r['status_baseline']} -> "
                         f"{r['status_candidate']}, TTFT {r['ttft_change_s']:+.3f} s, "
                         f"E2E {r['e2e_change_s']:+.3f} s")
    return "\n".join(lines)
