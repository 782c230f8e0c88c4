"""Text of ``hawk devices``: the check's table (``check_lines``), a fit's report
(``fit_lines``) and the grounded profile a fit writes (``profile_toml``)."""

from __future__ import annotations

from sim.paper.devices_check import TOLERANCE, summary


def check_lines(rows: list[dict], serving: list[dict], profile: str) -> list[str]:
    """One line per point (model, measured, error, source), then the serving figures and a
    summary of how many points are within ``TOLERANCE``."""
    lines = [f"{'device':9s} {'model':13s} {'tp':>2s} {'setting':24s} {'model':>9s} "
             f"{'measured':>9s} {'error':>7s}  source"]
    for r in rows:
        ours = "-" if r["model"] is None else f"{1e3 * r['model']:7.1f}ms"
        err = "-" if r["error"] is None else f"{100 * r['error']:+6.1f}%"
        note = f"EXCLUDED: {r['excluded']}" if r["excluded"] else r["source"]
        lines.append(f"{r['device']:9s} {r['model_name']:13s} {r['tp']:2d} {r['setting']:24s} "
                     f"{ours:>9s} {1e3 * r['measured']:7.1f}ms {err:>7s}  {note}")
    lines.append("")
    lines.append("serving figures (batch inferred, not fitted):")
    for r in serving:
        ours = "-" if r["model"] is None else f"{1e3 * r['model']:7.1f}ms"
        err = "-" if r["error"] is None else f"{100 * r['error']:+6.1f}%"
        lines.append(f"  {r['device']:9s} {r['what']:22s} {r['setting']:18s} {ours:>9s} "
                     f"{1e3 * r['measured']:7.1f}ms {err:>7s}  {r['source']}")
    lines.append("")
    totals = summary(rows)
    for device, s in sorted(totals.items(), key=lambda kv: kv[0] == "all"):
        lines.append(f"{device:9s} {s['within']:3d} of {s['points']:3d} points within "
                     f"{100 * TOLERANCE:.0f}% (worst {100 * s['worst']:.1f}%)")
    missing = sorted({r["device"] for r in rows if r["model"] is None})
    if missing:
        lines.append(f"no efficiency table in profile {profile!r} for: {', '.join(missing)}")
    lines.append(f"error = model / measured - 1; profile {profile!r}")
    return lines


def fit_lines(result: dict) -> list[str]:
    """A device fit: optimiser status, parameters with bounds, residuals and leave-one-out."""
    from sim.paper.devices_fit import PLANS

    f = result["fit"]
    params, fixed = PLANS[result["device"]]
    starts = ", ".join(f"u={s['u']:g}: cost {s['cost']:.5f} ({s['nfev']} evaluations, status "
                       f"{s['status']})" for s in f["starts"])
    lines = [f"== {result['device']}: {result['num_free']} free parameters, "
             f"{result['num_points']} points ({result['num_settings']} distinct settings)",
             f"starts (u: position between the bounds, 0.5 the neutral middle): {starts}",
             f"best from u={f['start_u']:g}: status {f['status']} "
             f"({f['message']}), {f['nfev']} evaluations and {f['njev']} Jacobians, rms "
             f"log residual {result['rms_log_residual']:.4f}; {f['effective_free']} "
             f"parameters identified"]
    for p in params:
        lo, hi = f["bounds"][p.name]
        mark = "  AT BOUND" if p.name in f["at_bound"] else ""
        mark += "  NOT IDENTIFIED (the points do not move it)" if p.name in \
            f["unidentified"] else ""
        lines.append(f"  {p.name:30s} {f['values'][p.name]:11.5g}  [{lo:.4g}, {hi:.4g}]  "
                     f"start {f['start'][p.name]:.4g}{mark}  ({p.source})")
    for name, (value, reason) in fixed.items():
        lines.append(f"  {name:30s} {value!s:>11s}  fixed: {reason}")
    lines.append("  sensitivity: the largest move of a point's model time with the parameter "
                 "alone at either bound")
    for name, moves in result["sensitivity"].items():
        lines.append(f"    {name:30s} prefill {100 * moves['prefill']:7.1f}%   decode "
                     f"{100 * moves['decode']:7.1f}%")
    lines.append(f"  {'point':52s} {'measured':>9s} {'fit':>9s} {'error':>7s} "
                 f"{'LOO':>9s} {'LOO err':>7s}")
    for r in result["rows"]:
        loo = (f"{1e3 * r['loo_model_s']:7.1f}ms {100 * r['loo_error']:+6.1f}%"
               if "loo_model_s" in r else "")
        lines.append(f"  {r['key']:52s} {1e3 * r['measured_s']:7.1f}ms "
                     f"{1e3 * r['model_s']:7.1f}ms {100 * r['error']:+6.1f}% {loo}")
    within = sum(abs(r["error"]) <= TOLERANCE for r in result["rows"])
    lines.append(f"  fit: {within} of {len(result['rows'])} within {100 * TOLERANCE:.0f}%")
    if result["rows"] and "loo_error" in result["rows"][0]:
        held = sum(abs(r["loo_error"]) <= TOLERANCE for r in result["rows"])
        lines.append(f"  leave-one-out: {held} of {len(result['rows'])} within "
                     f"{100 * TOLERANCE:.0f}% (each a refit from the same starts)")
    return lines


