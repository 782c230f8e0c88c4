"""``hawk compare``: refused hidden differences, common random numbers, paired bootstrap
effects and the verdict, on simulated runs and on recorded ones."""

import json

import numpy as np
import pandas as pd
import pytest

from sim.runs import compare as cmp
from sim.commands.main import main
from sim.config import ConfigError, RunConfig
from traces.synthetic import bursty_customers

BASE = RunConfig().replace(**{"cluster.prefill.max_batch_tokens": 2048})
CAND = BASE.replace(**{"cluster.policies.prefill_batching": "shortest_prompt_first"})


def test_the_diff_names_every_difference_and_hidden_ones_are_refused():
    diff = cmp.config_diff(BASE, CAND)
    assert diff == [("cluster.policies.prefill_batching", "chunked", "shortest_prompt_first")]
    cmp.check_diff(diff)                                   # a policy: may differ
    other = CAND.replace(**{"cluster.decode.num_instances": 2})
    diff = cmp.config_diff(BASE, other)
    with pytest.raises(ConfigError, match=r"also differ in \['cluster\.decode\.num_instances'\]"):
        cmp.check_diff(diff)
    cmp.check_diff(diff, cmp.POLICY_KEYS + ("cluster.decode.num_instances",))
    cmp.check_diff(diff, allow=True)
    with pytest.raises(ConfigError, match="nothing to compare"):
        cmp.check_diff(cmp.config_diff(BASE, BASE))
    # a workload or seed of the configs is not a difference: the comparison sets both
    assert cmp.config_diff(BASE, BASE.replace(**{"workload.rate": 3.0, "seed": 9})) == []


