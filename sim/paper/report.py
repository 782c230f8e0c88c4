"""The paper report: Markdown tables and PNG plots, every number beside the paper's.

``write_report(result, out_dir)`` takes the dict of ``sim.paper.experiments.run_paper`` and writes
``report.md`` plus Figure 9-13 style plots (matplotlib, Agg backend); ``text(result)`` is what
``hawk paper`` prints. Errors are in each check's terms: relative (ours / paper - 1) for
ratios, ours - paper in req/s for knees and in points for throughput gaps; a knee that 90%
attainment never reaches reads "never". ``comparison_rows`` keeps the plain relative errors.
"""

from __future__ import annotations

import math
from pathlib import Path

from sim.paper.devices_report import devices_markdown
from sim.paper.sensitivity_table import sensitivity_markdown


def rel_err(ours, paper) -> float:
    if ours is None or paper is None or not math.isfinite(paper) or paper == 0:
        return math.nan
    if not math.isfinite(ours):
        return math.nan
    return ours / paper - 1.0


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def comparison_rows(result: dict) -> list[tuple[str, float, float, float]]:
    """(what, ours, paper, relative error) for every target of the paper's section 6."""
    from sim.paper.checks import target_values

    return [(what + (" (req/s)" if kind == "knee" else ""), ours, paper,
             math.nan if kind == "gap" else rel_err(ours, paper))
            for kind, what, ours, paper in target_values(result)]


#: the targets table's columns (``comparison_table``)
COMPARISON_COLUMNS = ("quantity", "ours", "paper", "error")
ERROR_TERMS = ("error: relative for ratios, ours - paper in req/s for knees and in points for "
               "throughput gaps (the terms of each check's tolerance)")


def comparison_table(result: dict) -> list[tuple[str, str, str, str]]:
    """``COMPARISON_COLUMNS`` as text for every target of the paper's section 6: a knee the
    paper or the model never reaches reads "never", a throughput gap reads in percent, the
    error is in the target's own terms (``ERROR_TERMS``; ``sim.paper.fit_record.error``)."""
    from sim.paper.fit_record import error
    from sim.paper.checks import target_values

    rows = []
    for kind, what, ours, paper in target_values(result):
        ok = ours is not None and math.isfinite(ours)
        e = error(kind, ours, paper) if ok or kind == "knee" else None
        rows.append((what + (" (req/s)" if kind == "knee" else ""), _value(kind, ours),
                     _value(kind, paper), _error(kind, e)))
    return rows


def settings_line(result: dict) -> str:
    """The run's sweep settings, in words (quick settings: knees on a coarse grid)."""
    from sim.paper.experiments import sweep_settings

    parts = []
    for workload in result["sweeps"]:
        s = sweep_settings(workload, result["quick"], result["profile"])
        parts.append(f"{workload} rates {', '.join(f'{r:g}' for r in s['rates'])} req/s")
    if parts:
        parts.append(f"{s['num_requests']} requests per point, seeds "
                     f"{', '.join(str(x) for x in s['seeds'])}")
    kind = ("quick settings (hawk paper --quick): knees fall on this coarse rate grid"
            if result["quick"] else "full settings")
    return kind + (f"; {'; '.join(parts)}" if parts else "")


