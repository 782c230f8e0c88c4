"""``hawk paper``: reproduce the paper's figures and tables with the ``paper`` profile.

    hawk paper                 full settings; prints the comparison table
    hawk paper --quick         reduced settings (fewer rates, requests and seeds)
    hawk paper --json          one JSON object (knees, throughput_at_knee, efficiency, fig9, table1)
    hawk paper --out DIR       also writes DIR/report.md and the PNG plots
"""

from __future__ import annotations

import math
from pathlib import Path

from traces.jsonout import dumps, writable_dir


def add_parser(sub) -> None:
    p = sub.add_parser("paper", help="reproduce the paper's results (paper profile)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", type=Path, help="write report.md and plots into this folder")
    p.add_argument("--quick", action="store_true", help="reduced settings (for CI)")
    p.add_argument("--workers", type=int, help="parallel processes for the sweeps")
    p.set_defaults(func=run)


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

    if args.out is not None:
        writable_dir(args.out)
    result = run_paper(quick=args.quick, workers=args.workers)
    if args.out is not None:
        report.write_report(result, args.out)
    if args.json:
        print(dumps(_clean(result)))
        return 0
    print(report.text(result))
    if args.out is not None:
        print(f"report: {args.out / 'report.md'}")
    return 0
