"""Measured as the paper measures: steady-window throughput in the gap targets, knees on the
paper's rate grid and bisected, checks that can all hold at once, a missing value a failure.

``paper_like`` builds a ``run_paper`` result that says exactly what the paper's section 6
says (docs/paper.md), with no simulation."""

import copy
import math

import pytest

from sim.paper import checks as ck
from sim.paper.knees import PAPER_RATE_STEP, grid_index, refine_knee

GRID = [round(0.1 + 0.05 * k, 2) for k in range(19)]        # 0.1 .. 1.0 req/s
KNEES = {"chatbot": {"GG-Host": 0.40, "GN-Host": math.nan, "GG-Direct": 0.65, "GN-HAWK": 0.65},
         "summarization": {"GG-Host": 0.35, "GN-Host": 0.20, "GG-Direct": 0.65,
                           "GN-HAWK": 0.60}}
#: Summarization P90 TPOT first over the SLO: GN-HAWK at 0.65 req/s, GG-Direct at 0.75
FIRST_OVER = {("summarization", "GN-HAWK"): 0.65, ("summarization", "GG-Direct"): 0.75}
TPOT = {"GG-Direct": 0.05, "GN-HAWK": 0.06, "GG-Host": 0.08, "GN-Host": 0.09}


def _rows(workload: str, name: str) -> list[dict]:
    rows = []
    for rate in GRID:
        direct = "GN-HAWK" if name == "GN-Host" else "GG-Direct" if name == "GG-Host" else name
        over = FIRST_OVER.get((workload, direct), math.inf)
        tpot = TPOT[name] + (0.3 if rate >= over - 1e-9 else 0.0)
        ttft = 5.0 if name == "GN-Host" else 0.5
        rows.append({"rate": rate, "ttft_p90_s": ttft, "tpot_p90_s": tpot})
    return rows


def paper_like() -> dict:
    """A result holding every claim of the paper's section 6 at its own numbers."""
    t = ck.TARGETS
    fig9 = [{"size_mb": size, "mechanism": "GG-Host", "normalized": 1.0} for size in (10, 1280)]
    for mech, (small, large) in t["fig9"].items():
        fig9 += [{"size_mb": 10, "mechanism": mech, "normalized": small},
                 {"size_mb": 1280, "mechanism": mech, "normalized": large}]
    result = {"fig9": fig9, "table1": dict(t["table1"]), "targets": t,
              "knees": copy.deepcopy(KNEES), "efficiency": copy.deepcopy(t["efficiency"]),
              "knees_bisected": {w: {n: (k + 0.02 if math.isfinite(k) else k)
                                     for n, k in knees.items()} for w, knees in KNEES.items()},
              "throughput_at_knee": {}, "steady_throughput_at_knee": {}, "sweeps": {}}
    for workload, gap in t["throughput_gap"].items():
        tput = {"GG-Direct": 1000.0, "GN-HAWK": 1000.0 * (1 + gap)}
        result["throughput_at_knee"][workload] = dict(tput)
        result["steady_throughput_at_knee"][workload] = dict(tput)
        result["sweeps"][workload] = {
            n: {"knee_rate": KNEES[workload][n], "rows": _rows(workload, n)} for n in TPOT}
        result["sweeps"][workload]["GN-Direct"] = {"knee_rate": math.nan, "rows": [],
                                                  "num_failed_out_of_memory": 3}
    return result


def _holds(result) -> dict:
    return {r["check"]: r["holds"] for r in ck.checks(result)}


# -- (c) every check can hold at once --------------------------------------------------------
def test_every_check_holds_on_a_result_that_says_what_the_paper_says():
    """The paper's own numbers hold every check: Chatbot's TPOT stays under the SLO at every
    rate while Summarization's GN-HAWK TPOT reaches it (at about 0.60 req/s) first."""
    held = _holds(paper_like())
    assert [what for what, ok in held.items() if not ok] == []
    assert "summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than " \
        "GG-Direct's" in held
    assert "chatbot GG-Direct and GN-HAWK P90 TPOT under the SLO at every rate" in held


