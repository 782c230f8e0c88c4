"""``hawk paper``: reproduce the paper's figures and tables with the ``paper`` profile.

    hawk paper                 full settings; prints the comparison table
    hawk paper --quick         reduced settings (fewer rates, requests and seeds)
    hawk paper --json          one JSON object (knees, throughput_at_knee, efficiency, fig9, table1)
    hawk paper --out DIR       also writes DIR/report.md and the PNG plots
    hawk paper --sensitivity   each fitted parameter across its bounds: how far every figure
                               moves (sim/profiles/paper_sensitivity.toml, then the report's)
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from sim.commands.args import add_max_wall, add_workers, announce
from traces.jsonout import dumps, writable_dir


def add_parser(sub) -> None:
    p = sub.add_parser("paper", help="reproduce the paper's results (paper profile)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", type=Path, help="write report.md and plots into this folder")
    p.add_argument("--quick", action="store_true", help="reduced settings (for CI)")
    p.add_argument("--sensitivity", action="store_true",
                   help="move each fitted parameter alone to either bound, measure every "
                        "figure's move, write sim/profiles/paper_sensitivity.toml (the "
                        "report's sensitivity table) and stop")
    add_workers(p, "parallel processes for the sweeps")
    add_max_wall(p)
    p.set_defaults(func=run)


def _announce(args) -> None:
    """The reproduction's estimate: every configuration's sweep of every workload, the
    searches for knees between swept rates of the paper's grid (at most, where the widest gap
    holds the knee) and the bisections of the numbered knees, one run per worker at a time."""
    from sim.paper.checks import TARGETS
    from sim.paper.experiments import CONFIGS, WORKLOADS, sweep_settings
    from sim.paper.knees import BISECTION_STEPS, grid_index

    runs, per_run = 0, 0
    for workload in WORKLOADS:
        opts = sweep_settings(workload, args.quick)
        ks = sorted(grid_index(r) for r in opts["rates"])
        gap = max((b - a for a, b in zip(ks, ks[1:])), default=1)
        search = len(CONFIGS) * math.ceil(math.log2(gap))
        bisect = len(TARGETS["knees"][workload]) * BISECTION_STEPS
        runs += (len(CONFIGS) * len(opts["rates"]) + search + bisect) * len(opts["seeds"])
        per_run = max(per_run, opts["num_requests"])
    announce("hawk paper", per_run, args.max_wall_s, copies_in_turn=runs,
             in_parallel=args.workers or os.cpu_count() or 1, quiet=args.json,
             what=f"the paper's {runs} runs")


def _clean(value):
    """JSON-safe: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def run(args) -> int:
    from sim.paper.experiments import run_paper
    from sim.paper import report

    if args.sensitivity:
        return _sensitivity(args)
    if args.out is not None:
        writable_dir(args.out)
    _announce(args)
    say = (lambda text: None) if args.json else (
        lambda text: print(f"hawk paper: {text}", file=sys.stderr, flush=True))
    result = run_paper(quick=args.quick, workers=args.workers, say=say)
    if args.out is not None:
        report.write_report(result, args.out)
    if args.json:
        print(dumps(_clean(result)))
        return 0
    print(report.text(result))
    if args.out is not None:
        print(f"report: {args.out / 'report.md'}")
    return 0


def _sensitivity(args) -> int:
    """``--sensitivity``: the table on the fit's reduced sweeps, written beside the profile."""
    from sim.paper import sensitivity as sens
    from sim.paper.calibrate import PROFILE_DIR

    result = sens.sensitivity("paper", workers=args.workers or 2)
    path = PROFILE_DIR / "paper_sensitivity.toml"
    path.write_text(sens.to_toml(result))
    if args.json:
        print(dumps(_clean(result)))
    else:
        print("\n".join(sens.sensitivity_markdown(sens.load("paper"))))
        print(f"wrote {path}")
    return 0
