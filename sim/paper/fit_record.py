"""The record ``hawk calibrate`` writes beside a fitted profile (``<profile>_fit.toml``), and
its printed report.

One table per free parameter (start, bounds, fitted value) and per target: the paper's value,
the fit's value and residual (miss / tolerance), the leave-one-out value (from a refit that
did not see the target), its error and residual, how far that refit moved the parameters
(``loo_move``: the largest change as a share of a parameter's log-scaled range; 0 means no
step it tried did better without the target, so the fit's value stands), and the target's
noise (standard deviation over seeds at the fit: what one seed's value may be off by). Errors
are relative for ratios (value / paper - 1) and absolute for knees (req/s) and throughput gaps
(points); ``error_text`` writes one in those terms.
"""

from __future__ import annotations

import math
import re

METHOD = ("scipy.optimize.least_squares (trf, bounded, parameters log-scaled to [0, 1]), "
          "forward-difference Jacobian; leave-one-out: the same least squares without the "
          "target, warm-started from the fit's optimum, then the model's value for it")


def error(kind: str, value, paper: float) -> float | None:
    """Relative error for ratios, absolute for knees and gaps; None without a value (a
    missing knee too). A knee the paper says is never reached: 0 if ours is measured as
    never reached (NaN) too, else our knee."""
    if value is None:
        return None
    if kind == "knee" and not math.isfinite(paper):
        return 0.0 if not math.isfinite(value) else value
    if not math.isfinite(value):
        return None
    return value / paper - 1.0 if kind == "ratio" else value - paper


def error_text(kind: str, e) -> str:
    """An ``error`` in its target's own terms: percent for ratios, req/s for knees, points
    for throughput gaps; "n/a" without one."""
    if e is None or not math.isfinite(e):
        return "n/a"
    if kind == "ratio":
        return f"{100 * e:+.1f}%"
    return f"{e:+.3f} req/s" if kind == "knee" else f"{100 * e:+.2f} pts"


def fit_record(result, targets, params, noise: dict[str, float], settings: dict) -> dict:
    """The record of one ``sim.paper.calibrate.fit`` run (``result``) on ``targets``."""
    return {
        "method": METHOD, "free_parameters": len(params), "num_targets": len(targets),
        "num_evaluations": result.num_evaluations,
        "loo_evaluations": sum(result.loo_evaluations.values()),
        "settings": settings,
        "parameters": {p.name: {"start": p.start, "low": p.low, "high": p.high,
                                "fitted": result.values[p.name]} for p in params},
        "targets": {t.name: {"kind": t.kind, "paper": t.paper,
                             "fit_value": result.predicted.get(t.name),
                             "residual": result.residuals[t.name],
                             "loo_value": result.loo.get(t.name),
                             "loo_error": error(t.kind, result.loo.get(t.name), t.paper),
                             "loo_residual": result.loo_residuals.get(t.name),
                             "loo_move": result.loo_moves.get(t.name),
                             "noise": noise.get(t.name)}
                    for t in targets},
    }


def to_toml(record: dict) -> str:
    """A small TOML writer for the fit record (scalars, strings, lists, nested tables)."""
    lines = ["# Written by `hawk calibrate --targets paper` (sim/paper/calibrate.py); do not edit.",
             "# NaN: the paper's 'never reaches 90%'; a missing value: no knee in the model."]

    def scalar(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if v is None:
            return None
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.6g}"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        return str(v)

    def emit(prefix: str, table: dict) -> None:
        simple = {k: v for k, v in table.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in simple.items():
            s = scalar(v)
            if s is not None:
                lines.append(f"{_key(k)} = {s}")
        for k, v in nested.items():
            emit(f"{prefix}.{_key(k)}" if prefix else _key(k), v)

    emit("", record)
    return "\n".join(lines) + "\n"


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else '"' + k + '"'


def _fmt(x, digits: int = 4) -> str:
    return "never" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def report_lines(record: dict) -> str:
    """The record as the text ``hawk calibrate`` prints."""
    rows = [f"{record['free_parameters']} free parameters, {record['num_targets']} targets "
            f"({record['num_evaluations']} model evaluations for the fit, "
            f"{record.get('loo_evaluations', 0)} more for the leave-one-out refits)", "",
            f"{'parameter':45s} {'start':>10s} {'fitted':>10s}  bounds"]
    for name, p in record["parameters"].items():
        rows.append(f"{name:45s} {p['start']:10.4g} {p['fitted']:10.4g}  "
                    f"[{p['low']:.4g}, {p['high']:.4g}]")
    rows += ["", "residual = miss / tolerance (1: just missed); LOO: from a refit without the "
             "target, its error against the paper (relative for ratios, req/s for knees, points "
             "for gaps); noise: std over seeds at the fit", "",
             f"{'target':55s} {'paper':>7s} {'fit':>7s} {'resid':>6s} {'LOO':>7s} "
             f"{'LOO err':>12s} {'LOO res':>7s} {'moved':>6s} {'noise':>7s}"]
    for name, t in record["targets"].items():
        lr = t.get("loo_residual")
        rows.append(f"{name:55s} {_fmt(t['paper']):>7s} {_fmt(t.get('fit_value')):>7s} "
                    f"{t['residual']:+6.2f} {_fmt(t.get('loo_value')):>7s} "
                    f"{error_text(t['kind'], t.get('loo_error')):>12s} "
                    f"{'' if lr is None else f'{lr:+7.2f}':>7s} {_fmt(t.get('loo_move'), 2):>6s} "
                    f"{_fmt(t.get('noise')):>7s}")
    return "\n".join(rows)
