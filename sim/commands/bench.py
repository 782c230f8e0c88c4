"""``hawk bench``: the simulator's speed against bare SimPy, measured in the same run
(``sim.bench.speed``), as a report or one JSON object."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="simulator speed vs bare SimPy, measured in the same run")
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--rate", type=float, help="arrival rate (default: the knee, found first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--memory-requests", type=int, default=1_000_000,
                   help="requests of the peak-memory runs, in memory and streamed "
                        "(default 1,000,000; 0 skips them)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a target is missed (default: a report, exit 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.bench import speed as bench
    from sim.commands.args import announce
    from sim.config import ConfigError
    from traces.jsonout import dumps

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_requests < 0:
        raise ConfigError(f"--memory-requests must be >= 0, got {args.memory_requests}")
    # per repeat: 3 P/D runs, and for each of the 2 aggregated clusters 2 runs and a P/D one
    announce("hawk bench", args.num_requests, None, copies_in_turn=9 * args.repeats,
             quiet=args.json)
    if args.memory_requests and not args.json:
        announce("hawk bench: then the memory probes", args.memory_requests, None,
                 copies_in_turn=2)
    report = bench.run(num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                       repeats=args.repeats, memory_requests=args.memory_requests)
    print(dumps(report) if args.json else bench.format_report(report))
    return 1 if args.strict and report["targets_missed"] else 0