def text(result: dict) -> str:
    """What ``hawk paper`` prints: settings, the targets, the fit table and the claims."""
    lines = [f"hawk paper: profile {result['profile']}, {settings_line(result)}", ERROR_TERMS,
             ""]
    lines += _columns([COMPARISON_COLUMNS] + comparison_table(result))
    if result.get("free_parameters"):
        lines += ["", fit_text(result)]
    rows = result["checks"]
    lines += ["", f"{sum(r['holds'] for r in rows)} of {len(rows)} claims of the paper's "
              f"section 6 hold ({sum(r['fitted'] for r in rows)} fitted, "
              f"{sum(not r['fitted'] for r in rows)} predicted)"]
    for r in rows:
        if not r["holds"]:
            lines.append(f"  does not hold ({'fitted' if r['fitted'] else 'predicted'}): "
                         f"{r['check']}")
        elif r["fitted"] and not r.get("loo_holds", True):
            lines.append(f"  holds here, not by the leave-one-out prediction: {r['check']}")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    lines = ["# HAWK paper reproduction (simulated)", "",
             f"Profile `{result['profile']}`, {settings_line(result)}.", "",
             "## Targets (the paper's section 6)", "", ERROR_TERMS[0].upper() + ERROR_TERMS[1:]
             + ".", "", "| " + " | ".join(COMPARISON_COLUMNS) + " |", "|---|---|---|---|"]
    for row in comparison_table(result):
        lines.append("| " + " | ".join(row) + " |")
    lines += _checks_section(result)
    lines += _fit_section(result)
    lines += devices_markdown(result.get("devices"))
    lines += sensitivity_markdown(result.get("sensitivity"))
    lines += ["", "## Figure 9: latency normalised to GG-Host", "",
              "| size (MB) | " + " | ".join(_mechs(result)) + " |",
              "|---|" + "---|" * len(_mechs(result))]
    for size in sorted({r["size_mb"] for r in result["fig9"]}):
        cells = {r["mechanism"]: r["normalized"] for r in result["fig9"] if r["size_mb"] == size}
        lines.append(f"| {size} | " + " | ".join(_f(cells[m]) for m in _mechs(result)) + " |")
    for workload, res in result["sweeps"].items():
        lines += ["", f"## Serving: {workload}", "",
                  "| config | knee on the paper's grid (req/s) | bisected | knee per seed | "
                  "tokens/s at knee | steady tokens/s | OOM failures | tokens/J | tokens/s/$ | "
                  "$/request |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in res.items():
            k = r.get("at_knee") or {}
            seeds = " / ".join(_f(v) for v in (r.get("knee_by_seed") or {}).values())
            lines.append(f"| {name} | {_knee(r['knee_rate'])} | {_knee(r.get('knee_bisected'))} "
                         f"| {seeds} | "
                         f"{_f(r['output_tokens_per_s_at_knee'])} | "
                         f"{_f(k.get('steady_output_tokens_per_s'))} | "
                         f"{r.get('num_failed_out_of_memory', 0)} | {_f(k.get('tokens_per_joule'))} "
                         f"| {_f(k.get('tokens_per_s_per_dollar'))} | "
                         f"{_f(k.get('usd_per_request'))} |")
        eff = result["efficiency"][workload]
        lines.append("")
        lines.append("GN-HAWK over GG-Direct: power " + _f(eff.get("power_ratio")) + "x, cost "
                     + _f(eff.get("cost_ratio")) + "x; over GGH-Direct: power "
                     + _f(eff.get("power_ratio_vs_ggh")) + "x, cost "
                     + _f(eff.get("cost_ratio_vs_ggh")) + "x.")
    names = [p.format(w=w) for p in PLOTS for w in result["sweeps"]]
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in dict.fromkeys(names)), ""]
    return "\n".join(lines)


def _fit_section(result: dict) -> list[str]:
    """The fit behind the profile: counts, parameters, and the per-target table."""
    if not result.get("free_parameters"):
        return []
    lines = ["", "## The fit", "", _fit_intro(result), "",
             "| parameter | start | fitted | bounds |", "|---|---|---|---|"]
    for name, p in result.get("parameters", {}).items():
        lines.append(f"| {name} | {_f(p['start'], 4)} | {_f(p['fitted'], 4)} | "
                     f"[{_f(p['low'], 4)}, {_f(p['high'], 4)}] |")
    lines += ["", "| " + " | ".join(FIT_COLUMNS) + " |", "|---" * len(FIT_COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in fit_table(result)]
    return lines


#: the per-target fit table's columns (``fit_table``)
FIT_COLUMNS = ("target", "paper", "fitted", "residual", "LOO", "LOO error", "LOO residual",
               "noise", "this run")


def _fit_intro(result: dict) -> str:
    return (f"{result['free_parameters']} free parameters for {result['num_targets']} targets "
            f"(`hawk calibrate --targets paper`; {result.get('fit_method', '')}). fitted: the "
            "fitted model's value; residual = (fitted - paper) / tolerance (15% for ratios, "
            "0.05 req/s for knees, 2 points for gaps; |residual| <= 1 holds); LOO: leave-one-"
            "out, the value predicted by a refit that did not see the target; LOO error: LOO "
            "against the paper (relative for ratios, req/s for knees, points for gaps); noise: "
            "standard deviation over seeds at the fit; this run: the value this run measured "
            "(its settings may differ from the fit's). A knee of \"never\": 90% attainment is "
            "not reached.")


def _value(kind: str, x) -> str:
    """A target's value; a knee that is NaN is never reached, None is missing (beyond the
    sweep or not run); a gap in percent."""
    if kind == "knee" and x is None:
        return "missing"
    if kind == "knee" and isinstance(x, float) and math.isnan(x):
        return "never"
    if kind == "gap":
        return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.2f}%"
    return _f(x, 4)


def _error(kind: str, e) -> str:
    from sim.paper.fit_record import error_text

    return error_text(kind, e)


