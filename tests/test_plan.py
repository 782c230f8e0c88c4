"""``hawk plan``: costs from the catalog and the plan file, bounds that prune before any
simulation, knees by bisection, the Pareto frontier, and the command's output."""

import json
import math

import pytest

from sim.runs import capacity as pl
from sim.commands.main import main
from sim.engine.cluster import simulate
from sim.config import ConfigError, RunConfig
from sim.models import cost
from sim.models.cost import SECONDS_PER_YEAR, capex_usd, cost_inputs

SMALL = pl.Space(prefill_devices=("a100-pcie",), decode_devices=("p150a",), tps=(4,),
                 mechanisms=("GN-HAWK",), max_instances=3, max_candidates=4, max_knees=2,
                 deployments=("disaggregated",))


def test_the_planner_prices_by_the_profile_with_the_users_catalog_over_it(tmp_path):
    config = RunConfig()          # 4x A100 PCIe prefill, 4x p150a decode, one instance each
    profile = pl.cost_profile(config, {})
    inputs = cost_inputs(profile)             # the paper profile's [cost] (sim.models.cost)
    rest = 2 * inputs.host["price_usd"] + 2 * inputs.nic["price_usd"]   # one host, NIC each
    assert cost.capital_usd_per_s(config, profile) == pytest.approx(
        (capex_usd(config) + rest) / (inputs.lifetime_years * SECONDS_PER_YEAR))
    path = tmp_path / "costs.toml"
    path.write_text("lifetime_years = 5.0\n[nic]\nprice_usd = 3000.0\n")
    mine = cost_inputs(pl.cost_profile(config, pl.load_costs(path)))
    assert (mine.lifetime_years, mine.nic["price_usd"]) == (5.0, 3000.0)
    assert mine.nic["power_w"] == inputs.nic["power_w"]                 # kept
    path.write_text("[gpu]\nprice_usd = 1\n")
    with pytest.raises(ConfigError, match=r"costs\.toml: unknown key\(s\) \['gpu'\]"):
        pl.load_costs(path)
    path.write_text("[host]\nprice_usd = -5\n")
    with pytest.raises(ConfigError, match=r"costs\.toml: \[cost.host\] price_usd must be a number"):
        pl.load_costs(path)


def test_a_runs_summary_and_the_planner_give_one_cost_per_success():
    config = RunConfig().replace(**{"workload.num_requests": 100})
    row = pl._evaluate((config, 1.0, 0.9, pl.cost_profile(config, {})))
    assert row["usd_per_success"] == pytest.approx(simulate(config).summary["usd_per_request"])


def test_bounds_prune_before_simulating():
    space = pl.Space(prefill_devices=("a100-pcie",), decode_devices=("p150a",), tps=(1, 2, 4),
                     mechanisms=("GN-HAWK",), max_instances=8, deployments=("disaggregated",))
    cap = pl.phase_capacity(RunConfig(), "prefill", *pl._mean_lengths("chatbot"))
    rate = 2.5 * cap / 0.9                   # one TP4 prefill instance cannot keep up
    found, pruned = pl.candidates(RunConfig(), space, rate=rate, target=0.9)
    # TP1 and TP2 cannot hold 70B on either side; TP4 p150a (32 GB each) can
    assert pruned["memory"] >= 3
    need = math.ceil(rate * 0.9 / cap)
    counts = {c[0].cluster.prefill.num_instances for c, _ in found
              if c[0].cluster.prefill.tp == 4}
    assert counts == {need, need + 1} and need > 1           # fewer cannot keep up
    assert pruned["roofline"] >= need - 1
    for configs, bound in found:                          # the bound is what both phases allow
        if configs[0].cluster.prefill.tp == 4:
            assert bound <= configs[0].cluster.prefill.num_instances * cap + 1e-9


def test_the_knee_is_bracketed_by_a_passing_and_a_failing_rate():
    base = RunConfig().replace(**{"workload.num_requests": 200})
    result = pl.plan(base, 0.5, 0.9, SMALL, workers=1, progress=False)
    best = result["cheapest"]
    assert best is not None and best["meets_target"]
    lo, hi = best["knee_bracket"]
    config = base.replace(**best["changes"])
    assert simulate(config.replace(**{"workload.rate": lo})).summary["slo_attainment"] >= 0.9
    assert simulate(config.replace(**{"workload.rate": hi})).summary["slo_attainment"] < 0.9
    assert best["usd_per_success"] > 0 and best["tokens_per_joule"] > 0
    assert result["frontier"][0]["usd_per_success"] == min(
        r["usd_per_success"] for r in result["candidates"] if r["knee_rate"] is not None)


def test_pareto_keeps_only_rows_nothing_beats_on_both():
    rows = [{"usd_per_success": c, "knee_rate": k} for c, k in
            [(1.0, 1.0), (2.0, 3.0), (2.5, 2.0), (3.0, 3.0), (1.5, 1.0)]]
    assert [(r["usd_per_success"], r["knee_rate"]) for r in pl.pareto(rows)] == [
        (1.0, 1.0), (2.0, 3.0)]


def test_cli_json_names_the_cheapest_with_its_knee_and_cost(tmp_path, capsys):
    plot = tmp_path / "frontier.png"
    assert main(["plan", "--workload", "chatbot", "--rate", "0.5", "--num-requests", "200",
                 "--prefill-devices", "a100-pcie", "--decode-devices", "p150a", "--tp", "4",
                 "--mechanisms", "GN-HAWK", "--max-candidates", "2", "--max-knees", "1",
                 "--deployments", "disaggregated",
                 "--workers", "1", "--plot", str(plot), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cheapest = result["cheapest"]
    assert cheapest["config"].startswith("1x(4x a100-pcie) -> 1x(4x p150a")
    assert cheapest["knee_rate"] >= 0.5 and cheapest["usd_per_success"] > 0
    assert plot.stat().st_size > 0
    assert main(["plan", "--rate", "1", "--mechanisms", "GN-Teleport"]) == 2
    assert "--mechanisms 'GN-Teleport': choose from" in capsys.readouterr().err


def test_a_candidate_that_cannot_be_simulated_is_reported_not_fatal(monkeypatch):
    import sim.engine.cluster

    def broken(config, *args, **kwargs):
        raise RuntimeError(f"no model for {config.cluster.link.mechanism}")

    monkeypatch.setattr(sim.engine.cluster, "simulate", broken)
    result = pl.plan(RunConfig().replace(**{"workload.num_requests": 50}), 0.5, 0.9, SMALL,
                     workers=1, progress=False)
    assert result["cheapest"] is None and result["frontier"] == []
    assert result["failed"][0]["error"] == "RuntimeError: no model for GN-HAWK"
    assert "could not simulate 1x(4x a100-pcie)" in pl.format_plan(result)
