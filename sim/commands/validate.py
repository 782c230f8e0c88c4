"""``hawk validate --profile DIR --trace FILE``: the real mode (or, with ``--endpoint URL``, a
live engine such as vLLM) against the simulator on a measured profile
(``sim.validation.run.validate``), printed as a report, JSON or CDF plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from traces.workloads import WORKLOADS

    p = sub.add_parser("validate", help="the real mode vs the simulator on a measured "
                       "profile, on the same requests at a light load and near the knee")
    p.add_argument("--profile", type=Path, required=True,
                   help="a hawk real profile (or hawk profile --endpoint) directory")
    p.add_argument("--endpoint", help="validate against this live engine (a profile of hawk "
                   "profile --endpoint) instead of the real mode")
    p.add_argument("--prompt-token-ids", metavar="LOW:HIGH", default="3:1000",
                   help="with --endpoint: prompt token ids in [LOW, HIGH) (default 3:1000)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file, or a bundled name (azure-llm-2023-conv.csv)")
    src.add_argument("--workload", choices=sorted(WORKLOADS),
                     help="synthetic requests: the workload's lengths, Poisson arrivals")
    p.add_argument("--rates", default="light,knee",
                   help="loads: light, knee, or req/s, comma-separated (default light,knee)")
    p.add_argument("--rate", type=float, action="append",
                   help="a load in req/s (repeatable; replaces --rates)")
    p.add_argument("--num-requests", type=_positive, default=100,
                   help="requests per load (default 100)")
    p.add_argument("--mechanism", help="transfer mechanism (default GN-HAWK if measured)")
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO, s (default: from the profile)")
    p.add_argument("--tpot-slo", type=float, help="TPOT SLO, s (default: from the profile)")
    p.add_argument("--seed", type=int, default=0, help="seed of --workload's requests")
    p.add_argument("--out", type=Path, help="write paired records and validate.json here")
    p.add_argument("--plot", type=Path, help="write a PNG of TTFT/TPOT/E2E CDFs, real vs sim")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from sim.commands.args import add_max_wall

    add_max_wall(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from hardware.serve.cluster import ClusterError
    from sim.validation import errors as val
    from sim.validation.run import context_of, load_requests, read_profile, validate
    from traces.jsonout import dumps, writable_dir, writable_file

    if args.out is not None:
        writable_dir(args.out)
    if args.plot is not None:
        writable_file(args.plot, "--plot")
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        raise ValueError("give both --ttft-slo and --tpot-slo, or neither")
    from sim.commands.args import announce

    rates = ",".join(str(r) for r in args.rate) if args.rate else args.rates
    loads = len([r for r in rates.split(",") if r.strip()])
    announce("hawk validate (simulated side)", args.num_requests, args.max_wall_s,
             copies_in_turn=loads, quiet=args.json, what="the simulated side")
    doc = read_profile(args.profile)
    requests = load_requests(args.trace, args.workload, args.num_requests, context_of(doc),
                             args.seed)
    say = (lambda text: None) if args.json else (lambda text: print(text, file=sys.stderr))
    slos = None if args.ttft_slo is None else (args.ttft_slo, args.tpot_slo)
    try:
        result, frames = validate(args.profile, requests, rates, mechanism=args.mechanism,
                                  slos=slos, out=args.out, progress=not args.json, say=say,
                                  endpoint=args.endpoint, token_ids=_token_ids(args))
    except ClusterError as e:
        print(f"hawk validate: the real mode did not start: {e}", file=sys.stderr)
        return 1
    if args.plot is not None:
        val.plot_cdfs(result, frames, args.plot)
    print(dumps(result) if args.json else val.format_result(result))
    if args.out is not None and not args.json:
        print(f"paired records per load and validate.json written to {args.out}/")
    return 0


def _token_ids(args) -> tuple[int, int]:
    low, _, high = args.prompt_token_ids.partition(":")
    try:
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"--prompt-token-ids takes LOW:HIGH, got {args.prompt_token_ids!r}") \
            from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-requests {text!r}: a whole number >= 2") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"--num-requests {n}: need >= 2")
    return n
