"""hawk devices --check and --fit: every published point listed with its source, the fit's
convergence and residuals, leave-one-out by real refits."""

import csv
import math
from importlib import resources

import numpy as np
import pytest

from sim.paper import devices_fit
from sim.paper.device_points import device_points, tt_metal_url
from sim.paper.devices_check import check, summary


def _csv(name):
    text = resources.files("hardware").joinpath("catalog", "measured", name).read_text()
    return list(csv.DictReader(text.splitlines()))


def test_every_measured_point_is_listed_with_a_source():
    """Every distinct Llama 2 70B setting of the DGX rows and every tt-metal figure is a row,
    with its source; excluded rows keep their reason and count in no summary."""
    rows = check("grounded")
    splitwise = {(r["hardware"], r["tensor_parallel"], r["prompt_size"], r["batch_size"],
                  r["token_size"]) for r in _csv("splitwise-perf-model.csv")
                 if r["model"] == "llama2-70b" and r["hardware"] in ("a100-80gb", "h100-80gb")}
    prefills = {s[:4] for s in splitwise}
    tt = _csv("tt-metal.csv")
    assert len(rows) == len(splitwise) + len(prefills) + 2 * len(tt)
    assert len({r["key"] for r in rows}) == len(rows)
    for r in rows:
        assert r["measured"] > 0 and r["source"]
        assert ("Splitwise" in r["source"]) != ("tt-metal" in r["source"])
        assert r["model"] > 0 and r["error"] == pytest.approx(r["model"] / r["measured"] - 1)
    excluded = [r for r in rows if r["excluded"]]
    assert {(r["device"], r["tp"]) for r in excluded} == {("a100-sxm", 2), ("h100-sxm", 2)}
    assert all("batch 32" in r["excluded"] for r in excluded)
    assert summary(rows)["all"]["points"] == len(rows) - len(excluded)
    for q in device_points():
        if "tt-metal" in q.source:
            url = tt_metal_url(q.source)
            assert url.startswith("https://github.com/tenstorrent/tt-metal/blob/")
            assert len(url.split("/blob/")[1].split("/")[0]) == 40


def test_a_figure_is_read_as_published():
    """tt-metal's 70B on four p150: TTFT 188 ms, 14.9 t/s/u; Splitwise's A100 TP4 prefill of
    one 8192-token prompt is the mean of its five runs."""
    points = {q.key: q for q in device_points()}
    p150 = "p150a/llama-3.1-70b/tp4"
    assert points[f"{p150}/prefill/b1/p128/README-b32"].value_s == pytest.approx(0.188)
    assert points[f"{p150}/decode/b32/ctx128/README-b32"].value_s == pytest.approx(1 / 14.9)
    runs = [float(r["prompt_time"]) for r in _csv("splitwise-perf-model.csv")
            if (r["model"], r["hardware"], r["tensor_parallel"], r["prompt_size"],
                r["batch_size"]) == ("llama2-70b", "a100-80gb", "4", "8192", "1")]
    q = points["a100-sxm/llama-2-70b/tp4/prefill/b1/p8192"]
    assert len(runs) == 5 and q.value_s == pytest.approx(sum(runs) / 5 / 1e3)


@pytest.fixture(scope="module")
def n300_fit():
    return devices_fit.fit_device("n300", loo=True)


def test_fit_converges_from_the_neutral_start_and_reports_its_residuals(n300_fit):
    f = n300_fit["fit"]
    assert f["starts"][0]["u"] == 0.5 and all(s["status"] > 0 for s in f["starts"])
    assert f["converged"] and f["nfev"] > 1
    assert n300_fit["num_free"] < n300_fit["num_settings"]
    # the neutral start is the middle of each bound: geometric for efficiencies
    lo, hi = f["bounds"]["memory_efficiency"]
    assert f["starts"][0]["u"] == 0.5 and math.isclose(
        devices_fit._scale(lo, hi, 0.5), math.sqrt(lo * hi))
    # the reported residuals are the model's at the fitted values
    points = [q for q in device_points() if q.device == "n300"]
    model = devices_fit.model_times(points, devices_fit.efficiency("n300", f["values"]))
    logs = np.log(model / np.array([q.value_s for q in points]))
    assert n300_fit["rms_log_residual"] == pytest.approx(math.sqrt(np.mean(logs ** 2)))
    for row, m in zip(n300_fit["rows"], model):
        assert row["model_s"] == pytest.approx(m)
    # converged: moving any parameter a little either way within its bounds costs more
    measured = np.array([q.value_s for q in points])
    for name, (lo, hi) in f["bounds"].items():
        for step in (-0.01, 0.01):
            moved = dict(f["values"])
            moved[name] = min(max(f["values"][name] + step * (hi - lo), lo), hi)
            m = devices_fit.model_times(points, devices_fit.efficiency("n300", moved))
            assert 0.5 * np.sum(np.log(m / measured) ** 2) >= f["cost"] - 1e-12, name


