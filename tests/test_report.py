"""The paper report's fit table: every fitted target beside the paper's value, the fit's value
and residual, and its leave-one-out prediction and error, in report.md and on hawk paper's
stdout. Built on the packaged fit record and a result made from it, so no sweep runs."""

import math

import pytest

from sim.paper import experiments as paper
from sim.paper.checks import TARGETS, load_fit_record
from sim.paper.report import (COMPARISON_COLUMNS, FIT_COLUMNS, comparison_table, fit_table, fit_text,
                        markdown)


@pytest.fixture(scope="module")
def record():
    return load_fit_record("paper")["targets"]


def make_result(record, knee: float = 0.5) -> dict:
    """A ``run_paper``-shaped result whose transfer and Table 1 values are the fit's own and
    whose knees are all ``knee``; no sweeps."""
    fig9 = [{"size_mb": size, "mechanism": mech,
             "normalized": record[f"Fig 9 {mech}/GG-Host at {size} MB"]["fit_value"]}
            for mech in TARGETS["fig9"] for size in (10, 1280)]
    result = {"profile": "paper", "quick": True, "targets": TARGETS, "fig9": fig9,
              "table1": {k: record[f"Table 1 {k}"]["fit_value"] for k in TARGETS["table1"]},
              "knees": {w: dict.fromkeys(names, knee) for w, names in TARGETS["knees"].items()},
              "efficiency": {}, "throughput_at_knee": {}, "steady_throughput_at_knee": {},
              "checks": [], "sweeps": {}}
    result.update(paper.fit_summary(result))
    return result


def md_rows(text: str) -> dict[str, list[str]]:
    """The fit table of report.md, by target."""
    table = text[text.index("| " + " | ".join(FIT_COLUMNS) + " |"):].split("\n\n")[0]
    rows = [line.strip("|").split(" | ") for line in table.splitlines()[2:]]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows}


def test_the_fit_table_has_one_row_per_target_with_paper_fit_and_loo(record):
    rows = md_rows(markdown(make_result(record)))
    assert set(rows) == set(record)
    col = {name: i for i, name in enumerate(FIT_COLUMNS)}
    for name, t in record.items():
        row = rows[name]
        assert len(row) == len(FIT_COLUMNS), name
        if t["kind"] == "ratio":
            assert float(row[col["paper"]]) == pytest.approx(t["paper"], rel=1e-3)
            assert float(row[col["fitted"]]) == pytest.approx(t["fit_value"], rel=1e-3)
            assert float(row[col["LOO"]]) == pytest.approx(t["loo_value"], rel=1e-3)
            # the LOO error is the LOO prediction against the paper, in percent
            loo_err = float(row[col["LOO error"]].rstrip("%")) / 100
            assert loo_err == pytest.approx(t["loo_value"] / t["paper"] - 1, abs=6e-4)
        assert float(row[col["residual"]]) == pytest.approx(t["residual"], abs=6e-3)
        assert float(row[col["LOO residual"]]) == pytest.approx(t["loo_residual"], abs=6e-3)


def test_loo_errors_are_in_each_targets_own_terms(record):
    rows = {row[0]: row for row in fit_table(make_result(record))}
    col = {name: i for i, name in enumerate(FIT_COLUMNS)}
    knee = next(n for n, t in record.items() if t["kind"] == "knee" and math.isfinite(t["paper"]))
    text = rows[knee][col["LOO error"]]
    assert text.endswith(" req/s")
    assert float(text.split()[0]) == pytest.approx(
        record[knee]["loo_value"] - record[knee]["paper"], abs=6e-4)
    gap = next(n for n, t in record.items() if t["kind"] == "gap")
    assert rows[gap][col["LOO error"]].endswith(" pts")
    assert float(rows[gap][col["LOO error"]].split()[0]) == pytest.approx(
        100 * (record[gap]["loo_value"] - record[gap]["paper"]), abs=6e-3)
    never = next(n for n, t in record.items() if t["kind"] == "knee" and math.isnan(t["paper"]))
    assert rows[never][col["paper"]] == "never"


def test_this_run_column_is_the_runs_value_not_the_fits(record):
    rows = {row[0]: row for row in fit_table(make_result(record, knee=0.45))}
    col = {name: i for i, name in enumerate(FIT_COLUMNS)}
    assert rows["chatbot knee GG-Direct"][col["this run"]] == "0.45"
    assert rows["chatbot knee GG-Direct"][col["fitted"]] != "0.45"


