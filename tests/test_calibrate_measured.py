"""hawk calibrate --profile DIR (sim/validation/fit_profile.py): a profile sampled from a known
roofline and known transfer lines gives those parameters back; what the data cannot determine
is said; the fitted TOML loads as a profile; too few points are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sim.validation.fit_profile import ROOFLINE, calibrate_profile, rms, write_toml
from sim.commands.main import main as hawk
from sim.config import ConfigError
from sim.models.predictor import load_profile, load_profile_table
from tests.test_profile_dir import TRUE_EFFICIENCY, TRUE_TRANSFER, make_profile_dir, roofline

#: known factors away from every starting point (0.3, 1 ms), so a fit that stays put fails
KNOWN = dataclasses.replace(TRUE_EFFICIENCY, prefill_compute_efficiency=0.12,
                            decode_compute_efficiency=0.05, decode_memory_efficiency=0.6,
                            decode_attention_efficiency=0.08, step_overhead_s=0.004)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    prof = make_profile_dir(tmp_path_factory.mktemp("cal") / "prof", roofline(KNOWN))
    return calibrate_profile(str(prof))


def test_known_roofline_is_recovered(fitted):
    fit = fitted["roofline"]
    for p in ROOFLINE:
        if p.name in fit["undetermined"]:
            continue
        assert fit["values"][p.name] == pytest.approx(getattr(KNOWN, p.name), rel=0.02), p.name
    assert rms(fit["prefill"]) < 1e-3 and rms(fit["decode"]) < 1e-3


def test_a_term_that_never_binds_is_reported(fitted):
    """Prefill of the tiny model is compute-bound at every sampled size: its memory
    efficiency leaves no trace in the data, so it is reported undetermined, and any larger
    value predicts the same times."""
    from sim.validation.fit_profile import _roofline_residuals

    fit = fitted["roofline"]
    assert fit["undetermined"] == ["prefill_memory_efficiency"]
    larger = {**fit["values"], "prefill_memory_efficiency": 1.0}
    prefill, _, _ = _roofline_residuals(fitted["profile"], fitted["device"], larger)
    assert np.array_equal(prefill, fit["prefill"])


def test_transfer_lines_are_recovered(fitted):
    for mech, (latency, gb_s) in TRUE_TRANSFER.items():
        t = fitted["transfer"][mech]
        assert t["latency_s"] == pytest.approx(latency, rel=1e-3)
        assert t["bandwidth_gb_s"] == pytest.approx(gb_s, rel=1e-3)
        assert rms(t["residuals"]) < 1e-6


def test_noisy_tables_fit_within_their_noise(tmp_path):
    """5% multiplicative noise on every point: the fit explains the data at least as well as
    the true parameters do (least squares), and no better than the noise allows."""
    from sim.validation.fit_profile import _roofline_residuals

    prof = make_profile_dir(tmp_path / "p", roofline(KNOWN))
    rng = np.random.default_rng(1)
    for name in ("prefill.csv", "decode.csv"):
        lines = (prof / name).read_text().splitlines()
        head, rows = lines[0], [r.split(",") for r in lines[1:]]
        col = head.split(",").index("seconds_p50")
        for r in rows:
            r[col] = repr(float(r[col]) * (1 + 0.05 * rng.standard_normal()))
        (prof / name).write_text("\n".join([head] + [",".join(r) for r in rows]) + "\n")
    record = calibrate_profile(str(prof))
    fit = record["roofline"]
    truth = {p.name: getattr(KNOWN, p.name) for p in ROOFLINE}
    true_p, true_d, _ = _roofline_residuals(record["profile"], record["device"], truth)
    fitted_rms = rms(np.concatenate([fit["prefill"], fit["decode"]]))
    assert fitted_rms <= rms(np.concatenate([true_p, true_d])) * (1 + 1e-6)
    assert fitted_rms > 0.5 * 0.05 * (1 - len(ROOFLINE) / fit["num_points"])


def test_fitted_toml_loads_as_a_profile(fitted, tmp_path):
    """Written for p150a, the fit times the catalog's p150a in a run of the paper scenario;
    every other table is the paper profile's."""
    from sim.engine.cluster import simulate
    from sim.config import RunConfig

    out = tmp_path / "fit.toml"
    write_toml({**fitted, "key": "p150a"}, out)
    profile = load_profile(str(out))
    eff = profile["p150a"]
    assert eff.decode_memory_efficiency == pytest.approx(0.6, rel=0.02)
    assert profile["a100-pcie"] == load_profile("paper")["a100-pcie"]
    config = RunConfig().replace(**{"cluster.profile": str(out), "workload.num_requests": 20})
    assert simulate(config).summary["num_finished"] > 0
    table = load_profile_table(str(out))
    assert table["measured_transfer"]["GN-HAWK"]["latency_s"] == pytest.approx(0.003, rel=1e-3)
    assert table["fit"]["num_roofline_points"] > table["fit"]["num_roofline_parameters"]


def test_too_few_points_are_refused(tmp_path):
    prof = make_profile_dir(tmp_path / "p")
    rows = (prof / "transfer.csv").read_text().splitlines()
    (prof / "transfer.csv").write_text("\n".join(rows[:3] + rows[6:]) + "\n")   # 2 GG-Direct
    with pytest.raises(ConfigError, match="2 points of GG-Direct for 2 parameters"):
        calibrate_profile(str(prof))


def test_cli_prints_residuals_and_writes(tmp_path, capsys):
    prof = make_profile_dir(tmp_path / "p")
    out = tmp_path / "fit.toml"
    assert hawk(["calibrate", "--profile", str(prof), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefill.csv: RMS relative residual" in text
    assert "decode.csv: RMS relative residual" in text
    assert "transfer.csv GN-HAWK" in text and out.is_file()
    assert hawk(["calibrate", "--out", str(out)]) == 2        # --out without --profile
    assert "go with --profile" in capsys.readouterr().err


def test_the_targets_fits_flags_are_refused_beside_a_profile(tmp_path, capsys):
    prof = make_profile_dir(tmp_path / "p")
    for flag in (["--max-evaluations", "3"], ["--dry-run"], ["--targets", "paper"]):
        assert hawk(["calibrate", "--profile", str(prof), *flag]) == 2, flag
        assert f"{flag[0]} is a flag of the targets fit, not of --profile DIR" in \
            capsys.readouterr().err
    assert hawk(["calibrate", "--workers", "0"]) == 2         # checked before any fitting
    assert "--workers 0: must be at least 1" in capsys.readouterr().err


def test_device_names_a_catalog_device(tmp_path):
    prof = make_profile_dir(tmp_path / "p")
    with pytest.raises(ConfigError, match="--device 'cpu9'"):
        calibrate_profile(str(prof), "cpu9")