def test_the_tpot_claims_still_fail_when_the_numbers_do():
    result = paper_like()
    for row in result["sweeps"]["chatbot"]["GN-HAWK"]["rows"][-3:]:
        row["tpot_p90_s"] = 0.25                          # Chatbot's TPOT over the SLO
    for row in result["sweeps"]["summarization"]["GN-HAWK"]["rows"]:
        row["tpot_p90_s"] = 0.05                          # Summarization's never reaches it
    held = _holds(result)
    assert not held["chatbot GG-Direct and GN-HAWK P90 TPOT under the SLO at every rate"]
    assert not held["summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than "
                    "GG-Direct's"]
    assert not held["summarization GN-HAWK's P90 TPOT reaches the SLO at about 0.60 req/s"]


# -- (d) a missing value fails ---------------------------------------------------------------
def test_a_missing_knee_is_not_never_reaching_90_percent():
    result = paper_like()
    result["knees"]["chatbot"]["GN-Host"] = None          # beyond the sweep, or not run
    assert not _holds(result)["chatbot GN-Host never reaches 90% attainment"]
    target = ck.Target("chatbot knee GN-Host", "knee", math.nan)
    assert ck.residual(target, None) == 10.0 and ck.residual(target, math.nan) == 0.0
    from sim.paper.fit_record import error

    assert error("knee", None, math.nan) is None and error("knee", math.nan, math.nan) == 0.0


def test_a_missing_sweep_or_knee_fails_its_claim_instead_of_dropping_it():
    result = paper_like()
    del result["sweeps"]["summarization"]["GN-HAWK"]
    rows = {r["check"]: r for r in ck.checks(result)}
    for what in ("summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than "
                 "GG-Direct's", "summarization knees: GG-Direct >= GN-HAWK > GG-Host > GN-Host"):
        assert not rows[what]["holds"] and rows[what]["ours"] == ck.MISSING
    result = paper_like()
    result["sweeps"]["chatbot"]["GG-Host"]["knee_rate"] = None
    assert not _holds(result)["chatbot knees: GG-Direct >= GN-HAWK > GG-Host > GN-Host"]


def test_a_nan_tpot_is_missing_not_under_the_slo():
    result = paper_like()
    result["sweeps"]["chatbot"]["GG-Direct"]["rows"][4]["tpot_p90_s"] = math.nan
    result["sweeps"]["summarization"]["GN-HAWK"]["rows"][0]["tpot_p90_s"] = math.nan
    held = _holds(result)
    assert not held["chatbot GG-Direct and GN-HAWK P90 TPOT under the SLO at every rate"]
    assert not held["chatbot GG-Host P90 TPOT above GG-Direct's"]
    assert not held["summarization GN-HAWK's P90 TPOT reaches the SLO at a lower rate than "
                    "GG-Direct's"]


# -- (a) the throughput gap is measured over the steady window -------------------------------
def test_the_throughput_gap_reads_the_steady_window_not_the_whole_run():
    result = paper_like()
    result["steady_throughput_at_knee"]["summarization"]["GN-HAWK"] = 800.0   # -20%
    values = {what: ours for _, what, ours, _ in ck.target_values(result)}
    assert values["summarization GN-HAWK throughput at knee vs GG-Direct"] == \
        pytest.approx(-0.2)
    assert not _holds(result)["summarization GN-HAWK throughput at knee vs GG-Direct"]