def test_leave_one_out_is_a_real_refit(n300_fit):
    """Each LOO value comes from a refit without that point: it differs from the full fit's
    and equals a refit done here."""
    rows = n300_fit["rows"]
    assert all(r["loo_model_s"] != pytest.approx(r["model_s"], rel=1e-6) for r in rows)
    points = [q for q in device_points() if q.device == "n300"]
    held = 1
    refit = devices_fit.fit_points("n300", points[:held] + points[held + 1:])
    again = devices_fit.model_times([points[held]],
                                    devices_fit.efficiency("n300", refit["values"]))[0]
    assert rows[held]["loo_model_s"] == pytest.approx(again)
    assert refit["values"] != n300_fit["fit"]["values"]


def test_the_grounded_profile_is_the_fit():
    """sim/profiles/grounded.toml holds what the fit gives now (to its 6 printed digits)."""
    from sim.models.efficiency import load_profile

    grounded = load_profile("grounded")
    for device in ("p150a", "n300", "h100-sxm"):
        values = devices_fit.fit_device(device, loo=False)["fit"]["values"]
        fitted = devices_fit.efficiency(device, values)
        for name in fitted.__dataclass_fields__:
            a, b = getattr(fitted, name), getattr(grounded[device], name)
            assert a == pytest.approx(b, rel=1e-5, abs=1e-12), (device, name)


def test_a_plan_needs_fewer_parameters_than_settings(monkeypatch):
    params, fixed = devices_fit.PLANS["p150a"]
    monkeypatch.setitem(devices_fit.PLANS, "p150a", (params + params[:1], fixed))
    with pytest.raises(ValueError, match="5 free parameters for 5 settings"):
        devices_fit.fit_device("p150a", loo=False)


def test_cli_check_and_fit(capsys):
    from sim.commands.main import main

    assert main(["devices", "--check"]) == 0
    out = capsys.readouterr().out
    assert "Splitwise perf_model.csv" in out and "tt-metal models/README.md" in out
    assert "EXCLUDED: not a batch of 64" in out
    assert "points within 10%" in out and out.count("\nall ") == 1
    assert main(["devices", "--fit", "--device", "p150a", "--no-loo"]) == 0
    out = capsys.readouterr().out
    assert "status" in out and "evaluations" in out and "[0.02, 0.9]" in out
    assert main(["devices", "--fit", "--device", "h300"]) == 2
    assert capsys.readouterr().out.strip() == (
        "hawk devices: --device 'h300' has no fit plan; choose from "
        "['a100-sxm', 'h100-sxm', 'n300', 'p150a']")
    assert main(["devices"]) == 2


def test_sensitivity_moves_only_the_phase_a_parameter_prices(n300_fit):
    s = n300_fit["sensitivity"]
    assert set(s) == set(n300_fit["fit"]["bounds"])
    assert s["prefill_step_overhead_s"]["decode"] == 0.0 < s["prefill_step_overhead_s"][
        "prefill"]
    assert s["decode_per_seq_s"]["prefill"] == 0.0 < s["decode_per_seq_s"]["decode"]
    assert all(max(m.values()) > 0.01 for m in s.values())     # each one moves a point


def test_check_json_and_the_paper_report_section(capsys):
    import json

    from sim.commands.main import main
    from sim.paper.devices_report import devices_markdown, devices_summary

    assert main(["devices", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"] == summary(check("grounded"))
    assert len(data["points"]) == len(device_points())
    devices = devices_summary("paper")
    assert list(devices["under_profile"])[-1] == "all"
    lines = devices_markdown(devices)
    p150 = next(line for line in lines if line.startswith("| p150a |"))
    g, p = devices["under_grounded"]["p150a"], devices["under_profile"]["p150a"]
    assert p150 == (f"| p150a | {p['points']} | {p['within']} | {100 * p['worst']:.0f}% | "
                    f"{g['within']} | {100 * g['worst']:.0f}% |")
    assert devices_markdown(None) == []