def test_limits_are_checked_and_name_the_file(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('improve = "latency"\n')
    with pytest.raises(ConfigError, match=r"limits\.toml: limits\.improve 'latency' must be one of"):
        cmp.load_limits(path)
    path.write_text('improve = "slo_attainment"\n[limits]\nttft_p90_s = "fast"\n')
    with pytest.raises(ConfigError, match=r"limits\.limits\.ttft_p90_s must be a number"):
        cmp.load_limits(path)
    path.write_text('colour = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        cmp.load_limits(path)


def _effect(lo, hi):
    return {"baseline": 0.0, "candidate": 0.0, "difference": (lo + hi) / 2, "ci_low": lo,
            "ci_high": hi}


def test_verdict_needs_the_whole_ci_on_the_good_side_and_every_limit_held():
    limits = cmp.Limits("slo_attainment", limits={"ttft_p90_s": 0.5})
    good = {"slo_attainment": _effect(0.01, 0.05), "ttft_p90_s": _effect(-0.2, 0.4)}
    assert cmp.verdict(good, limits)["keep"] == "candidate"
    unsure = {**good, "slo_attainment": _effect(-0.01, 0.05)}
    assert cmp.verdict(unsure, limits)["reasons"] == [
        "slo_attainment: no improvement at 95% confidence (CI -0.01 to +0.05)"]
    slow = {**good, "ttft_p90_s": _effect(0.1, 0.7)}
    v = cmp.verdict(slow, limits)
    assert v["keep"] == "baseline" and v["reasons"][0].startswith("ttft_p90_s: change could be +0.7")


def _frame(n, ttft, status="ok"):
    """Records of ``n`` requests 1 s apart, each with the given TTFT and 10 tokens."""
    arrival = np.arange(n, dtype=float)
    ttft = np.broadcast_to(np.asarray(ttft, dtype=float), (n,))
    return pd.DataFrame({
        "request_id": np.arange(n), "arrival_at": arrival, "num_prompt_tokens": 100,
        "num_output_tokens": 10, "status": status, "prefill_instance": 0,
        "decode_instance": 0, "prefill_start_at": arrival, "prefill_end_at": arrival,
        "transfer_start_at": arrival, "transfer_end_at": arrival,
        "first_token_at": arrival + ttft, "finished_at": arrival + ttft + 0.9,
        "num_generated_tokens": 10, "kv_bytes": 0})


def test_paired_over_requests_finds_a_real_improvement_and_none_in_identical_arms():
    n = 400
    base = _frame(n, np.where(np.arange(n) % 2 == 0, 3.0, 1.0))   # half miss a 2 s TTFT
    better = _frame(n, np.where(np.arange(n) % 4 == 0, 3.0, 1.0))  # a quarter miss
    limits = cmp.Limits()
    same = cmp.compare([((base, {}), (base, {}))], 2.0, 0.2, limits)
    e = same["effects"]["slo_attainment"]
    assert (e["difference"], e["ci_low"], e["ci_high"]) == (0.0, 0.0, 0.0)
    assert same["verdict"]["keep"] == "baseline" and same["regressed"] == []
    won = cmp.compare([((base, {}), (better, {}))], 2.0, 0.2, limits)
    e = won["effects"]["slo_attainment"]
    assert e["difference"] == pytest.approx(0.25)
    assert 0 < e["ci_low"] < 0.25 < e["ci_high"]
    assert won["verdict"]["keep"] == "candidate"
    with pytest.raises(ConfigError, match="same request ids"):
        cmp.compare([((base, {}), (better.head(10), {}))], 2.0, 0.2, limits)


def test_both_arms_see_the_same_arrivals_and_repeats_draw_fresh_ones():
    inputs = cmp.Inputs(workload="chatbot", rate=1.0, num_requests=60)
    runs = cmp.run_pairs(BASE, CAND, inputs, repeats=2, workers=1, progress=False)
    for (b, _), (c, _) in runs:
        assert b["arrival_at"].equals(c["arrival_at"])
        assert b["num_prompt_tokens"].equals(c["num_prompt_tokens"])
    assert not runs[0][0][0]["arrival_at"].equals(runs[1][0][0]["arrival_at"])
    with pytest.raises(ConfigError, match="repeats would be identical"):
        cmp.run_pairs(BASE, CAND, cmp.Inputs(trace=bursty_customers(duration_s=60)), repeats=2)


def _write_trace(trace, path):
    frame = trace.to_frame()
    frame.to_csv(path, index=False)
    return path


def test_cli_on_a_multi_customer_trace_saves_both_arms_and_a_verdict(tmp_path, capsys):
    a, b, limits = tmp_path / "A.toml", tmp_path / "B.toml", tmp_path / "limits.toml"
    a.write_text('[cluster.policies]\nfairness = "fcfs"\n')
    b.write_text('[cluster.policies]\nfairness = "weighted_fair"\n')
    limits.write_text('improve = "ttft_p90_s"\ntenants = ["quiet-1", "quiet-2", "quiet-3"]\n'
                      '[limits]\nfailure_rate = 0.0\n')
    # well past the knee, so that queues form behind the bursts
    trace = _write_trace(bursty_customers(rate=4.0, duration_s=300, seed=3), tmp_path / "t.csv")
    out = tmp_path / "out"
    assert main(["compare", "--baseline", str(a), "--candidate", str(b), "--trace", str(trace),
                 "--limits", str(limits), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    quiet = result["effects"]["ttft_p90_s[quiet-1,quiet-2,quiet-3]"]
    assert quiet["ci_high"] < 0                            # the quiet customers wait less
    assert result["effects"]["ttft_p90_s[bursty]"]["difference"] > 0
    assert result["verdict"] == {"keep": "candidate", "reasons": []}
    for arm in ("baseline", "candidate"):
        assert (out / arm / "records-0.parquet").is_file()
        assert json.loads((out / arm / "summary-0.json").read_text())["usd_per_request"] > 0
    regressed = pd.read_csv(out / "regressed.csv")
    assert (regressed["tenant"] == "bursty").all()         # the burst pays for it


def test_cli_pairs_recorded_runs_by_request_id(tmp_path, capsys):
    for name, extra in (("a", []), ("b", ["--policy", "prefill_batching=shortest-prompt-first"])):
        assert main(["simulate", "--num-requests", "150", "--rate", "4.0", "--config",
                     str(_budget(tmp_path)), "--out", str(tmp_path / name), *extra]) == 0
    capsys.readouterr()
    assert main(["compare", "--baseline", str(tmp_path / "a"), "--candidate",
                 str(tmp_path / "b"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["unit"] == "requests (150, paired by request id)"
    assert result["effects"]["ttft_p90_s"]["difference"] != 0
    assert main(["compare", "--baseline", str(tmp_path / "a"), "--candidate",
                 str(tmp_path / "b"), "--workload", "chatbot"]) == 2
    assert "recorded runs already hold their requests" in capsys.readouterr().err


def _budget(tmp_path):
    path = tmp_path / "budget.toml"
    path.write_text("[cluster.prefill]\nmax_batch_size = 1\n")      # a queue forms
    return path
