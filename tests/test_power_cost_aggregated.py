"""Power and cost of aggregated and "both" clusters: hand-computed tiny cases, the step meter
against the roofline, and a run's summary."""

import math

import pytest

from sim.config import RunConfig, load_config
from sim.engine.cluster import make_predictor, simulate
from sim.models.cost import capex_usd, cost_inputs, devices_of, hosts_and_nics, run_cost
from sim.models.power import StepMeter, aggregated_energy_j, power_model, run_energy

PROFILE = {
    "power": {
        "a100-pcie": dict(idle_w=50.0, prefill_w=300.0, decode_w=250.0, asic_fraction_idle=0.5,
                          asic_fraction_prefill=0.8, asic_fraction_decode=0.6),
        "p150a": dict(idle_w=20.0, prefill_w=150.0, decode_w=100.0, asic_fraction_idle=1.0,
                      asic_fraction_prefill=1.0, asic_fraction_decode=1.0),
    },
    "price": {"a100-pcie": 10000.0, "p150a": 1000.0},
    "cost": {"model": "amortised", "lifetime_years": 1.0, "usd_per_kwh": 0.1,
             "host": {"price_usd": 5000.0, "devices_per_host": 4, "power_w": 300.0},
             "nic": {"price_usd": 1000.0, "power_w": 20.0}},
}
#: two aggregated instances of 2x A100 each
AGG = RunConfig().replace(**{"cluster.kind": "aggregated", "cluster.aggregated.tp": 2,
                             "cluster.aggregated.num_instances": 2})
BOTH = RunConfig().replace(**{"cluster.kind": "both", "cluster.aggregated.tp": 2,
                              "cluster.aggregated.num_instances": 2})
SUMMARY = {"simulated_time_s": 100.0, "output_tokens_per_s": 50.0, "num_finished": 20}
AGG_STATS = {"aggregated_busy_s": [80.0, 60.0], "aggregated_compute_bound_s": [20.0, 0.0]}


def test_a_compute_bound_step_draws_prefill_power_a_memory_bound_one_decode_power():
    a100 = power_model(PROFILE, "a100-pcie")           # 240 W prefill, 150 W decode, 25 W idle
    # 20 s compute-bound, 60 s memory-bound, 20 s idle
    assert aggregated_energy_j(a100, 80.0, 20.0, 100.0) == pytest.approx(
        20 * 240 + 60 * 150 + 20 * 25)
    # compute-bound seconds never exceed the busy ones, busy never the span
    assert aggregated_energy_j(a100, 150.0, 200.0, 100.0) == pytest.approx(100 * 240)


def test_aggregated_run_energy_counts_only_its_pool():
    e = run_energy(AGG_STATS, SUMMARY, AGG, PROFILE)
    first = 2 * (20 * 240 + 60 * 150 + 20 * 25)
    second = 2 * (60 * 150 + 40 * 25)
    assert e["energy_j"] == pytest.approx(first + second)
    assert e["aggregated_energy_j"] == pytest.approx(first + second)
    assert "prefill_energy_j" not in e and "decode_energy_j" not in e
    assert e["aggregated_compute_bound_share"] == pytest.approx(20 / 140)
    assert e["tokens_per_joule"] == pytest.approx(50 * 100 / (first + second))


def test_aggregated_cost_prices_its_devices_hosts_and_nics():
    assert devices_of(AGG) == [("a100-pcie", 4)]
    assert hosts_and_nics(AGG, cost_inputs(PROFILE)) == (2, 2)
    assert capex_usd(AGG, PROFILE) == 40000.0
    c = run_cost(AGG_STATS, SUMMARY, AGG, PROFILE)
    capital = (40000 + 2 * 5000 + 2 * 1000) / (365.25 * 86400) * 100
    device_j = run_energy(AGG_STATS, SUMMARY, AGG, PROFILE)["energy_j"]
    energy = (device_j + (2 * 300 + 2 * 20) * 100) / 3.6e6 * 0.1
    assert c["usd_per_request"] == pytest.approx((capital + energy) / 20)
    assert c["tokens_per_s_per_dollar"] == pytest.approx(50 / 40000)


def test_both_sums_the_pd_pool_and_the_aggregated_pool():
    stats = {"prefill_busy_s": [40.0], "decode_busy_s": [90.0], **AGG_STATS}
    e = run_energy(stats, SUMMARY, BOTH, PROFILE)
    pd = 4 * (40 * 240 + 60 * 25) + 4 * (90 * 100 + 10 * 20)
    assert e["energy_j"] == pytest.approx(pd + e["aggregated_energy_j"])
    assert capex_usd(BOTH, PROFILE) == 44000.0 + 40000.0


def test_step_meter_adds_up_compute_bound_steps_as_the_roofline_says():
    inner = make_predictor(AGG, AGG.cluster.aggregated)
    meter = StepMeter(inner)
    big = meter.mixed_step_time([(2048, 0)], [1000] * 4)       # a full chunk: compute-bound
    small = meter.mixed_step_time([(1, 500)], [3000] * 200)    # one token beside 200 decodes
    decodes = meter.mixed_step_time([], [3000] * 200)
    assert big == inner.mixed_step_time([(2048, 0)], [1000] * 4)
    assert inner.mixed_step([(1, 500)], [3000] * 200) == (small, False)
    assert decodes == inner.decode_step_time(200, 600000)
    assert meter.compute_bound_s == big


@pytest.fixture(scope="module")
def agg_run():
    return simulate(load_config("examples/aggregated.toml").replace(
        **{"workload.num_requests": 300}))


def test_an_aggregated_run_has_a_cost_and_power_and_names_its_pool(agg_run):
    s, stats = agg_run.summary, agg_run.stats
    assert s["usd_per_request"] > 0 and math.isfinite(s["usd_per_request"])
    assert s["tokens_per_s_per_dollar"] == pytest.approx(
        s["output_tokens_per_s"] / capex_usd(agg_run.config))
    assert 0 < sum(stats["aggregated_compute_bound_s"]) < sum(stats["aggregated_busy_s"])
    assert 0 < s["aggregated_kv_use"] < 1 and 0 < s["aggregated_slot_use"] < 1
    assert s["aggregated_bottleneck"] in ("steps", "kv_blocks", "batch_slots")


def test_the_summary_line_describes_the_pool(agg_run):
    from sim.commands.simulate import format_summary

    text = format_summary(agg_run.summary, agg_run.config)
    line = next(x for x in text.splitlines() if "utilisation" in x)
    assert "aggregated" in line and "KV blocks" in line and "batch slots" in line
    assert "prefill" not in line and "link" not in line
    assert "nan" not in next(x for x in text.splitlines() if "$ per successful" in x)