def test_the_fit_objective_takes_the_gap_from_the_steady_window(tmp_path, monkeypatch):
    """``hawk calibrate``'s model: the gap targets come from the knee run's steady window."""
    from sim.paper import calibrate

    def fake_serving(workload, profile, seed=0):
        base = {"tokens_per_joule": 1.0, "tokens_per_s_per_dollar": 1.0}
        return {"GG-Host": {"knee_rate": 0.4, "at_knee": None},
                "GN-Host": {"knee_rate": math.nan, "at_knee": None},
                "GG-Direct": {"knee_rate": 0.65, "at_knee": dict(
                    base, output_tokens_per_s=100.0, steady_output_tokens_per_s=200.0)},
                "GN-HAWK": {"knee_rate": 0.65, "at_knee": dict(
                    base, output_tokens_per_s=100.0, steady_output_tokens_per_s=150.0)}}

    monkeypatch.setattr(calibrate, "_serving", fake_serving)
    template = (calibrate.PROFILE_DIR / "paper.toml").read_text()
    values = {p.name: p.start for p in calibrate.PARAMETERS}
    out = calibrate.model(values, template, str(tmp_path))
    assert out["chatbot GN-HAWK throughput at knee vs GG-Direct"] == pytest.approx(-0.25)


# -- (b) knees on the paper's grid, and bisected ---------------------------------------------
def _meets_below(knee: float, calls: list):
    def meets(rate: float) -> bool:
        calls.append(rate)
        return rate <= knee
    return meets


def test_the_grid_knee_is_searched_in_a_gap_and_then_bisected():
    calls: list = []
    rows = [{"rate": r, "slo_attainment": 0.95 if r <= 0.63 else 0.5} for r in (0.2, 0.4, 0.6,
                                                                                0.8)]
    knee = refine_knee(_meets_below(0.63, calls), rows, 0.9, bisection_steps=2)
    assert knee["grid"] == pytest.approx(0.6)             # 0.65 and 0.7 searched, both miss
    assert calls[:2] == [pytest.approx(0.7), pytest.approx(0.65)]
    lo, hi = knee["bracket"]
    assert 0.6 <= knee["bisected"] == lo <= 0.63 < hi <= 0.65
    assert hi / lo <= (0.65 / 0.6) ** 0.25 + 1e-9        # two geometric bisections
    assert len(calls) == 4


def test_a_swept_neighbour_needs_no_search_and_the_ends_are_never_or_missing():
    calls: list = []
    rows = [{"rate": r, "slo_attainment": 0.95 if r <= 0.5 else 0.5}
            for r in (0.45, 0.5, 0.55)]
    knee = refine_knee(_meets_below(0.5, calls), rows, 0.9, bisection_steps=0)
    assert knee == {"grid": 0.5, "bisected": 0.5, "bracket": [0.5, 0.55]} and calls == []
    every = [{"rate": r, "slo_attainment": 1.0} for r in (0.2, 0.4)]
    none = [{"rate": r, "slo_attainment": 0.1} for r in (0.2, 0.4)]
    assert refine_knee(_meets_below(9, calls), every)["grid"] is None          # missing
    assert math.isnan(refine_knee(_meets_below(0, calls), none)["grid"])      # never
    assert calls == []


def test_rates_off_the_paper_grid_are_refused_by_name():
    assert grid_index(0.65) == 13 and PAPER_RATE_STEP == 0.05
    with pytest.raises(ValueError, match="0.33 req/s is not on the paper's grid"):
        grid_index(0.33)


def test_the_full_sweeps_hold_every_grid_rate_where_the_papers_knees_lie():
    """From 0.3 to 0.8 req/s (the knees 0.38 to 0.65 and one step past the highest) every
    grid rate is swept, so no knee there needs a search."""
    from sim.paper.experiments import sweep_settings

    for workload in ("chatbot", "summarization"):
        rates = sweep_settings(workload, quick=False)["rates"]
        ks = {grid_index(r) for r in rates}
        assert set(range(6, 17)) <= ks, workload


def test_a_profile_sweeping_off_the_grid_is_refused_naming_its_field(tmp_path):
    from sim.config import ConfigError
    from sim.paper import calibrate, experiments

    text = (calibrate.PROFILE_DIR / "paper.toml").read_text().replace(
        "quick_chatbot_rates = [0.2, 0.4, 0.6, 0.8]", "quick_chatbot_rates = [0.2, 0.33, 0.6]")
    path = tmp_path / "offgrid.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"\[serving\] quick_chatbot_rates: rate 0.33 req/s "
                                          r"is not on the paper's grid"):
        experiments.serving("chatbot", names=(), quick=True, profile=str(path))