def _noise(kind: str, x) -> str:
    """A standard deviation in the target's units (points for gaps)."""
    if kind == "gap" and x is not None and math.isfinite(x):
        return f"{100 * x:.2g} pts"
    return _f(x, 2)


def _signed(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:+.2f}"


def fit_table(result: dict) -> list[tuple[str, ...]]:
    """One row of ``FIT_COLUMNS`` per fitted target of ``result["fit"]`` (``sim.paper.experiments.
    fit_summary``): the paper's value, the fit's value and residual, the leave-one-out value
    with its error and residual, the noise over seeds and this run's value, as text."""
    return [(r["target"], _value(r["kind"], r["paper"]), _value(r["kind"], r.get("fit_value")),
             _signed(r.get("fit_residual")), _value(r["kind"], r.get("loo_value")),
             _error(r["kind"], r.get("loo_error")), _signed(r.get("loo_residual")),
             _noise(r["kind"], r.get("noise")), _value(r["kind"], r.get("ours")))
            for r in result.get("fit", [])]


def fit_text(result: dict) -> str:
    """The fit table as ``hawk paper`` prints it (fixed-width columns); '' without a fit."""
    if not result.get("free_parameters"):
        return ""
    lines = [f"fit: {result['free_parameters']} free parameters for {result['num_targets']} "
             "targets (hawk calibrate --targets paper)",
             "  fitted: the fitted model's value; residual = (fitted - paper) / tolerance "
             "(15% for ratios, 0.05 req/s for knees, 2 points for gaps); |residual| <= 1 holds",
             "  LOO (leave-one-out): the value of a refit that did not see the target, its error "
             "against the paper and its residual",
             "  noise: std over seeds at the fit; this run: the value measured here "
             "(its settings may differ from the fit's); never: 90% attainment not reached", ""]
    return "\n".join(lines + _columns([FIT_COLUMNS] + fit_table(result)))


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of text cells as fixed-width lines: the first column left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


#: what the growth of each TTFT stage (traces.metrics.TTFT_STAGES) says binds
STAGE_BINDS = {"queue": "prefill (requests queue for it)",
               "prefill": "prefill (batches grow long)",
               "transfer_wait": "decode KV memory or batch slots (KV waits to be pulled)",
               "transfer": "the KV path (NIC or host copies)",
               "first_decode": "decode steps (the first token waits for a batch)"}


