"""The map of ``sim.runs.paymap``: each cell is the planner's verdict at that point, margins
point the winner's way, ``hawk plan --map`` refuses nonsense in one line and writes its PNG;
and the code workload's lengths are the bundled Azure code trace's."""

import json
import math

import numpy as np
import pytest

from sim.commands.main import main
from sim.config import RunConfig
from sim.runs import capacity as pl
from sim.runs import paymap as pm
from sim.runs.plan_report import format_map

#: one GPU aggregated candidate and a GPU+NPU disaggregated one per count, TP4 only
SPACE = pl.Space(prefill_devices=("a100-pcie",), decode_devices=("p150a",),
                 aggregated_devices=("a100-pcie",), tps=(4,), mechanisms=("GN-HAWK",),
                 max_instances=2, max_candidates=6, max_knees=2)
BASE = RunConfig().replace(**{"workload.num_requests": 120})
WORKLOADS, RATES = ("chatbot", "summarization"), (0.3, 1.0)
FLAGS = ["--num-requests", "60", "--prefill-devices", "a100-pcie", "--decode-devices", "p150a",
         "--aggregated-devices", "a100-pcie", "--tp", "4", "--mechanisms", "GN-HAWK",
         "--max-instances", "1", "--workers", "1"]


@pytest.fixture(scope="module")
def rows():
    return pm.paymap(BASE, WORKLOADS, RATES, 0.9, SPACE, workers=1, progress=False)


def test_each_cell_is_what_the_planner_says_at_that_point(rows):
    assert [(r["workload"], r["rate"]) for r in rows] == [(w, r) for w in WORKLOADS
                                                          for r in RATES]
    for row in rows:
        config = pm.point_config(BASE, row["workload"], row["rate"])
        assert (config.slo.ttft_s, row["ttft_slo_s"]) == ((2.0, 2.0) if row["workload"] ==
                                                          "chatbot" else (15.0, 15.0))
        direct = pl.plan(config, row["rate"], 0.9, SPACE, workers=1, progress=False)
        for metric in pm.METRICS:                    # knees bisected there, none in the map
            v = direct["verdict"][metric]
            assert row[f"{metric}_winner"] == v["winner"]
            assert row[f"{metric}_margin"] == pytest.approx(v["margin"], nan_ok=True)
            if v["winner"] is not None:
                assert row[f"{metric}_{v['winner']}_config"] == v["best"]
    assert {r["cost_winner"] for r in rows} - {None}, "some cell has a winner"


def test_margins_point_the_winners_way(rows):
    both = 0
    for row in rows:
        for metric, lower in (("cost", True), ("energy", False)):
            win, margin = row[f"{metric}_winner"], row[f"{metric}_margin"]
            agg, dis = row[f"{metric}_aggregated"], row[f"{metric}_disaggregated"]
            met = {d for d, v in (("aggregated", agg), ("disaggregated", dis)) if v == v}
            if len(met) < 2:                         # one deployment meets the target, or none
                assert win == (met.pop() if met else None) and math.isnan(margin)
                continue
            ours, other = (agg, dis) if win == "aggregated" else (dis, agg)
            both += 1
            assert margin >= 0
            assert (ours <= other) if lower else (ours >= other)
            expected = (other - ours) / other if lower else (ours - other) / other
            assert margin == pytest.approx(expected)
    assert both, "some cell has both deployments meeting the target"


def test_the_rows_are_the_same_whichever_runs_the_points(rows):
    from traces.jsonout import dumps

    two = pm.paymap(BASE, WORKLOADS, RATES, 0.9, SPACE, workers=2, progress=False)
    assert dumps(two) == dumps(rows)


def test_the_table_shows_every_point_and_its_margin(rows):
    text = format_map(rows)
    for r in rows:
        line = next(x for x in text.splitlines() if x.startswith(f"{r['workload']:<14} "
                                                                  f"{r['rate']:>6g}"))
        if r["cost_winner"] is not None and r["cost_margin"] == r["cost_margin"]:
            assert f"+{100 * r['cost_margin']:.0f}%" in line and r["cost_winner"] in line


@pytest.mark.parametrize("argv, message", [
    (("--rates", "0,1"), "--rates '0,1': rates must be > 0"),
    (("--rates", "1:a:1"), "--rates '1:a:1': expected start:stop:step"),
    (("--workloads", "chatbot,poetry"), "--workloads 'chatbot,poetry': choose from"),
    (("--workloads", "chatbot,chatbot"), "a workload is named twice"),
    (("--workloads", ","), "--workloads ',': choose from"),
    (("--rate", "1"), "--rate with --map: the map takes --rates"),
    (("--workload", "code"), "--workload with --map: the map takes --workloads"),
    (("--ttft-slo", "3"), "give both"),
    (("--plot", "f.png"), "--plot with --map: a map has no single plan's frontier"),
])
def test_bad_map_flags_are_refused_in_one_line(tmp_path, capsys, argv, message):
    png = tmp_path / "map.png"
    assert main(["plan", "--map", str(png), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not png.exists()


def test_map_flags_need_the_map(capsys):
    assert main(["plan", "--rates", "1,2"]) == 2
    assert "--rates needs --map PNG" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "--rate is required" in capsys.readouterr().err


def test_the_map_is_printed_and_drawn(tmp_path, capsys):
    png = tmp_path / "map.png"
    assert main(["plan", "--map", str(png), "--rates", "0.3", "--workloads", "chatbot",
                 *FLAGS]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.splitlines()[-1] == f"map written to {png}"
    assert out.splitlines()[1].startswith("chatbot           0.3  ")
    assert main(["plan", "--map", str(png), "--rates", "0.3", "--workloads", "chatbot",
                 *FLAGS, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["workload"], row["rate"]) == ("chatbot", 0.3)


def test_the_code_workload_draws_from_the_azure_code_trace():
    from traces.bundled import data_path
    from traces.workloads import length_table, make_workload, workload_spec

    columns = np.loadtxt(data_path("azure-llm-2023-code.csv"), delimiter=",", skiprows=1,
                         usecols=(1, 2), dtype=np.int64)
    prompt, output = length_table(workload_spec("code").lengths_file)
    assert np.array_equal(prompt, columns[:, 0]) and np.array_equal(output, columns[:, 1])
    trace = make_workload("code", 2.0, num_requests=300, seed=1)
    pairs = set(zip(columns[:, 0].tolist(), columns[:, 1].tolist()))
    assert all(p in pairs for p in zip(trace.num_prompt_tokens.tolist(),
                                       trace.num_output_tokens.tolist()))
