"""The paper profile's sensitivity table: moves in tolerances, a parameter that moves nothing
named as such, each parameter's source from the profile's text, and the written table."""

import pytest

from sim.paper import sensitivity as sens
from sim.paper.calibrate import PARAMETERS, Parameter
from sim.paper.checks import Target


def test_moves_are_in_tolerances_and_a_still_parameter_is_named():
    targets = [Target("knee", "knee", 0.5), Target("ratio", "ratio", 2.0)]
    params = [Parameter("transfer", "a_s", 1.0, 0.5, 2.0),
              Parameter("transfer", "b_s", 1.0, 0.5, 2.0)]
    base = {"knee": 0.5, "ratio": 2.0}
    outputs = {("transfer.a_s", "low"): {"knee": 0.6, "ratio": 2.0},      # 2 tolerances
               ("transfer.a_s", "high"): {"knee": 0.45, "ratio": 2.3},    # 1 each
               ("transfer.b_s", "low"): {"knee": 0.501, "ratio": 2.0},
               ("transfer.b_s", "high"): {"knee": 0.5, "ratio": 2.01}}
    a, b = sens.table_from(base, outputs, params, targets)
    assert a["moves"] == {"knee": pytest.approx(2.0), "ratio": pytest.approx(1.0)}
    assert a["largest_move"] == pytest.approx(2.0) and a["moved_most"] == "knee"
    assert not a["moves_nothing"] and b["moves_nothing"]


def test_a_parameters_source_is_its_comment_in_the_profile():
    text = "[transfer]\nx = 1  # not this\n\n[efficiency.p150a]\nx = 2  # FITTED (here)\n"
    assert sens.source(text, Parameter("efficiency.p150a", "x", 1.0, 0.5, 3.0)) == \
        "FITTED (here)"
    assert sens.source(text, Parameter("transfer", "y", 1.0, 0.5, 3.0)) == ""


def test_the_written_table_covers_every_parameter_and_reads_into_the_report():
    table = sens.load("paper")
    assert [p["name"] for p in table["parameter"]] == [p.name for p in PARAMETERS]
    for row, p in zip(table["parameter"], PARAMETERS):
        assert (row["low"], row["high"]) == pytest.approx((p.low, p.high))
        assert row["low"] <= row["value"] <= row["high"] and row["source"].startswith("FITTED")
        assert row["largest_move"] == pytest.approx(max(row["moves"].values()), rel=1e-3)
    lines = sens.sensitivity_markdown(table)
    assert lines[1] == "## Sensitivity of the figures to each fitted parameter"
    assert len([line for line in lines if line.startswith("| transfer.")]) == 5
    assert sens.sensitivity_markdown(None) == []
