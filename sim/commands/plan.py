"""``hawk plan``: the cheapest and the most power-efficient cluster that meet the SLOs at a
rate (``sim.runs.capacity``), from flags naming the space to search; with ``--map PNG``, the
same search over ``--rates`` and ``--workloads``: which deployment wins where
(``sim.runs.paymap``)."""

from __future__ import annotations

from pathlib import Path

from sim.commands.args import (add_common, add_max_wall, add_ray, add_workers, announce,
                               config_from_args, fraction, whole_number)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the cheapest and the most power-efficient cluster that "
                       "meet the SLOs at a rate, aggregated or disaggregated, with a verdict, "
                       "and the cost/goodput Pareto frontier")
    add_common(p)
    p.add_argument("--rate", type=float, help="the load to plan for, req/s (required "
                   "without --map)")
    p.add_argument("--slo", metavar="TTFT_S,TPOT_S", help="SLOs (default: the workload's)")
    p.add_argument("--target", type=fraction("--target"), default=0.9,
                   help="attainment target, in (0, 1] (default 0.9)")
    p.add_argument("--catalog", type=Path, help="TOML of host/NIC prices, amortisation and "
                   "energy price laid over the profile's [cost] table (sim.models.cost)")
    p.add_argument("--prefill-devices", help="comma-separated (default: every GPU timed)")
    p.add_argument("--decode-devices", help="comma-separated (default: every device timed)")
    p.add_argument("--tp", default="1,2,4,8", help="TP degrees to try (default 1,2,4,8)")
    p.add_argument("--batch-sizes", help="decode max batch sizes (default: the device's)")
    p.add_argument("--mechanisms", help="transfer mechanisms (default: all that apply)")
    p.add_argument("--aggregated-devices", help="comma-separated devices of aggregated "
                   "candidates (default: every device timed)")
    p.add_argument("--deployments", default="aggregated,disaggregated",
                   help="deployments searched (default: aggregated,disaggregated)")
    p.add_argument("--max-instances", type=whole_number("--max-instances"), default=8, help="per phase (default 8)")
    p.add_argument("--max-candidates", type=whole_number("--max-candidates"), default=24,
                   help="configurations simulated at the rate, at most (default 24)")
    p.add_argument("--max-knees", type=whole_number("--max-knees"), default=6,
                   help="of which knees are bisected, meeting the target first (default 6)")
    add_workers(p)
    add_ray(p)
    p.add_argument("--plot", type=Path, help="write a PNG of the frontier")
    p.add_argument("--map", type=Path, metavar="PNG", help="plan at every rate of --rates "
                   "and workload of --workloads; print which deployment wins each point on "
                   "cost and on energy, with the margin, and draw the map to PNG (no knees "
                   "are bisected: they do not change a verdict)")
    p.add_argument("--rates", help="the map's rates, req/s: a list (1,2,4) or "
                   "start:stop:step (default 1,2,4)")
    p.add_argument("--workloads", help="the map's workloads, comma-separated (default "
                   "chatbot,summarization,code)")
    add_max_wall(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.config import ConfigError
    from sim.runs import capacity as pl
    from traces.jsonout import dumps, writable_file

    if args.slo is not None:
        try:
            args.ttft_slo, args.tpot_slo = (float(x) for x in args.slo.split(","))
        except ValueError:
            raise ConfigError(f"--slo {args.slo!r}: expected TTFT_S,TPOT_S (e.g. 2,0.2)") from None
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target must be in (0, 1], got {args.target}")
    if args.map is not None or args.rates is not None or args.workloads is not None:
        return _run_map(args)
    if args.rate is None:
        raise ConfigError("--rate is required (the load to plan for, req/s), or --map PNG "
                          "for the map over --rates and --workloads")
    if not args.rate > 0:
        raise ConfigError(f"--rate must be > 0 req/s, got {args.rate}")
    config = _base_config(args)
    if args.plot is not None:
        writable_file(args.plot, "--plot")
    space = _space(args)
    _announce(args, config)
    result = pl.plan(config, args.rate, args.target, space, pl.load_costs(args.catalog),
                     args.workers, progress=not args.json, ray_address=args.ray)
    if args.plot is not None:
        pl.plot_plan(result, args.plot)
    print(dumps(result) if args.json else pl.format_plan(result))
    return 0


def _run_map(args) -> int:
    """``--map PNG``: the planner's verdict at every (workload, rate), printed and drawn."""
    from sim.config import ConfigError
    from sim.runs import paymap as pm
    from sim.runs.capacity import load_costs
    from sim.runs.plan_report import format_map, plot_map
    from sim.runs.sweep import parse_rates
    from traces.jsonout import dumps, writable_file

    if args.map is None:
        raise ConfigError(f"{'--rates' if args.rates is not None else '--workloads'} "
                          f"needs --map PNG (one plan takes --rate and --workload)")
    for flag, value, why in (("--rate", args.rate, "the map takes --rates"),
                             ("--workload", args.workload, "the map takes --workloads"),
                             ("--plot", args.plot, "a map has no single plan's frontier")):
        if value is not None:
            raise ConfigError(f"{flag} with --map: {why}")
    rates = parse_rates(args.rates) if args.rates is not None else pm.DEFAULT_RATES
    workloads = (pm.parse_workloads(args.workloads) if args.workloads is not None
                 else pm.DEFAULT_WORKLOADS)
    writable_file(args.map, "--map")
    slo = None                            # each workload's own SLOs, unless both are given
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        raise ConfigError("--ttft-slo/--tpot-slo with --map: give both (or --slo TTFT_S,TPOT_S)"
                          " to set one pair for every workload")
    if args.ttft_slo is not None:
        slo = (args.ttft_slo, args.tpot_slo)
    config, space = _base_config(args), pm.map_space(_space(args))
    _announce_map(args, config, space, len(rates) * len(workloads), max(rates))
    rows = pm.paymap(config, workloads, rates, args.target, space, load_costs(args.catalog),
                     slo, args.workers, progress=not args.json, ray_address=args.ray)
    plot_map(rows, args.map)
    print(dumps(rows) if args.json else format_map(rows))
    if not args.json:
        print(f"map written to {args.map}")
    return 0


def _announce_map(args, config, space, num_points: int, top_rate: float) -> None:
    """The map's estimate, at most: every point's plan (``plan_runs_at_most``), one point per
    worker at a time."""
    import os

    from sim.config.run_size import expected_num_requests, run_bytes
    from sim.runs.paymap import plan_runs_at_most

    per_run = expected_num_requests(config.replace(**{"workload.rate": top_rate}).workload)
    runs = num_points * plan_runs_at_most(space)
    workers = min(args.workers or os.cpu_count() or 1, num_points)
    announce("hawk plan --map", per_run, args.max_wall_s, copies_in_turn=runs,
             in_parallel=workers, peak_bytes=workers * run_bytes(per_run), quiet=args.json,
             what=f"the map's {num_points} points ({runs} runs at most)")


def _space(args):
    from sim.models.transfer import MECHANISMS
    from sim.runs import capacity as pl

    return pl.Space(prefill_devices=_names(args.prefill_devices),
                     decode_devices=_names(args.decode_devices),
                     tps=tuple(_ints(args.tp, "--tp")),
                     decode_batch_sizes=_ints(args.batch_sizes, "--batch-sizes"),
                     mechanisms=_names(args.mechanisms, MECHANISMS, "--mechanisms"),
                     aggregated_devices=_names(args.aggregated_devices),
                     deployments=_names(args.deployments, pl.DEPLOYMENTS, "--deployments"),
                     max_instances=args.max_instances, max_candidates=args.max_candidates,
                     max_knees=args.max_knees)


def _base_config(args):
    """The run configuration the candidates vary. A ``--model`` the TT stack does not run
    (``ModelSpec.npu_refusal``) cannot keep an NPU decode side: the base then decodes on the
    first GPU of ``--decode-devices`` (none given: the prefill device), and the NPU candidates
    are pruned as invalid."""
    import argparse

    from hardware import catalog
    from sim.config import ConfigError

    if args.model is None:
        return config_from_args(args)
    try:
        refusal = catalog.model(args.model).npu_refusal
    except ValueError as exc:
        raise ConfigError(f"--model: {exc}") from None
    config = config_from_args(argparse.Namespace(**{**vars(args), "model": None}))
    changes = {"cluster.model": args.model}
    if refusal and catalog.device(config.cluster.decode.device).kind == "npu":
        gpus = [d for d in _names(args.decode_devices) or (config.cluster.prefill.device,)
                if catalog.device(d).kind == "gpu"]
        if not gpus:
            raise ConfigError(f"--model {args.model}: {refusal}; pass --decode-devices with "
                              f"a GPU to plan it")
        changes.update({"cluster.decode.device": gpus[0], "cluster.link.mechanism": "GG-Direct",
                        "cluster.decode.kv_dtype": config.cluster.prefill.kv_dtype})
    return config.replace(**changes)


def _announce(args, config) -> None:
    """The plan's estimate, at most: every candidate at the rate, the other mechanisms on the
    cheapest, and each knee's bisections, one run per worker at a time."""
    import os

    from sim.config.run_size import expected_num_requests, run_bytes
    from sim.models.transfer import MECHANISMS
    from sim.runs.capacity import BISECTION_STEPS

    per_run = expected_num_requests(config.replace(**{"workload.rate": args.rate}).workload)
    runs = args.max_candidates + len(MECHANISMS) + args.max_knees * BISECTION_STEPS
    workers = args.workers or os.cpu_count() or 1
    announce("hawk plan", per_run, args.max_wall_s, copies_in_turn=runs, in_parallel=workers,
             peak_bytes=workers * run_bytes(per_run), quiet=args.json,
             what=f"the plan's {runs} runs at most")


def _names(text, allowed=None, flag=""):
    from sim.config import ConfigError

    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if allowed is not None and n not in allowed]
    if bad or not names:
        raise ConfigError(f"{flag} {text!r}: choose from {sorted(allowed or [])}")
    return names


def _ints(text, flag):
    from sim.config import ConfigError

    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: values must be >= 1")
    return values
