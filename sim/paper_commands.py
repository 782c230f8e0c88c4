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


def register(subparsers) -> None:
    p = subparsers.add_parser("paper", help="reproduce the paper's results (paper profile)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", type=Path, help="write report.md and plots into this folder")
    p.add_argument("--quick", action="store_true", help="reduced settings (for CI)")
    p.add_argument("--workers", type=int, help="parallel processes for the sweeps")
    p.set_defaults(func=handler)
    from sim import calibrate, devices_check

    calibrate.register(subparsers)
    devices_check.register(subparsers)


def _clean(value):
    """JSON-safe: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def handler(args) -> int:
    from sim.paper import run_paper
    from sim.report import comparison_rows, fit_text, write_report

    if args.out is not None:
        writable_dir(args.out)
    result = run_paper(quick=args.quick, workers=args.workers)
    if args.out is not None:
        write_report(result, args.out)
    if args.json:
        print(dumps(_clean(result)))
        return 0
    for what, ours, paper, err in comparison_rows(result):
        fmt = lambda x: "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"
        err_s = "n/a" if not math.isfinite(err) else f"{100 * err:+.1f}%"
        print(f"{what:55s} ours {fmt(ours):>9s}  paper {fmt(paper):>9s}  {err_s}")
    if result.get("free_parameters"):
        print("\n" + fit_text(result))
    rows = result["checks"]
    print(f"\n{sum(r['holds'] for r in rows)} of {len(rows)} claims of the paper's section 6 hold "
          f"({sum(r['fitted'] for r in rows)} fitted, {sum(not r['fitted'] for r in rows)} "
          f"predicted)")
    for r in rows:
        if not r["holds"]:
            print(f"  does not hold ({'fitted' if r['fitted'] else 'predicted'}): {r['check']}")
        elif r["fitted"] and not r.get("loo_holds", True):
            print(f"  holds as fitted, not when left out of the fit: {r['check']}")
    if args.out is not None:
        print(f"report: {args.out / 'report.md'}")
    return 0
