"""The ``hawk`` command line.

    hawk simulate            the paper's Chatbot scenario (GPU prefill, NPU decode), a summary
    hawk sweep --rates A:B:S SLO attainment over rates, in parallel, and the knee
    hawk bench               simulator speed against bare SimPy, measured in the same run

Other command groups (trace replay, the real mode) register themselves when installed. The
shared flags are in ``sim.commands.args``, ``hawk simulate`` in ``sim.commands.simulate``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from traces import metrics
from sim.commands.args import _add_common, _add_profile, _config_from_args
from sim.commands.simulate import _percent, cmd_simulate
from sim.config import ConfigError, load_config
from sim.models.transfer import MECHANISMS
from traces.jsonout import dumps, writable_dir, writable_file
from traces.workloads import WORKLOADS

EXTRA_COMMANDS = ("traces.commands", "hardware.commands", "sim.commands.paper",
                  "sim.validation.run")


def cmd_sweep(args) -> int:
    from sim.runs.sweep import describe_knee, parse_rates, plot_sweep, summarize_sweep, sweep

    config = _config_from_args(args)
    if config.workload.trace is not None:
        raise ConfigError(f"workload.trace = {config.workload.trace!r}: a sweep varies the "
                          f"Poisson rate, which a trace's own arrivals replace; sweep "
                          f"'hawk simulate --trace ... --rate-scale' instead")
    rates = parse_rates(args.rates)
    from sim.config.run_size import check_sweep_size

    check_sweep_size(config, rates, args.seeds, args.workers)
    if args.plot is not None:
        writable_file(args.plot, "--plot")
    seeds = range(config.seed, config.seed + args.seeds)
    points = sweep(config, rates, seeds, workers=args.workers, progress=not args.json,
                   ray_address=args.ray)
    summary = summarize_sweep(points, args.target)
    from sim.config import provenance

    summary["config"] = provenance(config)      # the swept config; each point sets rate, seed
    if args.plot is not None:
        plot_sweep(summary, args.plot, title=f"{config.workload.name}: {config.cluster.prefill.device}"
                                              f" -> {config.cluster.decode.device}")
    if args.json:
        print(dumps(summary))
        return 0
    print(f"{'rate':>8} {'attainment':>11} {'P90 TTFT s':>11} {'P90 TPOT s':>11} {'tok/s':>9}"
          f" {'prefill':>8} {'link':>5} {'slots':>7} {'failed':>7}")
    for r in summary["rows"]:
        print(f"{r['rate']:>8g} {100 * r['slo_attainment']:>10.1f}% {r['ttft_p90_s']:>11.3f} "
              f"{r['tpot_p90_s']:>11.4f} {r['output_tokens_per_s']:>9.1f} "
              f"{_percent(r['prefill_utilization']):>8} {_percent(r['link_utilization']):>5} "
              f"{_percent(r['decode_occupancy']):>7} {r['num_failed']:>7.1f}")
    print(describe_knee(summary))
    for k, reason in enumerate(metrics.failure_reasons(summary["statuses"])):
        print(("failures over the sweep: " if k == 0 else " " * 24) + reason)
    return 0


def cmd_compare(args) -> int:
    from sim.runs import compare as cmp

    limits = cmp.load_limits(args.limits) if args.limits else cmp.Limits()
    if args.out is not None:
        writable_dir(args.out)
    if args.baseline.suffix == ".toml" or args.candidate.suffix == ".toml":
        runs, slo, head = _compare_simulated(args, cmp)
    else:                                   # recorded runs: real mode or replay
        if args.trace or args.workload:
            raise ConfigError("recorded runs already hold their requests; --trace and "
                              "--workload are for two .toml configurations")
        runs = [(cmp.load_recorded(args.baseline), cmp.load_recorded(args.candidate))]
        base = runs[0][0][1]
        slo = (args.ttft_slo or base.get("ttft_slo_s") or 2.0,
               args.tpot_slo or base.get("tpot_slo_s") or 0.2)
        head = f"recorded runs {args.baseline} vs {args.candidate}, paired by request id"
    result = cmp.compare(runs, *slo, limits, seed=args.seed or 0)
    result["inputs"] = head
    if args.out is not None:
        cmp.write_outputs(args.out, runs, result)
    if args.json:
        print(dumps(result))
    else:
        print(head)
        print(cmp.format_result(result))
        if args.out is not None:
            print(f"records of both arms, comparison.json and regressed.csv written to "
                  f"{args.out}/")
    return 0


def _compare_simulated(args, cmp):
    """Both configs' diff (refused if hidden), their inputs, and the paired runs."""
    baseline, candidate = load_config(args.baseline), load_config(args.candidate)
    diff = cmp.config_diff(baseline, candidate)
    vary = tuple(args.vary) if args.vary else cmp.POLICY_KEYS
    if not args.json:
        print(f"{args.baseline} -> {args.candidate} differ in:\n" + (cmp.format_diff(diff)
                                                                   if diff else "  nothing"))
    cmp.check_diff(diff, vary, args.allow_diff)
    if (args.trace is None) == (args.workload is None):
        raise ConfigError("give one of --trace FILE or --workload NAME")
    seed = args.seed or 0
    if args.trace is not None:
        from traces.loaders import load_trace

        trace, _ = load_trace(args.trace, max_requests=args.num_requests)
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
    runs = cmp.run_pairs(baseline, candidate, inputs, repeats, seed, args.workers,
                         progress=not args.json, ray_address=args.ray)
    return runs, (baseline.slo.ttft_s, baseline.slo.tpot_s), head