def what_binds(summary: dict, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """What limits a swept configuration (a ``sim.runs.sweep.summarize_sweep`` result). At the
    first rate past the knee: which P90 exceeds its SLO (TTFT, TPOT, or neither: the tail
    below P90 fails), and, for TTFT, the stage of it that grew most since the lowest rate
    (``STAGE_BINDS``: queueing for prefill means prefill binds, waiting to be pulled means the
    decode side's memory or batch slots do). A TPOT miss means the decode steps bind."""
    rows = summary["rows"]
    knee = summary["knee_rate"]
    finite = knee is not None and math.isfinite(knee)
    past = (next((r for r in rows if r["rate"] > knee), None) if finite
            else None if knee is None else rows[0])       # None: beyond the swept range
    if past is None:
        return {"knee_rate": knee, "slo_missed_past_knee": "beyond the swept range",
                "binds": "nothing within the swept range", "stage_growth_s": {}}
    over = [name for name, key, limit in (("TTFT", "ttft_p90_s", ttft_slo_s),
                                          ("TPOT", "tpot_p90_s", tpot_slo_s))
            if past[key] > limit]
    low = rows[0]
    growth = {}
    for stage in STAGE_BINDS:
        key = f"ttft_{stage}_mean_s"
        a, b = low.get(key), past.get(key)
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            growth[stage] = b - a
    if "TPOT" in over:
        binds = "decode steps (TPOT)"
    elif growth:
        binds = STAGE_BINDS[max(growth, key=growth.get)]
    else:
        binds = "unknown"
    return {"knee_rate": knee,
            "slo_missed_past_knee": " and ".join(over) if over else "neither P90 (the tail)",
            "binds": binds, "stage_growth_s": growth}


def _knee(x) -> str:
    """A knee: "never" (NaN: no swept rate meets 90%), "missing" (None: beyond the sweep)."""
    if x is None:
        return "missing"
    return "never" if isinstance(x, float) and math.isnan(x) else _f(x)


def _cell(x) -> str:
    if isinstance(x, dict):
        return ", ".join(f"{k} {v}" for k, v in x.items())
    if isinstance(x, (list, tuple)):                  # +inf: never (e.g. never over the SLO)
        return " / ".join("never" if v == math.inf else _f(v) for v in x)
    if x == math.inf:
        return "never"
    return x if isinstance(x, str) else _f(x)


def _checks_section(result: dict) -> list[str]:
    from sim.paper.checks import paper_targets

    rows = result.get("checks") or []
    if not rows:
        return []
    held = sum(r["holds"] for r in rows)
    lines = ["", "## Checks", "",
             f"{held} of {len(rows)} claims hold. \"fitted\": a target of `hawk calibrate "
             "--targets paper` (the profile's free parameters were fitted to it among all the "
             "targets); \"predicted\": nothing was fitted to it. LOO: whether a fitted "
             "claim holds by the value a refit that did not see it predicts.", "",
             "| claim | ours | paper | tolerance | holds | | LOO |", "|---" * 7 + "|"]
    kinds = {t.name: t.kind for t in paper_targets()}
    for r in rows:
        kind = kinds.get(r.get("target"))
        ours, paper = ((_value(kind, r["ours"]), _value(kind, r["paper"])) if kind
                       else (_cell(r["ours"]), _cell(r["paper"])))
        loo = "" if "loo_holds" not in r else "yes" if r["loo_holds"] else "**no**"
        lines.append(f"| {r['check']} | {ours} | {paper} | {r['tolerance']} | "
                     f"{'yes' if r['holds'] else '**no**'} | "
                     f"{'fitted' if r['fitted'] else 'predicted'} | {loo} |")
    return lines


def _mechs(result: dict) -> list[str]:
    seen: list[str] = []
    for r in result["fig9"]:
        if r["mechanism"] not in seen:
            seen.append(r["mechanism"])
    return seen


PLOTS = ("fig9_transfer.png", "fig10_ttft_{w}.png", "fig11_tpot_{w}.png",
         "fig12_attainment_{w}.png", "fig13_efficiency.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fig9(result: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mech in _mechs(result):
        rows = [r for r in result["fig9"] if r["mechanism"] == mech]
        ax.plot([r["size_mb"] for r in rows], [r["normalized"] for r in rows], marker="o",
                label=mech)
    for mech, (small, large) in result["targets"]["fig9"].items():
        sizes = sorted({r["size_mb"] for r in result["fig9"]})
        ax.scatter([sizes[0], sizes[-1]], [small, large], marker="x", color="black")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("transfer size (MB)")
    ax.set_ylabel("latency / GG-Host (x = paper)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


def plot_sweeps(result: dict, workload: str, key: str, ylabel: str, path: Path,
                scale: float = 1.0, line: float | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in result["sweeps"][workload].items():
        ax.plot([row["rate"] for row in r["rows"]], [scale * row[key] for row in r["rows"]],
                marker="o", label=name)
    if line is not None:
        ax.axhline(line, color="grey", linestyle="--")
    for name, knee in result["targets"]["knees"].get(workload, {}).items():
        if math.isfinite(knee) and key == "slo_attainment":
            ax.axvline(knee, color="black", linestyle=":", alpha=0.4)
    ax.set_xlabel("rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(workload)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


def plot_efficiency(result: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels, ours, paper = [], [], []
    for workload, eff in result["efficiency"].items():
        for key in ("power_ratio", "cost_ratio", "power_ratio_vs_ggh", "cost_ratio_vs_ggh"):
            labels.append(f"{workload}\n{key}")
            ours.append(eff.get(key, math.nan))
            paper.append(result["targets"]["efficiency"].get(workload, {}).get(key, math.nan))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="ours")
    ax.bar([i + 0.2 for i in x], paper, width=0.4, label="paper")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("GN-HAWK / baseline")
    ax.legend()
    _save(plt, fig, path)


def write_report(result: dict, out_dir) -> Path:
    """Write report.md and the plots into ``out_dir``; returns the report's path."""
    from traces.workloads import WORKLOADS

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_fig9(result, out / "fig9_transfer.png")
    for w in result["sweeps"]:
        spec = WORKLOADS.get(w)
        plot_sweeps(result, w, "ttft_p90_s", "P90 TTFT (s)", out / f"fig10_ttft_{w}.png",
                    line=spec and spec.ttft_slo_s)
        plot_sweeps(result, w, "tpot_p90_s", "P90 TPOT (ms)", out / f"fig11_tpot_{w}.png",
                    scale=1e3, line=spec and 1e3 * spec.tpot_slo_s)
        plot_sweeps(result, w, "slo_attainment", "SLO attainment (%)",
                    out / f"fig12_attainment_{w}.png", scale=100.0, line=90.0)
    plot_efficiency(result, out / "fig13_efficiency.png")
    path = out / "report.md"
    path.write_text(markdown(result))
    return path
