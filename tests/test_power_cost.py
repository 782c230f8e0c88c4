"""Power and cost: hand-computed tiny cases."""

import math

import pytest

from sim.config import RunConfig
from sim.models.cost import (capital_usd_per_s, capex_usd, cost_inputs, device_price,
                             hosts_and_nics, run_cost, tokens_per_s_per_dollar, usd_per_success,
                             with_overrides)
from sim.models.power import PowerModel, device_energy_j, power_model, run_energy

PROFILE = {
    "power": {
        "a100-pcie": dict(idle_w=50.0, prefill_w=300.0, decode_w=250.0, asic_fraction_idle=0.5,
                          asic_fraction_prefill=0.8, asic_fraction_decode=0.6),
        "p150a": dict(idle_w=20.0, prefill_w=150.0, decode_w=100.0, asic_fraction_idle=1.0,
                      asic_fraction_prefill=1.0, asic_fraction_decode=1.0),
    },
    "price": {"a100-pcie": 10000.0, "p150a": 1000.0},
    "cost": {"model": "amortised", "lifetime_years": 1.0, "usd_per_kwh": 0.1,
             "hourly_usd": {"a100-pcie": 2.0, "p150a": 0.5}},
}
CONFIG = RunConfig()            # 4x A100 prefill, 4x p150a decode
STATS = {"prefill_busy_s": [40.0], "decode_busy_s": [90.0]}
SUMMARY = {"simulated_time_s": 100.0, "output_tokens_per_s": 50.0, "num_finished": 20}


def test_device_energy_by_phase():
    a100 = power_model(PROFILE, "a100-pcie")
    assert a100.asic_w("prefill") == 240.0 and a100.asic_w("idle") == 25.0
    # 40 s at 240 W + 60 s at 25 W
    assert device_energy_j(a100, "prefill", 40.0, 100.0) == pytest.approx(9600 + 1500)
    assert a100.average_w("prefill", 0.4) == pytest.approx(111.0)


def test_run_energy_and_tokens_per_joule():
    e = run_energy(STATS, SUMMARY, CONFIG, PROFILE)
    prefill = 4 * (40 * 240 + 60 * 25)          # 44,400 J
    decode = 4 * (90 * 100 + 10 * 20)           # 36,800 J
    assert e["prefill_energy_j"] == pytest.approx(prefill)
    assert e["decode_energy_j"] == pytest.approx(decode)
    assert e["average_power_w"] == pytest.approx((prefill + decode) / 100)
    assert e["tokens_per_joule"] == pytest.approx(50 * 100 / (prefill + decode))
    assert e["decode_utilisation"] == [0.9]


def test_cost_amortised_and_hourly():
    assert capex_usd(CONFIG, PROFILE) == 44000.0
    assert tokens_per_s_per_dollar(SUMMARY, CONFIG, PROFILE) == pytest.approx(50 / 44000)
    c = run_cost(STATS, SUMMARY, CONFIG, PROFILE)
    capital = 44000 / (365.25 * 86400) * 100
    energy = (44400 + 36800) / 3.6e6 * 0.1
    assert c["capital_usd"] == pytest.approx(capital)
    assert c["energy_usd"] == pytest.approx(energy)
    assert c["usd_per_request"] == pytest.approx((capital + energy) / 20)
    hourly = {**PROFILE, "cost": {**PROFILE["cost"], "model": "hourly"}}
    assert capital_usd_per_s(CONFIG, hourly) == pytest.approx((4 * 2.0 + 4 * 0.5) / 3600)


#: PROFILE with servers and NICs priced (sim.models.cost: [cost.host], [cost.nic])
HOSTED = {**PROFILE, "cost": {**PROFILE["cost"],
                              "host": {"price_usd": 5000.0, "devices_per_host": 4, "power_w": 300.0},
                              "nic": {"price_usd": 1000.0, "power_w": 20.0}}}


def test_hosts_and_nics_are_capital_and_draw_power_in_one_model():
    c = run_cost(STATS, SUMMARY, CONFIG, HOSTED)
    # one TP4 instance a side: one 4-device host and one NIC each
    capital = (44000 + 2 * 5000 + 2 * 1000) / (365.25 * 86400) * 100
    energy = (44400 + 36800 + 100 * (2 * 300 + 2 * 20)) / 3.6e6 * 0.1
    assert c["capital_usd"] == pytest.approx(capital)
    assert c["energy_usd"] == pytest.approx(energy)
    assert c["usd_per_request"] == pytest.approx((capital + energy) / 20)
    # the planner's figure, from a summary, is the same one
    summary = {**SUMMARY, "energy_j": 44400 + 36800}
    assert usd_per_success(summary, CONFIG, HOSTED) == pytest.approx(c["usd_per_request"])
    assert usd_per_success({**summary, "num_finished": 0}, CONFIG, HOSTED) == math.inf
    # the paper's cost efficiency stays over the devices' prices only
    assert c["tokens_per_s_per_dollar"] == pytest.approx(50 / 44000)


