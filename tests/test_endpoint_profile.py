"""hawk profile --endpoint against the stub engine (known TTFT and TPOT, the same at any load):
the profile recovers its delays, resumes, refuses another profile's directory, and the
simulator on it serves a lone request as the stub does; hawk validate --endpoint pairs a
replay against it with the simulation. Delays are checked within generous tolerances only."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from sim.commands.main import main  # noqa: E402
from tests.builders import run_stub_server  # noqa: E402

TTFT, TPOT, CONTEXT = 0.05, 0.01, 256


def stub():
    return run_stub_server("--models", "m", "--max-model-len", str(CONTEXT), ttft_s=TTFT,
                           tpot_s=TPOT)


def profile(url: str, out, *extra: str) -> int:
    return main(["profile", "--endpoint", url, "--out", str(out), "--quick",
                 "--decode-tokens", "16", *extra])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("endpoint") / "p"
    with stub() as url:
        assert profile(url, out) == 0
    return out


def test_the_profile_recovers_the_stub_engines_delays(measured):
    from sim.models.profile_dir import load_profile_dir

    p = load_profile_dir(measured)
    assert p.complete and p.serving["engine"] == "aggregated"
    assert p.model.max_context == CONTEXT
    assert p.serving["decode_max_batch"] == 128 and p.serving["prefill_max_batch_tokens"] == 2048
    steps = p.decode[:, 2]
    assert steps.min() > 0.7 * TPOT and steps.max() < 1.5 * TPOT       # one token per TPOT
    latency = p.serving["api_latency_s"]
    assert 0.5 * (TTFT - TPOT) < latency < 1.5 * (TTFT - TPOT)
    ttft = latency + p.prefill[:, 2]                   # a lone prompt's TTFT at every length
    assert ttft.min() > 0.8 * TTFT and ttft.max() < 1.5 * TTFT
    # the stub's steps never slow for requests coming and going, nor does it queue them
    assert p.serving["request_churn_s"] < 0.2 * TPOT
    assert p.serving["frontend_request_s"] < 0.2 * TTFT


def test_the_simulator_serves_a_lone_request_as_the_stub(measured):
    import numpy as np

    from sim.config import RunConfig
    from sim.engine.cluster import simulate
    from traces.trace import Trace

    config = RunConfig().replace(**{"cluster.profile": str(measured)})
    assert config.cluster.kind == "aggregated"
    assert config.cluster.aggregated.max_batch_size == 128
    trace = Trace.from_columns(np.array([0.0, 5.0]), [100, 200], [20, 20], name="lone")
    result = simulate(config, trace)
    records = result.records
    ttft = (records["first_token_at"] - records["arrival_at"]).to_numpy()
    tpot = ((records["finished_at"] - records["first_token_at"]) / 19).to_numpy()
    assert list(records["status"]) == ["ok", "ok"]
    assert np.all((ttft > 0.8 * TTFT) & (ttft < 1.5 * TTFT))
    assert np.all((tpot > 0.7 * TPOT) & (tpot < 1.5 * TPOT))
    waited = (records["prefill_start_at"] - records["arrival_at"]).to_numpy()
    # each one's round trip is one the floor measured (or the front end's work, if longer)
    from sim.models.profile_dir import load_profile_dir

    serving = load_profile_dir(measured).serving
    seen = [max(x, serving["frontend_request_s"]) for x in serving["api_latency_samples_s"]]
    assert len(seen) == 8 and all(np.isclose(w, seen).any() for w in waited)


def test_a_rerun_resumes_and_measures_only_what_is_missing(tmp_path, capsys):
    out = tmp_path / "p"
    with stub() as url:
        assert profile(url, out) == 0
        samples = (out / "samples.jsonl").read_text().split("\n")
        (out / "samples.jsonl").write_text("\n".join(samples[:-2]) + "\n" + samples[-2][:9])
        capsys.readouterr()
        assert profile(url, out) == 0
    err = capsys.readouterr().err
    assert f"1 points to measure ({len(samples) - 2} already)" in err
    assert (out / "samples.jsonl").read_text().count("\n") == len(samples) - 1


def test_another_profiles_directory_is_refused_without_force(tmp_path, capsys):
    out = tmp_path / "p"
    with stub() as url:
        assert profile(url, out) == 0
        assert profile(url, out, "--max-num-seqs", "8") == 2
        assert "holds a profile of other settings" in capsys.readouterr().err
        assert profile(url, out, "--max-num-seqs", "8", "--force") == 0
    from sim.models.profile_dir import load_profile_dir

    assert load_profile_dir(out).serving["decode_max_batch"] == 8


def test_an_endpoint_without_a_model_listing_is_named(tmp_path, capsys):
    with run_stub_server(ttft_s=TTFT, tpot_s=TPOT) as url:
        assert profile(url, tmp_path / "p") == 1
    assert "expected one model with max_model_len" in capsys.readouterr().err


def test_validate_against_the_endpoint_pairs_every_request(measured, tmp_path):
    from sim.validation.run import load_requests, validate

    requests = load_requests(None, "chatbot", 6, CONTEXT, seed=3)
    with stub() as url:
        result, frames = validate(measured, requests, "2", slos=(1.0, 0.1), endpoint=url,
                                  out=tmp_path / "v")
    load = result["loads"][0]
    assert result["mechanism"] == "aggregated" and load["num_paired"] == 6
    assert {r["metric"] for r in load["errors"]} >= {"ttft_p50_s", "tpot_p50_s"}
    real, sim = frames[load["name"]]
    assert set(real["status"]) == {"ok"} and set(sim["status"]) == {"ok"}
    assert (tmp_path / "v" / load["name"] / "paired.parquet").is_file()
    assert (tmp_path / "v" / load["name"] / "real" / "records.parquet").is_file()
    # means three ways: the stub has no /metrics, so the engine's own view is unknown
    views = load["views"]
    assert views["engine"] == {} and views["client"]["ttft_s"] > 0.8 * TTFT
    assert views["sim"]["ttft_s"] > 0.8 * TTFT and views["client"]["send_lag_s"] is not None
    from sim.validation.errors import format_result

    assert "means, ms: client TTFT" in format_result(result)


def test_validate_refuses_an_endpoint_profile_without_an_endpoint(measured):
    from sim.validation.run import load_requests, validate

    requests = load_requests(None, "chatbot", 4, CONTEXT)
    with pytest.raises(ValueError, match="give --endpoint URL"):
        validate(measured, requests, "2", slos=(1.0, 0.1))
