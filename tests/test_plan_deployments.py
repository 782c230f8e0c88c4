"""``hawk plan`` over aggregated and disaggregated deployments: a space whose answer is known
by construction, the verdict's text, what binds, and the command's JSON."""

import json
import math

import pytest

from sim.commands.main import main
from sim.config import RunConfig, load_config
from sim.models import cost
from sim.runs import capacity as pl
from sim.runs.verdict import binds, shape_of, verdict, with_kind

#: one aggregated candidate (4x A100 PCIe) and one disaggregated one (the same 4x A100 PCIe
#: prefilling for 4x p150a): the second holds strictly more hardware
TWO = pl.Space(prefill_devices=("a100-pcie",), decode_devices=("p150a",),
               aggregated_devices=("a100-pcie",), tps=(4,), mechanisms=("GN-HAWK",),
               max_instances=1, max_candidates=4, max_knees=2)
BASE = RunConfig().replace(**{"workload.num_requests": 150})


@pytest.fixture(scope="module")
def two():
    return pl.plan(BASE, 0.3, 0.9, TWO, workers=1, progress=False)


def test_the_candidate_with_less_hardware_and_the_same_work_is_cheaper(two):
    rows = {r["deployment"]: r for r in two["candidates"]}
    assert set(rows) == {"aggregated", "disaggregated"} and two["num_candidates"] == 2
    agg, dis = rows["aggregated"], rows["disaggregated"]
    assert agg["meets_target"] and dis["meets_target"]
    assert agg["config"] == "aggregated 1x(4x a100-pcie, batch 256)"
    assert (agg["shape"], dis["shape"]) == ("GPU aggregated", "GPU+NPU")
    assert agg["capital_usd_per_hour"] < dis["capital_usd_per_hour"]
    assert agg["usd_per_success"] < dis["usd_per_success"]
    v = two["verdict"]["cost"]
    assert v["winner"] == "aggregated"
    assert v["margin"] == pytest.approx(1 - agg["usd_per_success"] / dis["usd_per_success"])
    assert v["line"] == (f"aggregated 1x(4x a100-pcie, batch 256) is {100 * v['margin']:.0f}% "
                         f"cheaper per successful request than the cheapest disaggregated "
                         f"candidate, disaggregated {dis['config']}")
    assert two["by_deployment"]["disaggregated"]["cheapest"]["config"] == dis["config"]
    assert two["cheapest"]["config"] == agg["config"]
    # both deployments' best get a knee, and the knee of each meets the target at its rate
    assert agg["knee_rate"] >= 0.3 and dis["knee_rate"] >= 0.3


def test_an_aggregated_candidate_replays_from_its_changes(two):
    agg = two["by_deployment"]["aggregated"]["cheapest"]
    config = BASE.replace(**agg["changes"], **{"workload.rate": 0.3})
    assert config.cluster.kind == "aggregated" and config.cluster.aggregated.tp == 4
    from sim.engine.cluster import simulate

    s = simulate(config).summary
    assert cost.usd_per_success(s, config, pl.cost_profile(BASE, {})) == pytest.approx(
        agg["usd_per_success"])


def test_format_plan_prints_both_bests_and_the_verdicts(two):
    text = pl.format_plan(two)
    assert "  best aggregated: aggregated 1x(4x a100-pcie, batch 256)" in text
    assert "  best disaggregated: 1x(4x a100-pcie) -> 1x(4x p150a" in text
    assert f"verdict (cost): {two['verdict']['cost']['line']}" in text
    assert "verdict (energy): " in text and "binds: " in text


def _row(dep, usd, tpj, meets=True, name=None):
    return {"deployment": dep, "config": name or f"{dep[:3]}-{usd}", "usd_per_success": usd,
            "tokens_per_joule": tpj, "meets_target": meets}