def cmd_plan(args) -> int:
    from sim.runs import capacity as pl

    if args.slo is not None:
        try:
            args.ttft_slo, args.tpot_slo = (float(x) for x in args.slo.split(","))
        except ValueError:
            raise ConfigError(f"--slo {args.slo!r}: expected TTFT_S,TPOT_S (e.g. 2,0.2)") from None
    if args.rate is None or not args.rate > 0:
        raise ConfigError(f"--rate must be > 0 req/s, got {args.rate}")
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target must be in (0, 1], got {args.target}")
    config = _config_from_args(args)
    if args.plot is not None:
        writable_file(args.plot, "--plot")
    space = pl.Space(prefill_devices=_names(args.prefill_devices),
                     decode_devices=_names(args.decode_devices),
                     tps=tuple(_ints(args.tp, "--tp")),
                     decode_batch_sizes=_ints(args.batch_sizes, "--batch-sizes"),
                     mechanisms=_names(args.mechanisms, MECHANISMS, "--mechanisms"),
                     max_instances=args.max_instances, max_candidates=args.max_candidates,
                     max_knees=args.max_knees)
    result = pl.plan(config, args.rate, args.target, space, pl.load_costs(args.catalog),
                     args.workers, progress=not args.json, ray_address=args.ray)
    if args.plot is not None:
        pl.plot_plan(result, args.plot)
    print(dumps(result) if args.json else pl.format_plan(result))
    return 0


def _names(text, allowed=None, flag=""):
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if allowed is not None and n not in allowed]
    if bad or not names:
        raise ConfigError(f"{flag} {text!r}: choose from {sorted(allowed or [])}")
    return names


def _ints(text, flag):
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: values must be >= 1")
    return values


def cmd_bench(args) -> int:
    from sim.bench import speed as bench

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_requests < 0:
        raise ConfigError(f"--memory-requests must be >= 0, got {args.memory_requests}")
    report = bench.run(num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                       repeats=args.repeats, memory_requests=args.memory_requests)
    print(dumps(report) if args.json else bench.format_report(report))
    return 0