def test_a_tp_group_spans_hosts_and_hourly_rates_cover_them():
    wide = CONFIG.replace(**{"cluster.decode.tp": 8, "cluster.decode.num_instances": 2})
    assert hosts_and_nics(wide, cost_inputs(HOSTED)) == (1 + 2 * 2, 3)
    assert hosts_and_nics(wide, cost_inputs(PROFILE)) == (0, 0)     # not priced: none counted
    hourly = {**HOSTED, "cost": {**HOSTED["cost"], "model": "hourly"}}
    assert capital_usd_per_s(CONFIG, hourly) == pytest.approx((4 * 2.0 + 4 * 0.5) / 3600)


def test_cost_overrides_lay_over_the_profile_key_by_key_and_bad_ones_are_named():
    out = with_overrides(HOSTED, {"lifetime_years": 5.0, "nic": {"price_usd": 3000.0}})
    inputs = cost_inputs(out)
    assert (inputs.lifetime_years, inputs.nic["price_usd"], inputs.nic["power_w"]) == (5.0, 3000.0, 20.0)
    assert cost_inputs(HOSTED).lifetime_years == 1.0                     # not changed in place
    for bad, message in (({"gpu": {}}, r"unknown key\(s\) \['gpu'\]"),
                         ({"host": {"price_usd": -5}}, r"\[cost.host\] price_usd must be a number >= 0"),
                         ({"lifetime_years": 0}, r"\[cost\] lifetime_years 0 must be > 0")):
        with pytest.raises(ValueError, match=message):
            with_overrides(HOSTED, bad)


def test_no_finished_request_gives_nan_cost_per_request():
    c = run_cost(STATS, {**SUMMARY, "num_finished": 0}, CONFIG, PROFILE)
    assert math.isnan(c["usd_per_request"])


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="asic_fraction_decode"):
        PowerModel(50, 300, 250, 0.5, 0.8, 1.5)
    with pytest.raises(ValueError, match=r"\[power.h100-pcie\]"):
        power_model(PROFILE, "h100-pcie")
    with pytest.raises(ValueError, match="'leased'"):
        capital_usd_per_s(CONFIG, {**PROFILE, "cost": {"model": "leased"}})


def test_paper_profile_has_power_and_price_for_its_devices():
    from sim.models.predictor import load_profile_table

    table = load_profile_table("paper")
    for device in ("a100-pcie", "p150a", "h100-pcie"):
        assert power_model(table, device).asic_w("decode") > 0
        assert device_price(table, device) > 0


def test_prices_come_from_the_catalog_unless_the_profile_overrides():
    from hardware import catalog
    from sim.models.cost import device_price

    assert device_price({}, "h200") == catalog.device("h200").price_usd == 35000.0
    assert device_price({"price": {"h200": 1.0}}, "h200") == 1.0
    with pytest.raises(ValueError, match=r"profile \[price\] names unknown device\(s\) \['h300'\]"):
        device_price({"price": {"h300": 1.0}}, "h200")
    assert capex_usd(CONFIG, {"price": {}}) == 4 * 10000.0 + 4 * 1349.0


def test_the_paper_profile_lists_only_prices_it_assumes_differently():
    from hardware import catalog
    from sim.models.cost import device_price
    from sim.models.predictor import load_profile_table

    table = load_profile_table("paper")
    assert set(table["price"]) == {"a100-pcie"}                 # fitted by hawk calibrate
    assert 8000.0 <= table["price"]["a100-pcie"] <= 15000.0    # inside the quoted range
    assert catalog.device("a100-pcie").price_usd == 10000.0
    for dev, spec in catalog.devices().items():
        assert device_price(table, dev) == table["price"].get(dev, spec.price_usd)


def test_phase_power_cannot_exceed_the_catalog_board_power():
    over = {"power": {"a100-pcie": {**PROFILE["power"]["a100-pcie"], "prefill_w": 301.0}}}
    with pytest.raises(ValueError, match=r"\[power\.a100-pcie\] prefill_w = 301\.0 W exceeds the "
                                         r"300 W board power of the catalog's NVIDIA A100 PCIe"):
        power_model(over, "a100-pcie")
    from hardware import catalog
    from sim.models.predictor import load_profile_table

    table = load_profile_table("paper")
    for dev in catalog.devices():
        power_model(table, dev)           # every paper power table within its board power


def test_the_paper_serving_settings_match_the_device_rules():
    """paper.toml [serving] restates device defaults for sim/paper/experiments.py; they may not drift."""
    from hardware import catalog
    from sim.models.predictor import load_profile_table

    s = load_profile_table("paper")["serving"]
    gpu, npu = catalog.device("a100-pcie").serving, catalog.device("p150a").serving
    assert (s["prefill_block_size"], s["gpu_decode_max_batch_size"]) == (
        gpu.block_size, gpu.max_batch_size)
    assert (s["npu_block_size"], s["npu_decode_max_batch_size"], s["npu_kv_blocks"]) == (
        npu.block_size, npu.max_batch_size, npu.max_num_blocks)