def test_hawk_paper_prints_the_fit_table(record, monkeypatch, capsys):
    from sim.commands.main import main

    result = make_result(record)
    monkeypatch.setattr(paper, "run_paper", lambda quick, workers, say=None: result)
    assert main(["paper", "--quick"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("target "))
    assert lines[start].split() == "target paper fitted residual LOO LOO error LOO residual " \
                                   "noise this run".split()
    table = lines[start + 1:start + 1 + len(record)]
    expected = {row[0]: row[1:] for row in fit_table(result)}
    for line in table:
        name = next(n for n in expected if line.startswith(n + " "))
        assert line[len(name):].split() == " ".join(expected.pop(name)).split(), name
    assert not expected                       # every target printed once


def test_no_fit_record_no_fit_table(record):
    result = make_result(record)
    result.update(free_parameters=None, fit=[])
    assert fit_text(result) == "" and "## The fit" not in markdown(result)


def test_the_targets_table_gives_each_error_in_its_checks_terms(record):
    result = make_result(record, knee=0.45)
    result["knees"]["chatbot"]["GN-Host"] = math.nan             # never reaches 90%
    result["knees"]["summarization"]["GG-Host"] = None           # missing: beyond the sweep
    result["steady_throughput_at_knee"]["chatbot"] = {"GN-HAWK": 97.0, "GG-Direct": 100.0}
    rows = {row[0]: row[1:] for row in comparison_table(result)}
    ours, paper_value, err = rows["chatbot knee GG-Direct (req/s)"]
    assert (ours, paper_value) == ("0.45", "0.65")
    assert err == f"{0.45 - TARGETS['knees']['chatbot']['GG-Direct']:+.3f} req/s"   # not -31%
    assert rows["chatbot knee GN-Host (req/s)"] == ("never", "never", "+0.000 req/s")
    assert rows["summarization knee GG-Host (req/s)"] == ("missing", "0.38", "n/a")
    gap = rows["chatbot GN-HAWK throughput at knee vs GG-Direct"]
    assert gap == ("-3.00%", "-0.48%", "-2.52 pts")
    ratio = rows["Table 1 decode_ratio"]
    assert ratio[2] == f"{100 * (record['Table 1 decode_ratio']['fit_value'] / 1.16 - 1):+.1f}%"
    assert "| " + " | ".join(COMPARISON_COLUMNS) + " |" in markdown(result)


def test_hawk_paper_says_its_settings_and_which_checks_lean_on_the_fit(record, monkeypatch,
                                                                        capsys):
    from sim.commands.main import main

    result = make_result(record)
    result["sweeps"] = {"chatbot": {}}
    result["checks"] = [
        {"check": "claim A", "holds": True, "fitted": True, "loo_holds": False},
        {"check": "claim B", "holds": False, "fitted": False},
        {"check": "claim C", "holds": True, "fitted": True, "loo_holds": True}]
    monkeypatch.setattr(paper, "run_paper", lambda quick, workers, say=None: result)
    assert main(["paper", "--quick"]) == 0
    out = capsys.readouterr().out.splitlines()
    rates = ", ".join(f"{r:g}" for r in paper.sweep_settings("chatbot", True)["rates"])
    assert out[0].startswith("hawk paper: profile paper, quick settings (hawk paper --quick)")
    assert f"chatbot rates {rates} req/s" in out[0]
    assert "2 of 3 claims of the paper's section 6 hold (2 fitted, 1 predicted)" in out
    assert "  holds here, not by the leave-one-out prediction: claim A" in out
    assert "  does not hold (predicted): claim B" in out
    assert not any("claim C" in line for line in out)


def test_hawk_calibrates_printout_gives_loo_errors_in_each_targets_terms(record):
    from sim.paper.fit_record import report_lines

    lines = report_lines(load_fit_record("paper")).splitlines()
    for name, t in record.items():
        line = next(x for x in lines if x.startswith(name + " "))
        unit = {"ratio": "%", "knee": " req/s", "gap": " pts"}[t["kind"]]
        assert unit in line, name


def test_the_checks_table_says_which_fitted_claims_hold_by_leave_one_out(record):
    result = make_result(record)
    result["checks"] = [
        {"check": "chatbot knee GG-Host", "target": "chatbot knee GG-Host", "ours": 0.4,
         "paper": 0.4, "tolerance": "+-0.05 req/s", "holds": True, "fitted": True,
         "loo_holds": False},
        {"check": "chatbot GN-HAWK throughput at knee vs GG-Direct", "ours": -0.03,
         "target": "chatbot GN-HAWK throughput at knee vs GG-Direct", "paper": -0.0048,
         "tolerance": "within 2 points of the paper's", "holds": False, "fitted": True,
         "loo_holds": True},
        {"check": "TPOT reaches the SLO first", "target": None, "ours": [math.inf, 0.5],
         "paper": None, "tolerance": "first rate over the TPOT SLO", "holds": False,
         "fitted": False}]
    text = markdown(result)
    assert "| claim | ours | paper | tolerance | holds | | LOO |" in text
    assert "| chatbot knee GG-Host | 0.4 | 0.4 | +-0.05 req/s | yes | fitted | **no** |" in text
    assert ("| chatbot GN-HAWK throughput at knee vs GG-Direct | -3.00% | -0.48% | within 2 "
            "points of the paper's | **no** | fitted | yes |") in text
    assert "| TPOT reaches the SLO first | never / 0.5 | n/a |" in text