def profile_toml(results: list[dict]) -> str:
    """The grounded profile: one ``[efficiency.<device>]`` table per fit, each value with
    its bounds and source, or its reason when fixed."""
    from sim.paper.devices_fit import PLANS

    out = ["# The grounded profile: each device's step-time efficiencies fitted to published",
           "# measurements of that device (hardware/catalog/measured/, README there), written",
           "# by `hawk devices --fit --write`. FITTED values: least squares of log(model /",
           "# measured) from the middle of the bounds (sim/paper/devices_fit.py). Compare with",
           "# `hawk devices --check --profile grounded`.", ""]
    for r in results:
        params, fixed = PLANS[r["device"]]
        f = r["fit"]
        out.append(f"[efficiency.{r['device']}]")
        out.append(f"# fit: status {f['status']}, {f['nfev']} evaluations, {r['num_points']} "
                   f"points, rms log residual {r['rms_log_residual']:.4f}")
        for p in params:
            lo, hi = f["bounds"][p.name]
            for field in p.fields:
                out.append(f"{field} = {f['values'][p.name]:.6g}  # FITTED in [{lo:.4g}, "
                           f"{hi:.4g}]: {p.source}")
        for name, (value, reason) in fixed.items():
            text = str(value).lower() if isinstance(value, bool) else f"{value:.6g}"
            out.append(f"{name} = {text}  # fixed: {reason}")
        out.append("")
    return "\n".join(out)


def devices_summary(profile: str) -> dict:
    """``hawk paper``'s view of its devices: how many published points each device's
    roofline reproduces within ``TOLERANCE`` under ``profile`` and under the grounded fit."""
    from sim.paper.devices_check import check

    return {"profile": profile, "tolerance": TOLERANCE,
            "under_profile": summary(check(profile)),
            "under_grounded": summary(check("grounded"))}


def devices_markdown(devices: dict | None) -> list[str]:
    """The report's section on the devices' published measurements (``devices_summary``)."""
    if not devices:
        return []
    lines = ["", "## Devices against their published measurements", "",
             f"Points within {100 * devices['tolerance']:.0f}% of Splitwise's and tt-metal's "
             f"published steps (`hawk devices --check`), under profile `{devices['profile']}` "
             "and under the grounded fit (`hawk devices --fit`).", "",
             "| device | points | profile: within | profile: worst | grounded: within | "
             "grounded: worst |", "|---|---|---|---|---|---|"]
    grounded = devices["under_grounded"]
    for device, s in devices["under_profile"].items():
        g = grounded.get(device, {})
        lines.append(f"| {device} | {s['points']} | {s['within']} | {100 * s['worst']:.0f}% | "
                     f"{g.get('within', '-')} | "
                     + (f"{100 * g['worst']:.0f}% |" if g else "- |"))
    return lines
