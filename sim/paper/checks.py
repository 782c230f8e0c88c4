"""Each claim of the paper's section 6 as a check on a ``run_paper`` result: holds or not.

The paper is HAWK ("Heterogeneity-AWare Key-value transfer", arXiv 2610.29873, Oct 2026);
docs/paper.md summarises it. ``TARGETS`` holds every figure the checks compare against, each
with its place in the paper, so an installed package needs nothing else.
``target_values(result)`` lists every number of ``TARGETS`` beside ours (the report's
comparison table is made from it). ``checks(result)`` returns one row per claim: what it says,
our value, the paper's, the tolerance, whether it holds, and whether the paper profile was
fitted to it (``fitted``: the target is one of those ``hawk calibrate --targets paper`` fits,
sim/paper/calibrate.py) or it is a prediction (orderings, TTFT and TPOT claims, the single buffer,
GGH-Direct); a fitted check names its ``target``, so ``hawk paper`` can put beside it the
value a refit that did not see it predicts (leave-one-out). Tolerances: knees within +-0.05
req/s, ratios within 15% relative, throughput gaps within 2 points of the paper's.

Measured as the paper measures: knees on its rate grid (``sim.paper.knees``; the bisected knee
rides beside each knee check as ``bisected``), output throughput at the knee over the steady
window (``steady_throughput_at_knee``, ``traces.metrics.steady_output_tokens_per_s``), not over
the whole run with its drain. A missing value (no knee found within the sweep, a sweep not
run, a NaN where a number belongs) fails its check; only a knee measured as NaN (no swept
rate meets 90%) is "never reaches".

Both workloads are targets: Chatbot (SLOs TTFT 2 s, TPOT 0.2 s) and Summarization (TTFT 15 s,
TPOT 0.2 s; GG-Host's knee "about 0.38 req/s" from its TTFT; GN-Host's is only "poor", so it
is not a numbered target). The TPOT claims are each workload's own, so all can hold at once:
Chatbot's GG-Direct and GN-HAWK stay under the TPOT SLO at every rate; in Summarization
GN-HAWK's P90 TPOT reaches the SLO at about 0.60 req/s, at a lower rate than GG-Direct's (the
paper claims no every-rate bound there). Both are predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KNEE_TOLERANCE = 0.05      # req/s
RATIO_TOLERANCE = 0.15     # relative
THROUGHPUT_GAP = 0.02      # GN-HAWK's throughput gap to GG-Direct within 2 points of the paper's

#: The paper's figures (HAWK, arXiv 2610.29873; docs/paper.md sections 1 and 6).
#: NaN = "never reaches 90% attainment".
TARGETS = {
    # Figure 9: transfer latency over GG-Host's at 10 MB and at 1280 MB
    "fig9": {"GN-Host": (8.91, 3.79), "GG-Direct": (0.6630, 0.1477), "GN-HAWK": (0.7725, 0.1469)},
    # Table 1 (section 1): 4x A100 over 4x p150a at 512 in / 128 out / batch 32, Llama 3.1 70B
    "table1": {"prefill_ratio": 2.52, "decode_ratio": 1.16, "decode_power_ratio": 1.39,
               "decode_cost_ratio": 5.88},
    # Chatbot SLO attainment: the highest rate (req/s) holding 90%
    "knees": {"chatbot": {"GG-Host": 0.40, "GN-Host": math.nan, "GG-Direct": 0.65,
                          "GN-HAWK": 0.65},
              "summarization": {"GG-Host": 0.38, "GG-Direct": 0.65, "GN-HAWK": 0.60}},
    # Output throughput at the 90%-attainment point: GN-HAWK 0.48% (Chatbot) and 7.88%
    # (Summarization) below GG-Direct
    "throughput_gap": {"chatbot": -0.0048, "summarization": -0.0788},
    # Table 8: GN-HAWK over GG-Direct at 90% attainment
    "efficiency": {"chatbot": {"power_ratio": 1.26, "cost_ratio": 1.72},
                   "summarization": {"power_ratio": 1.15, "cost_ratio": 1.61}},
}


#: a residual of 1 = one tolerance away from the paper's number
TOLERANCE = {"ratio": RATIO_TOLERANCE, "knee": KNEE_TOLERANCE, "gap": THROUGHPUT_GAP}


@dataclass(frozen=True)
class Target:
    name: str
    kind: str          # "ratio", "knee" (NaN paper value: never reaches 90%) or "gap"
    paper: float


def paper_targets() -> list[Target]:
    """Every numbered target of docs/paper.md section 6, named as ``hawk paper`` names it."""
    t, out = TARGETS, []
    for mech, (small, large) in t["fig9"].items():
        out.append(Target(f"Fig 9 {mech}/GG-Host at 10 MB", "ratio", small))
        out.append(Target(f"Fig 9 {mech}/GG-Host at 1280 MB", "ratio", large))
    out += [Target(f"Table 1 {k}", "ratio", v) for k, v in t["table1"].items()]
    for workload, knees in t["knees"].items():
        out += [Target(f"{workload} knee {n}", "knee", v) for n, v in knees.items()]
    for workload, ratios in t["efficiency"].items():
        out += [Target(f"{workload} Table 8 {k}", "ratio", v) for k, v in ratios.items()]
    out += [Target(f"{w} GN-HAWK throughput at knee vs GG-Direct", "gap", v)
            for w, v in t["throughput_gap"].items()]
    return out


def residual(target: Target, ours) -> float:
    """Scaled miss: 1 = one tolerance away. A missing value (None) counts as 10 tolerances;
    a knee measured as NaN (never reaches 90%) matches a NaN paper value."""
    if ours is None:
        return 10.0
    if target.kind == "knee" and not math.isfinite(target.paper):
        return 0.0 if not math.isfinite(ours) else ours / TOLERANCE["knee"]
    if not math.isfinite(ours):
        return 10.0
    if target.kind == "ratio":
        return (ours / target.paper - 1.0) / TOLERANCE["ratio"]
    return (ours - target.paper) / TOLERANCE[target.kind]


def fitted_targets() -> set[str]:
    """The targets ``hawk calibrate --targets paper`` fits (sim/paper/calibrate.py): every
    numbered target above. Orderings and TTFT/TPOT claims are predictions."""
    return {t.name for t in paper_targets()}


def load_fit_record(profile: str = "paper") -> dict | None:
    """The fit record ``hawk calibrate`` writes beside a packaged profile
    (``sim/profiles/<profile>_fit.toml``), or None."""
    from importlib import resources

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = resources.files("sim").joinpath("profiles", f"{profile}_fit.toml")
    return tomllib.loads(path.read_text()) if path.is_file() else None



def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _row(what: str, ours, paper, tolerance: str, holds: bool, target: str | None = None) -> dict:
    """One check; ``target``: the fit target it checks (None: a prediction)."""
    return {"check": what, "ours": ours, "paper": paper, "tolerance": tolerance,
            "holds": bool(holds), "fitted": target in fitted_targets(), "target": target}


def target_values(result: dict) -> list[tuple[str, str, object, float]]:
    """(kind, what, ours, paper) for every number of ``TARGETS`` in ``result["targets"]``.
    ``kind``: "ratio" (Figure 9, Tables 1 and 8), "knee" (req/s on the paper's rate grid; a
    NaN paper value means it never reaches 90%) or "gap" (GN-HAWK's steady-window output
    throughput at the knee over GG-Direct's - 1).
    """
    t, out = result["targets"], []
    fig9 = {(r["size_mb"], r["mechanism"]): r["normalized"] for r in result["fig9"]}
    sizes = sorted({r["size_mb"] for r in result["fig9"]})
    for mech, (small, large) in t["fig9"].items():
        for size, paper in ((sizes[0], small), (sizes[-1], large)):
            out.append(("ratio", f"Fig 9 {mech}/GG-Host at {size} MB", fig9.get((size, mech)),
                        paper))
    for key, paper in t["table1"].items():
        out.append(("ratio", f"Table 1 {key}", result["table1"][key], paper))
    for workload, knees in t["knees"].items():
        for name, paper in knees.items():
            out.append(("knee", f"{workload} knee {name}",
                        result["knees"].get(workload, {}).get(name), paper))
    for workload, ratios in t["efficiency"].items():
        for key, paper in ratios.items():
            out.append(("ratio", f"{workload} Table 8 {key}",
                        result["efficiency"].get(workload, {}).get(key), paper))
    for workload, paper in t["throughput_gap"].items():
        tput = result.get("steady_throughput_at_knee", {}).get(workload, {})
        hawk, gg = tput.get("GN-HAWK"), tput.get("GG-Direct")
        ours = hawk / gg - 1 if _finite(hawk) and _finite(gg) and gg else None
        out.append(("gap", f"{workload} GN-HAWK throughput at knee vs GG-Direct", ours, paper))
    return out


def _check(kind: str, what: str, ours, paper) -> dict:
    if kind == "ratio":
        return _row(what, ours, paper, "15% relative",
                    _finite(ours) and abs(ours / paper - 1) <= RATIO_TOLERANCE, what)
    if kind == "gap":
        return _row(what, ours, paper, f"within {100 * THROUGHPUT_GAP:g} points of the paper's",
                    _finite(ours) and abs(ours - paper) <= THROUGHPUT_GAP + 1e-12, what)
    if _finite(paper):
        return _row(what, ours, paper, "+-0.05 req/s",
                    _finite(ours) and abs(ours - paper) <= KNEE_TOLERANCE + 1e-9, what)
    measured_never = isinstance(ours, float) and math.isnan(ours)     # None: missing
    return _row(what.replace(" knee ", " ") + " never reaches 90% attainment", ours, paper,
                "no knee on the rate grid", measured_never, what)


def checks(result: dict) -> list[dict]:
    out = [_check(*value) for value in target_values(result)]
    bisected = {f"{w} knee {n}": k for w, knees in result.get("knees_bisected", {}).items()
                for n, k in knees.items()}
    for row in out:
        if row["target"] in bisected:
            row["bisected"] = bisected[row["target"]]
    for workload in result["targets"]["knees"]:
        out += _serving_claims(result, workload)
    out.append(_single_buffer(result))
    out += _tpot_binds_first(result)
    return out


#: Summarization: "GN-HAWK reaches the 200 ms TPOT SLO at about 0.60 req/s" (docs/paper.md 6)
SUMMARIZATION_HAWK_TPOT_RATE = 0.60
MISSING = "missing"            # a check's value when the runs it reads are not in the result


def _first_over(rows: list[dict], slo: float) -> float | None:
    """The lowest swept rate whose P90 TPOT exceeds ``slo`` (inf: none does); None when a
    row has no P90 TPOT (missing, not under the SLO)."""
    if any(not _finite(r.get("tpot_p90_s")) for r in rows):
        return None
    rates = [r["rate"] for r in rows if r["tpot_p90_s"] > slo]
    return min(rates) if rates else math.inf


def _tpot_binds_first(result: dict) -> list[dict]:
    """Summarization: GN-HAWK's P90 TPOT reaches the SLO at about 0.60 req/s and at a lower
    rate than GG-Direct's (the NPU's TPOT, not TTFT, binds first). Predictions."""
    from traces.workloads import WORKLOADS

    sweeps = result["sweeps"].get("summarization", {})
    about = (f"summarization GN-HAWK's P90 TPOT reaches the SLO at about "
             f"{SUMMARIZATION_HAWK_TPOT_RATE:.2f} req/s")
    first = ("summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than "
             "GG-Direct's")
    if not {"GG-Direct", "GN-HAWK"} <= set(sweeps):
        return [_row(about, MISSING, SUMMARIZATION_HAWK_TPOT_RATE, "+-0.05 req/s", False),
                _row(first, MISSING, None, "first rate over the TPOT SLO", False)]
    slo = WORKLOADS["summarization"].tpot_slo_s
    hawk = _first_over(sweeps["GN-HAWK"]["rows"], slo)
    gg = _first_over(sweeps["GG-Direct"]["rows"], slo)
    known = hawk is not None and gg is not None
    return [_row(about, hawk, SUMMARIZATION_HAWK_TPOT_RATE, "+-0.05 req/s", _finite(hawk) and
                 abs(hawk - SUMMARIZATION_HAWK_TPOT_RATE) <= KNEE_TOLERANCE + 1e-9),
            _row(first, [hawk, gg], None, "first rate over the TPOT SLO",
                 known and math.isfinite(hawk) and hawk < gg)]


def _knee_or_never(value):
    """A knee for the orderings: NaN (never reaches 90%) = 0; None (missing) stays None."""
    if value is None:
        return None
    return value if math.isfinite(value) else 0.0


def _serving_claims(result: dict, workload: str) -> list[dict]:
    """Orderings, TTFT and TPOT claims of the paper's section 6 for one workload's sweeps."""
    from traces.workloads import WORKLOADS

    sweeps = result["sweeps"].get(workload, {})
    order = ("GG-Direct", "GN-HAWK", "GG-Host", "GN-Host")
    what = f"{workload} knees: GG-Direct >= GN-HAWK > GG-Host > GN-Host"
    if not set(order) <= set(sweeps):
        return [_row(what, MISSING, None, "never = 0", False)]
    spec = WORKLOADS[workload]
    knee = [_knee_or_never(sweeps[n]["knee_rate"]) for n in order]
    rows = {n: r["rows"] for n, r in sweeps.items()}
    out = [_row(what, knee, None, "never = 0; a missing knee fails", None not in knee
                and knee[0] >= knee[1] > knee[2] > knee[3])]
    low = rows["GN-Host"][0]
    if workload == "chatbot":        # the paper says so of Chatbot only ("even at low rates")
        out.append(_row(f"{workload} GN-Host P90 TTFT misses the SLO at the lowest rate "
                        f"({low['rate']} req/s)", low["ttft_p90_s"], spec.ttft_slo_s,
                        "> SLO", _finite(low["ttft_p90_s"])
                        and low["ttft_p90_s"] > spec.ttft_slo_s))
        # Chatbot only: in Summarization the paper has GN-HAWK's TPOT reach the SLO
        tpots = [r["tpot_p90_s"] for n in ("GG-Direct", "GN-HAWK") for r in rows[n]]
        worst = max(tpots) if all(_finite(t) for t in tpots) else None
        out.append(_row(f"{workload} GG-Direct and GN-HAWK P90 TPOT under the SLO at every "
                        f"rate", worst, spec.tpot_slo_s, "< SLO",
                        worst is not None and worst < spec.tpot_slo_s))
    for staged, direct in (("GG-Host", "GG-Direct"), ("GN-Host", "GN-HAWK")):
        pairs = list(zip(rows[staged], rows[direct]))
        higher = sum(_finite(a["tpot_p90_s"]) and _finite(b["tpot_p90_s"])
                     and a["tpot_p90_s"] > b["tpot_p90_s"] for a, b in pairs)
        out.append(_row(f"{workload} {staged} P90 TPOT above {direct}'s",
                        f"{higher}/{len(pairs)} rates", None, "at every rate",
                        bool(pairs) and higher == len(pairs)))
    return out


def _single_buffer(result: dict) -> dict:
    counts = {w: r["GN-Direct"].get("num_failed_out_of_memory", 0)
              for w, r in result["sweeps"].items() if "GN-Direct" in r}   # none: fails
    return _row("single buffer (GN-Direct) fails requests out of memory under serving load",
                counts, None, "> 0 in some workload", sum(counts.values()) > 0)