def build_parser(extras: bool = True) -> argparse.ArgumentParser:
    """The ``hawk`` parser; ``extras``: also the commands of ``EXTRA_COMMANDS`` (imported to
    register them, which a built-in command's start-up need not pay for)."""
    parser = argparse.ArgumentParser(prog="hawk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="simulate one run (default: the paper's Chatbot scenario)")
    _add_common(p)
    p.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (default 0.5)")
    p.add_argument("--trace", type=Path, help="replay a trace file instead of Poisson arrivals; "
                   "a bare name may be a bundled trace: azure-llm-2023-conv.csv, "
                   "azure-llm-2023-code.csv (traces/data/)")
    p.add_argument("--trace-format", help="trace format (default: detected from the header)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream records to --out/records.parquet (a dataset of row groups) as "
                        "requests end and summarise from streaming aggregates, in bounded "
                        "memory (percentiles within 1%%); default: only runs over 1,000,000 "
                        "requests stream")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed trace rows, reported")
    p.add_argument("--rate-scale", type=float, metavar="FACTOR",
                   help="replay the trace FACTOR times as fast (2 = twice the request rate)")
    p.add_argument("--window", metavar="START:END",
                   help="seconds of the trace to keep (re-based to 0), before --rate-scale")
    p.add_argument("--oracle", action="store_true", help="iteration-by-iteration decode (slow)")
    p.add_argument("--show-config", action="store_true",
                   help="print every resolved setting and where it came from (the config "
                        "file, the device's default or the scenario's), then stop")
    p.add_argument("--out", type=Path, help="write records.parquet and summary.json here")
    p.add_argument("--cells", type=int, metavar="N",
                   help="simulate the cluster as N independent cells (router domains), the "
                        "requests split by a hash of their id ([cells] in the config)")
    p.add_argument("--cell-instances", choices=("split", "per-cell"),
                   help="split: the cluster's instances divided among the cells (default); "
                        "per-cell: every cell has the cluster's instances")
    p.add_argument("--workers", type=int, help="processes running cells (default: one per core)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run the cells on Ray: a local cluster, or the one at ADDRESS")
    _add_profile(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("sweep", help="SLO attainment over a range of rates, and the knee")
    _add_common(p)
    p.add_argument("--rates", default="0.1:1.0:0.05", help="start:stop:step or a,b,c (req/s)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per rate (default 1)")
    p.add_argument("--target", type=float, default=0.9, help="attainment target (default 0.9)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run the points on Ray: a local cluster, or the one at ADDRESS")
    p.add_argument("--plot", type=Path, help="write a PNG of attainment and latencies vs rate")
    _add_profile(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("compare", help="paired comparison of two configurations (or two "
                       "recorded runs) with bootstrap confidence intervals and a verdict")
    p.add_argument("--baseline", type=Path, required=True,
                   help="A.toml, or a recorded run (directory or records file)")
    p.add_argument("--candidate", type=Path, required=True,
                   help="B.toml, or a recorded run (directory or records file)")
    p.add_argument("--trace", type=Path, help="a trace file both arms replay")
    p.add_argument("--workload", choices=sorted(WORKLOADS) + ["bursty"],
                   help="a paper workload, or 'bursty': quiet customers beside a bursting one")
    p.add_argument("--rate", type=float, help="workload rate, req/s (default 0.5)")
    p.add_argument("--num-requests", type=int, help="requests per run")
    p.add_argument("--duration", type=float, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=5,
                   help="paired repeats on fresh arrivals (--workload; default 5)")
    p.add_argument("--seed", type=int, help="first repeat's seed (default 0)")
    p.add_argument("--vary", action="append", metavar="KEY",
                   help="a setting (or prefix) the configs may differ in (default: the "
                        "policies); repeatable")
    p.add_argument("--allow-diff", action="store_true", help="allow any other difference")
    p.add_argument("--limits", type=Path, help="TOML: improve = METRIC, [limits] METRIC = "
                   "worst allowed change, tenants, confidence")
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO for recorded runs")
    p.add_argument("--tpot-slo", type=float, help="TPOT SLO for recorded runs")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run on Ray: a local cluster, or the one at ADDRESS")
    p.add_argument("--out", type=Path, help="write both arms' records and the comparison here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="the cheapest and the most power-efficient cluster that "
                       "meet the SLOs at a rate, and the cost/goodput Pareto frontier")
    _add_common(p)
    p.add_argument("--rate", type=float, required=True, help="the load to plan for, req/s")
    p.add_argument("--slo", metavar="TTFT_S,TPOT_S", help="SLOs (default: the workload's)")
    p.add_argument("--target", type=float, default=0.9, help="attainment target (default 0.9)")
    p.add_argument("--catalog", type=Path, help="TOML of host/NIC prices, amortisation and "
                   "energy price laid over the profile's [cost] table (sim.models.cost)")
    p.add_argument("--prefill-devices", help="comma-separated (default: every GPU timed)")
    p.add_argument("--decode-devices", help="comma-separated (default: every device timed)")
    p.add_argument("--tp", default="1,2,4,8", help="TP degrees to try (default 1,2,4,8)")
    p.add_argument("--batch-sizes", help="decode max batch sizes (default: the device's)")
    p.add_argument("--mechanisms", help="transfer mechanisms (default: all that apply)")
    p.add_argument("--max-instances", type=int, default=8, help="per phase (default 8)")
    p.add_argument("--max-candidates", type=int, default=24,
                   help="configurations simulated at the rate, at most (default 24)")
    p.add_argument("--max-knees", type=int, default=6,
                   help="of which knees are bisected, meeting the target first (default 6)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run on Ray: a local cluster, or the one at ADDRESS")
    p.add_argument("--plot", type=Path, help="write a PNG of the frontier")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="simulator speed vs bare SimPy, measured in the same run")
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--rate", type=float, help="arrival rate (default: the knee, found first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--memory-requests", type=int, default=1_000_000,
                   help="requests of the peak-memory runs, in memory and streamed "
                        "(default 1,000,000; 0 skips them)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    for name in EXTRA_COMMANDS if extras else ():
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)
    if extras:
        from sim.commands import calibrate

        calibrate.add_parser(sub)
    return parser


BUILT_IN_COMMANDS = ("simulate", "sweep", "compare", "plan", "bench")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(extras=not (argv and argv[0] in BUILT_IN_COMMANDS))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"hawk {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()     # the reader (``| head``) has what it wanted
        return 0


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout is not a real file (e.g. captured in tests)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