def test_verdict_names_the_winner_the_margin_and_the_one_sided_cases():
    rows = [_row("aggregated", 1.0, 0.2), _row("aggregated", 3.0, 0.5),
            _row("disaggregated", 2.0, 0.4), _row("disaggregated", 0.5, 0.9, meets=False)]
    v = verdict(rows)
    assert (v["cost"]["winner"], v["cost"]["margin"]) == ("aggregated", 0.5)
    assert v["cost"]["best"] == "agg-1.0" and v["cost"]["runner_up"] == "dis-2.0"
    assert v["energy"]["winner"] == "aggregated"
    assert v["energy"]["margin"] == pytest.approx(0.25)
    assert v["energy"]["line"].startswith("aggregated agg-3.0 gets 25% more output tokens")
    only = verdict([_row("disaggregated", 2.0, 0.4), _row("aggregated", 1.0, 0.2, False)])
    assert only["cost"]["winner"] == "disaggregated" and math.isnan(only["cost"]["margin"])
    assert "no aggregated candidate meets it" in only["cost"]["line"]
    assert verdict([])["cost"]["winner"] is None


SUMMARY = {"num_requests": 100, "statuses": {"ok": 100}, "ttft_p90_s": 1.0, "ttft_slo_s": 2.0,
           "tpot_p90_s": 0.15, "tpot_slo_s": 0.2, "bottleneck": "decode"}


def test_what_binds_failures_first_then_kv_then_transfer_then_the_nearer_slo():
    assert binds(SUMMARY, {"decode_preemptions": [0]}) == (
        "decode", "TPOT P90 at 75% of its SLO")
    assert binds({**SUMMARY, "tpot_p90_s": 0.05}, {})[0] == "prefill"
    assert binds({**SUMMARY, "bottleneck": "link", "link_utilization": 0.97}, {}) == (
        "transfer", "link 97% busy")
    assert binds(SUMMARY, {"decode_preemptions": [6]})[0] == "KV capacity"
    assert binds({**SUMMARY, "aggregated_bottleneck": "kv_blocks", "aggregated_kv_use": 0.9,
                  "aggregated_utilization": 0.5}, {"aggregated_preemptions": [0]}) == (
        "KV capacity", "KV blocks 90% in use")
    failed = {**SUMMARY, "statuses": {"ok": 90, "failed_transfer": 10}}
    assert binds(failed, {}) == ("transfer", "10 request(s) failed_transfer")


def test_with_kind_keeps_the_workload_and_drops_the_other_shapes_tables():
    agg = load_config("examples/aggregated.toml")
    dis = with_kind(agg, "disaggregated")
    assert dis.cluster.kind == "disaggregated" and dis.cluster.aggregated is None
    assert (dis.workload, dis.seed, dis.slo) == (agg.workload, agg.seed, agg.slo)
    back = with_kind(dis, "aggregated")
    assert back.cluster.kind == "aggregated" and shape_of(back) == "GPU aggregated"
    assert shape_of(RunConfig()) == "GPU+NPU"


def test_cli_json_lists_both_deployments_with_a_verdict(capsys):
    assert main(["plan", "--workload", "chatbot", "--rate", "0.3", "--num-requests", "100",
                 "--prefill-devices", "a100-pcie", "--decode-devices", "p150a",
                 "--aggregated-devices", "a100-pcie,p150a", "--tp", "4",
                 "--mechanisms", "GN-HAWK", "--max-instances", "1", "--max-candidates", "4",
                 "--max-knees", "1", "--workers", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deployments"] == ["aggregated", "disaggregated"]
    shapes = {r["shape"] for r in result["candidates"]}
    assert {"GPU aggregated", "GPU+NPU"} <= shapes
    for row in result["candidates"]:
        assert row["binds"] in ("prefill", "decode", "KV capacity", "transfer", "none")
        assert row["deployment"] in ("aggregated", "disaggregated")
    assert set(result["verdict"]) == {"cost", "energy"}
    assert result["verdict"]["cost"]["winner"] in ("aggregated", "disaggregated")
    assert set(result["by_deployment"]) == {"aggregated", "disaggregated"}
    assert main(["plan", "--rate", "1", "--deployments", "monolith"]) == 2
    assert "--deployments 'monolith': choose from" in capsys.readouterr().err
