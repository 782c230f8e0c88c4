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

Both workloads are targets: Chatbot (SLOs TTFT 2 s, TPOT 0.2 s) and Summarization (TTFT 15 s,
TPOT 0.2 s; GG-Host's knee "about 0.38 req/s" from its TTFT; GN-Host's is only "poor", so it
is not a numbered target). Summarization's claim that GN-HAWK's TPOT binds before GG-Direct's
is checked as a prediction.
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
    """Scaled miss: 1 = one tolerance away. A missing value counts as 10 tolerances."""
    if target.kind == "knee" and not math.isfinite(target.paper):
        return 0.0 if ours is None or not math.isfinite(ours) else ours / TOLERANCE["knee"]
    if ours is None or not math.isfinite(ours):
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
    ``kind``: "ratio" (Figure 9, Tables 1 and 8), "knee" (req/s; a NaN paper value means it
    never reaches 90%) or "gap" (GN-HAWK's output throughput at the knee over GG-Direct's - 1).
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
        tput = result["throughput_at_knee"].get(workload, {})
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
    return _row(what.replace(" knee ", " ") + " never reaches 90% attainment", ours, None,
                "no knee on the rate grid", not _finite(ours), what)


def checks(result: dict) -> list[dict]:
    out = [_check(*value) for value in target_values(result)]
    for workload in result["targets"]["knees"]:
        out += _serving_claims(result, workload)
    out.append(_single_buffer(result))
    out += _tpot_binds_first(result)
    return out


def _tpot_binds_first(result: dict) -> list[dict]:
    """Summarization: GN-HAWK's P90 TPOT reaches the SLO at a lower rate than GG-Direct's
    (the NPU's TPOT, not TTFT, binds first). A prediction."""
    from traces.workloads import WORKLOADS

    sweeps = result["sweeps"].get("summarization", {})
    if not {"GG-Direct", "GN-HAWK"} <= set(sweeps):
        return []
    slo = WORKLOADS["summarization"].tpot_slo_s

    def first_over(name):
        rates = [r["rate"] for r in sweeps[name]["rows"] if r["tpot_p90_s"] > slo]
        return min(rates) if rates else math.inf

    hawk, gg = first_over("GN-HAWK"), first_over("GG-Direct")
    return [_row("summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than "
                 "GG-Direct's", [hawk, gg], None, "first rate over the TPOT SLO",
                 math.isfinite(hawk) and hawk < gg)]


def _serving_claims(result: dict, workload: str) -> list[dict]:
    """Orderings, TTFT and TPOT claims of the paper's section 6 for one workload's sweeps."""
    from traces.workloads import WORKLOADS

    sweeps = result["sweeps"].get(workload, {})
    if not {"GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"} <= set(sweeps):
        return []
    spec = WORKLOADS[workload]
    knee = {n: (r["knee_rate"] if _finite(r["knee_rate"]) else 0.0) for n, r in sweeps.items()}
    rows = {n: r["rows"] for n, r in sweeps.items()}
    out = [_row(f"{workload} knees: GG-Direct >= GN-HAWK > GG-Host > GN-Host",
                [knee[n] for n in ("GG-Direct", "GN-HAWK", "GG-Host", "GN-Host")], None,
                "never = 0", knee["GG-Direct"] >= knee["GN-HAWK"] > knee["GG-Host"]
                > knee["GN-Host"])]
    low = rows["GN-Host"][0]
    if workload == "chatbot":        # the paper says so of Chatbot only ("even at low rates")
        out.append(_row(f"{workload} GN-Host P90 TTFT misses the SLO at the lowest rate "
                        f"({low['rate']} req/s)", low["ttft_p90_s"], spec.ttft_slo_s,
                        "> SLO", low["ttft_p90_s"] > spec.ttft_slo_s))
    worst = max(r["tpot_p90_s"] for n in ("GG-Direct", "GN-HAWK") for r in rows[n])
    out.append(_row(f"{workload} GG-Direct and GN-HAWK P90 TPOT under the SLO at every rate",
                    worst, spec.tpot_slo_s, "< SLO", worst < spec.tpot_slo_s))
    for staged, direct in (("GG-Host", "GG-Direct"), ("GN-Host", "GN-HAWK")):
        pairs = list(zip(rows[staged], rows[direct]))
        higher = sum(a["tpot_p90_s"] > b["tpot_p90_s"] for a, b in pairs)
        out.append(_row(f"{workload} {staged} P90 TPOT above {direct}'s",
                        f"{higher}/{len(pairs)} rates", None, "at every rate",
                        higher == len(pairs)))
    return out


def _single_buffer(result: dict) -> dict:
    counts = {w: r["GN-Direct"].get("num_failed_out_of_memory", 0)
              for w, r in result["sweeps"].items() if "GN-Direct" in r}
    return _row("single buffer (GN-Direct) fails requests out of memory under serving load",
                counts, None, "> 0 in some workload", sum(counts.values()) > 0)
