"""``hawk compare`` of deployment shapes: an aggregated baseline against a disaggregated
candidate on the same requests and seeds, paired per request, with a verdict."""

import json

import pytest

from sim.commands.main import main
from sim.config import ConfigError, load_config
from sim.runs import compare as cmp

AGG = load_config("examples/aggregated.toml")
DIS = load_config("examples/disaggregated.toml")


def test_a_kind_difference_allows_the_deployment_keys_and_nothing_else():
    diff = cmp.config_diff(AGG, DIS)
    keys = {k for k, _, _ in diff}
    assert "cluster.kind" in keys and "cluster.aggregated.device" in keys
    assert "cluster.prefill.device" in keys
    with pytest.raises(ConfigError, match="outside what may vary"):
        cmp.check_diff(diff)                              # the policies alone may not
    cmp.check_diff(diff, cmp.allowed_keys(diff))          # cluster.kind differs: deployment
    assert cmp.allowed_keys(diff, ("deployment",)) == cmp.DEPLOYMENT_KEYS
    other_model = DIS.replace(**{"slo.ttft_s": 5.0})
    hidden = cmp.config_diff(AGG, other_model)
    with pytest.raises(ConfigError, match=r"\['slo\.ttft_s'\]"):
        cmp.check_diff(hidden, cmp.allowed_keys(hidden))
    assert cmp.shared_differences(diff) == []             # both route by least_work


def test_paired_runs_of_two_shapes_see_the_same_requests():
    inputs = cmp.Inputs(workload="chatbot", rate=1.0, num_requests=120)
    runs = cmp.run_pairs(AGG, DIS, inputs, repeats=1, seed=3, workers=1, progress=False)
    (b_rec, b_sum), (c_rec, c_sum) = runs[0]
    assert list(b_rec["request_id"]) == list(c_rec["request_id"])
    assert (b_rec["arrival_at"].to_numpy() == c_rec["arrival_at"].to_numpy()).all()
    assert (b_rec["num_prompt_tokens"].to_numpy() == c_rec["num_prompt_tokens"].to_numpy()).all()
    assert (b_rec["kv_bytes"] == 0).all() and (c_rec["kv_bytes"] > 0).any()
    result = cmp.compare(runs, AGG.slo.ttft_s, AGG.slo.tpot_s, cmp.DEPLOYMENT_LIMITS)
    assert result["unit"] == "requests (120, paired by request id)"
    e = result["effects"]["usd_per_success"]
    assert e["baseline"] == pytest.approx(b_sum["usd_per_request"])
    assert e["candidate"] == pytest.approx(c_sum["usd_per_request"])
    ok = b_rec["status"] == "ok"                           # tokens delivered per joule
    assert result["effects"]["tokens_per_joule"]["baseline"] == pytest.approx(
        b_rec["num_generated_tokens"][ok].sum() / b_sum["energy_j"])
    assert result["verdict"]["keep"] in ("baseline", "candidate")


def test_cli_compares_an_aggregated_baseline_with_a_disaggregated_candidate(capsys):
    argv = ["compare", "--baseline", "examples/aggregated.toml", "--candidate",
            "examples/disaggregated.toml", "--workload", "chatbot", "--rate", "1",
            "--num-requests", "100", "--repeats", "2", "--workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "comparing deployments on the same requests and seeds:" in out
    assert "baseline   GPU aggregated: aggregated 2x(4x h100-sxm" in out
    assert "candidate  GPU+NPU disaggregated: prefill 1x(4x h100-sxm) -> decode 2x(4x p150a)" in out
    assert "verdict: keep the " in out and "improve usd_per_success" in out
    assert main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deployments"]["baseline"].startswith("GPU aggregated")
    assert result["limits"]["improve"] == "usd_per_success"
    assert result["unit"] == "repeats (2 paired runs)"
