"""``hawk validate``: pairing by id, error math, stage blame, strict JSON, bad inputs, and the
command end to end on a tiny trace."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from sim.validation import errors as val
from tests import needs

STAGE_S = {"queue": 0.01, "prefill": 0.02, "transfer_wait": 0.005, "transfer": 0.015,
           "first_decode": 0.01}


def make_records(n=10, stages=None, decode_s=0.5, num_tokens=11, status="ok", gap_s=1.0):
    """Records of ``n`` requests ``gap_s`` apart, each spending ``stages`` seconds per TTFT
    stage (``STAGE_S`` by default) and ``decode_s`` from first token to finish."""
    stages = {**STAGE_S, **(stages or {})}
    arrival = np.arange(n, dtype=float) * gap_s
    cols = {"arrival_at": arrival}
    t = arrival.copy()
    for (stage, _, end) in val.TTFT_STAGES:
        t = t + np.broadcast_to(np.asarray(stages[stage], dtype=float), (n,))
        cols[end] = t
    cols["finished_at"] = t + np.broadcast_to(np.asarray(decode_s, dtype=float), (n,))
    return pd.DataFrame({"request_id": np.arange(n, dtype=np.int64),
                         "num_prompt_tokens": 100, "num_output_tokens": num_tokens,
                         "status": status, "prefill_instance": 0, "decode_instance": 0,
                         **cols, "num_generated_tokens": num_tokens, "kv_bytes": 1000})


def test_pairing_is_by_id_whatever_the_row_order_and_reports_missing_ids():
    real = make_records(6)
    sim = make_records(6, stages={"prefill": 0.03})
    shuffled = sim.sample(frac=1.0, random_state=3)
    assert list(shuffled["request_id"]) != sorted(shuffled["request_id"])
    pairing = val.pair_records(real.drop(index=[4]), shuffled.drop(index=[1, 2]))
    frame = pairing.frame
    assert list(frame["request_id"]) == [0, 3, 5]
    assert pairing.only_real == (1, 2) and pairing.only_sim == (4,)
    assert "only in the real run (1, 2)" in pairing.describe()
    assert "only in the simulated run (4)" in pairing.describe()
    assert list(frame.columns) == val.paired_columns()
    np.testing.assert_allclose(frame["prefill_time_real"], 0.02)
    np.testing.assert_allclose(frame["prefill_time_sim"], 0.03)
    np.testing.assert_allclose(frame["prefill_time_diff"], 0.01)
    # every later instant moved by the extra 10 ms of prefill, the arrival did not
    np.testing.assert_allclose(frame["arrival_at_diff"], 0.0)
    np.testing.assert_allclose(frame["finished_at_diff"], 0.01)


def test_pairing_refuses_repeated_ids_and_different_lengths():
    real = make_records(3)
    with pytest.raises(ValueError, match=r"sim records repeat request id\(s\) \[1\]"):
        val.pair_records(real, pd.concat([real, real.iloc[[1]]]))
    other = real.assign(num_prompt_tokens=[100, 100, 70])
    with pytest.raises(ValueError, match="request 2: num_prompt_tokens is 100 in the real run "
                                         "but 70 in the simulated one"):
        val.pair_records(real, other)


def test_relative_errors_and_attainment_points_on_hand_made_records():
    real = make_records(10, decode_s=0.5)
    # sim: TTFT 20% longer (every stage 1.2x), decode 10% shorter: TPOT -10%
    sim = make_records(10, stages={k: 1.2 * v for k, v in STAGE_S.items()}, decode_s=0.45)
    result, _ = val.judge(real, sim, ttft_slo_s=1.0, tpot_slo_s=1.0)
    rows = {r["metric"]: r for r in result["errors"]}
    assert rows["ttft_p50_s"]["real"] == pytest.approx(0.06)
    assert rows["ttft_p50_s"]["error"] == pytest.approx(0.2)
    assert rows["ttft_p90_s"]["error"] == pytest.approx(0.2)
    assert rows["tpot_p50_s"]["error"] == pytest.approx(-0.1)
    assert rows["e2e_p50_s"]["error"] == pytest.approx((0.072 + 0.45) / (0.06 + 0.5) - 1)
    assert rows["ttft_p50_s"]["met"] is False and rows["tpot_p50_s"]["met"] is True
    assert rows["slo_attainment"]["error"] == 0.0 and rows["slo_attainment"]["met"] is True
    # a TTFT SLO between the two: real meets it everywhere, sim nowhere: -100 points
    result, _ = val.judge(real, sim, ttft_slo_s=0.065, tpot_slo_s=1.0)
    rows = {r["metric"]: r for r in result["errors"]}
    assert rows["slo_attainment"]["error"] == pytest.approx(-100.0)
    # three of ten real requests failed: attainment 70% vs 100%, +30 points
    failed = real.assign(status=["ok"] * 7 + ["failed_transfer"] * 3)
    result, _ = val.judge(failed, sim, ttft_slo_s=1.0, tpot_slo_s=1.0)
    rows = {r["metric"]: r for r in result["errors"]}
    assert rows["slo_attainment"]["error"] == pytest.approx(30.0)
    assert result["statuses"]["real"] == {"ok": 7, "failed_transfer": 3}


def test_goal_is_inclusive_and_an_undefined_error_is_neither_met_nor_missed():
    rows = val.metric_errors({"ttft_p50_s": 1.0, "slo_attainment": 0.9},
                             {"ttft_p50_s": 1.1, "slo_attainment": 0.93}, val.Goals())
    rows = {r["metric"]: r for r in rows}
    assert rows["ttft_p50_s"]["met"] is True and rows["slo_attainment"]["met"] is True
    assert rows["tpot_p50_s"]["met"] is None and math.isnan(rows["tpot_p50_s"]["error"])
    with pytest.raises(ValueError, match="goals: relative -1"):
        val.Goals(relative=-1)


@pytest.mark.parametrize("stage", ["queue", "prefill", "transfer_wait", "transfer",
                                   "first_decode"])
def test_blame_picks_the_ttft_stage_that_was_perturbed(stage):
    rng = np.random.default_rng(7)
    n = 40
    base = {s: v * (1 + 0.02 * rng.standard_normal(n)) for s, v in STAGE_S.items()}
    real = make_records(n, stages=base)
    wrong = {**base, stage: base[stage] + 0.02}       # 20 ms more in one stage only
    sim = make_records(n, stages={s: v * (1 + 0.002 * rng.standard_normal(n))
                                  for s, v in wrong.items()})
    result, pairing = val.judge(real, sim, ttft_slo_s=10.0, tpot_slo_s=10.0)
    rows = {r["metric"]: r for r in result["errors"]}
    assert rows["ttft_p50_s"]["met"] is False
    assert rows["ttft_p50_s"]["blame"] == {"stage": stage, "component": val.COMPONENTS[stage]}
    assert "blame" not in rows["tpot_p50_s"]          # decode was not touched: met
    found = val.blame(pairing, "ttft_p50_s")
    assert found["stage_error_s"][stage] == pytest.approx(0.02, abs=2e-3)
    # the stage means add up to the mean TTFT error
    ttft_real = real["first_token_at"] - real["arrival_at"]
    ttft_sim = sim["first_token_at"] - sim["arrival_at"]
    assert sum(found["stage_error_s"].values()) == pytest.approx((ttft_sim - ttft_real).mean())


def test_a_slow_decode_model_is_blamed_on_decode_for_tpot_and_e2e():
    real = make_records(10, decode_s=0.5)
    sim = make_records(10, decode_s=0.7)
    result, _ = val.judge(real, sim, ttft_slo_s=10.0, tpot_slo_s=10.0)
    rows = {r["metric"]: r for r in result["errors"]}
    for name in ("tpot_p50_s", "tpot_p90_s", "e2e_p50_s"):
        assert rows[name]["blame"] == {"stage": "decode", "component": "decode"}, name
    assert rows["ttft_p50_s"]["met"] is True
    assert "MISS (decode: decode)" in val.format_errors(result)


def test_blame_ignores_requests_that_failed_on_either_side():
    real = make_records(4)
    sim = make_records(4, stages={"transfer": [0.015, 0.015, 0.015, 9.0]})
    sim.loc[3, "status"] = "failed_transfer"
    assert val.stage_differences(val.pair_records(real, sim))["transfer"] == pytest.approx(0.0)


def test_result_is_strict_json_even_when_nothing_finished():
    from traces.jsonout import dumps

    real = make_records(3)
    sim = make_records(3, status="failed_transfer")
    result, _ = val.judge(real, sim, ttft_slo_s=1.0, tpot_slo_s=1.0)
    text = dumps(result)

    def refuse(token):
        raise AssertionError(f"non-JSON constant {token}")
    data = json.loads(text, parse_constant=refuse)
    rows = {r["metric"]: r for r in data["errors"]}
    assert rows["ttft_p50_s"]["sim"] is None and rows["ttft_p50_s"]["met"] is None
    assert rows["slo_attainment"]["error"] == pytest.approx(-100.0)


# -- the orchestration, both sides replaced by a single server ------------------------------
from sim.validation import run as vr  # noqa: E402
from sim.commands.main import main  # noqa: E402
from traces.trace import Trace  # noqa: E402


def make_profile(root, mechanisms=("GN-HAWK",), real_model=False):
    """A profile directory with the contract's files and made-up (plausible) numbers, and the
    seeded tiny model the real mode serves."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "profile.toml").write_text(
        '[meta]\nformat = 1\ncomplete = true\n'
        '[machine]\ncpu = "test"\ncores = 2\nthreads = 1\ndevice = "cpu"\n'
        'stands_for_prefill = "a100-pcie"\nstands_for_decode = "p150a"\n'
        '[model]\nnum_layers = 2\nhidden_size = 256\nnum_heads = 4\nnum_kv_heads = 2\n'
        'head_dim = 64\nintermediate_size = 688\nvocab_size = 1024\nmax_context = 512\n'
        'dtype = "float32"\nseed = 0\n'
        '[serving]\nprefill_max_batch_tokens = 2048\ndecode_max_batch = 32\n'
        'kv_block_tokens = 32\nnum_kv_tokens = 16384\nmax_request_tokens = 512\n'
        'kv_dtype = "bfloat8_b"\nthreads = 1\n'
        f'mechanisms = [{", ".join(repr(m).replace(chr(39), chr(34)) for m in mechanisms)}]\n')
    (root / "prefill.csv").write_text(
        "batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats\n"
        "16,1,0.004,0.004,0.004,3\n512,1,0.06,0.06,0.06,3\n2048,4,0.24,0.24,0.24,3\n")
    rows = [(b, c, 0.003 + 1e-4 * b + 1.4e-5 * b * c) for b in (1, 8, 32) for c in (16, 512)]
    (root / "decode.csv").write_text(
        "batch,context_per_request,total_context,seconds_p50,seconds_p10,seconds_p90,repeats\n"
        + "".join(f"{b},{c},{b * c},{s:.6f},{s:.6f},{s:.6f},3\n" for b, c, s in rows))
    (root / "transfer.csv").write_text(
        "mechanism,bytes,seconds_p50,seconds_p10,seconds_p90,repeats\n"
        + "".join(f"{m},{n},{0.005 + n / 2e9:.6f},0.005,0.006,3\n" for m in mechanisms
                  for n in (32768, 1048576)))
    if real_model:                       # the seeded tiny Llama the real workers serve
        from hardware.model.config import tiny_config
        from hardware.model.llama import LlamaModel

        LlamaModel.random(tiny_config(), seed=0).save(root / "model")
    else:
        (root / "model").mkdir(exist_ok=True)
        (root / "model" / "config.json").write_text("{}")
    return root


def single_server(trace: Trace, service_s: float, step_s: float = 0.01):
    """Records of one FCFS server taking ``service_s`` per request, then ``step_s`` per token."""
    n = len(trace)
    start, end, free = np.zeros(n), np.zeros(n), 0.0
    for i, a in enumerate(trace.arrival_at):
        start[i] = max(a, free)
        end[i] = free = start[i] + service_s
    finish = end + step_s * (trace.num_output_tokens - 1)
    return pd.DataFrame({"request_id": trace.request_id, "arrival_at": trace.arrival_at,
                         "num_prompt_tokens": trace.num_prompt_tokens,
                         "num_output_tokens": trace.num_output_tokens, "status": "ok",
                         "prefill_instance": 0, "decode_instance": 0, "prefill_start_at": start,
                         "prefill_end_at": end, "transfer_start_at": end,
                         "transfer_end_at": end, "first_token_at": end, "finished_at": finish,
                         "num_generated_tokens": trace.num_output_tokens, "kv_bytes": 0})


def test_validate_finds_the_knee_runs_both_sides_and_writes_the_paired_records(tmp_path):
    profile = make_profile(tmp_path / "prof")
    requests = vr.load_requests(None, "chatbot", 60, 512)
    assert requests.length_scale < 1
    assert (requests.trace.num_prompt_tokens + requests.trace.num_output_tokens).max() <= 512
    served = []

    def real(trace, ttft, tpot, where):
        served.append(trace)
        return single_server(trace, 0.105)            # the real prefill is 5% slower

    result, frames = vr.validate(profile, requests, "light,knee", out=tmp_path / "out",
                                 simulate_fn=lambda t, a, b: single_server(t, 0.1),
                                 real_fn=real)
    # SLOs: 5x a lone request's simulated TTFT (0.1 s) and TPOT (0.01 s)
    assert (result["ttft_slo_s"], result["tpot_slo_s"]) == pytest.approx((0.5, 0.05))
    knee = result["simulated_knee_rate"]
    from traces.metrics import slo_attainment

    def attained(rate):
        steady = requests.repeated(vr.KNEE_REQUESTS)         # where the knee is searched
        return slo_attainment(single_server(steady.at(rate), 0.1), 0.5, 0.05)
    assert attained(knee) >= 0.9 > attained(1.01 * knee)  # the highest rate meeting 90%
    assert [(d["name"], d["rate"]) for d in result["loads"]] == [
        ("light", pytest.approx(vr.LIGHT_SHARE * knee)),
        ("knee", pytest.approx(vr.KNEE_SHARE * knee))]
    # both sides got the same requests: lengths scaled once, arrivals at the load's rate
    for trace, load in zip(served, result["loads"]):
        assert np.array_equal(trace.num_prompt_tokens, requests.trace.num_prompt_tokens)
        # Poisson at 1 req/s, stretched to the load's rate
        np.testing.assert_allclose(trace.arrival_at, requests.trace.arrival_at / load["rate"])
    light = {r["metric"]: r for r in result["loads"][0]["errors"]}
    assert light["ttft_p50_s"]["error"] == pytest.approx(-0.1 / 2.1, rel=0.05)  # 0.1 vs 0.105
    paired = pd.read_parquet(tmp_path / "out" / "knee" / "paired.parquet")
    assert list(paired.columns) == val.paired_columns() and len(paired) == 60
    np.testing.assert_allclose(paired["prefill_time_diff"], -0.005, atol=1e-12)
    saved = json.loads((tmp_path / "out" / "validate.json").read_text())
    assert saved["loads"][1]["name"] == "knee" and set(frames) == {"light", "knee"}
    assert "simulated knee" in val.format_result(result)


def test_default_slos_fit_a_longest_request_that_fills_the_context_with_one_token(tmp_path):
    # fitted to the context, the longest prompt asks 511 + 1 = 512 tokens: its lone run for
    # the SLOs asks two output tokens (TPOT), and still fits the 512-token context
    profile = make_profile(tmp_path / "prof")
    trace = Trace.from_columns([0.0, 1.0, 2.0], [1022, 100, 300], [2, 50, 10], name="full")
    from hardware.serve.run import fit_to_context

    fitted, scale = fit_to_context(trace, 512)
    assert int(fitted.num_prompt_tokens[0] + fitted.num_output_tokens[0]) == 512
    assert int(fitted.num_output_tokens[0]) == 1
    requests = vr.Requests(fitted, 1.0, scale, "test")
    simulate = (lambda t, ttft, tpot: vr.simulate_on_profile(profile, t, "GN-HAWK", ttft, tpot))
    ttft, tpot = vr.default_slos(simulate, requests)
    assert ttft > 0 and tpot > 0


def test_rates_in_requests_per_second_skip_the_knee_and_bad_loads_are_named(tmp_path):
    profile = make_profile(tmp_path / "prof")
    requests = vr.load_requests(None, "chatbot", 10, 512)
    calls = []

    def sim(trace, ttft, tpot):
        calls.append(len(trace))
        return single_server(trace, 0.1)
    result, _ = vr.validate(profile, requests, "2.5", simulate_fn=sim, slos=(1.0, 0.1),
                            real_fn=lambda t, a, b, where: single_server(t, 0.1))
    assert [d["name"] for d in result["loads"]] == ["rate-2.5"]
    assert result["simulated_knee_rate"] is None and calls == [10]   # no sweep, one run
    for text, why in (("fast", "'fast' is not light, knee or a rate"),
                      ("0", "rate 0 must be > 0"), (",", "name one or more loads")):
        with pytest.raises(ValueError, match=why):
            vr.parse_loads(text)


def _one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_bad_inputs_give_one_clear_line(tmp_path, capsys):
    err = _one_line(capsys, ["validate", "--profile", str(tmp_path / "none"),
                             "--workload", "chatbot"])
    assert "--profile" in err and "no profile.toml there" in err
    profile = make_profile(tmp_path / "prof")
    err = _one_line(capsys, ["validate", "--profile", str(profile), "--trace",
                             str(tmp_path / "missing.csv")])
    assert "missing.csv: no such trace file" in err
    err = _one_line(capsys, ["validate", "--profile", str(profile), "--workload", "chatbot",
                             "--mechanism", "GG-Host"])
    assert "--mechanism GG-Host: the profile measured only ['GN-HAWK']" in err
    err = _one_line(capsys, ["validate", "--profile", str(profile), "--workload", "chatbot",
                             "--ttft-slo", "1"])
    assert "give both --ttft-slo and --tpot-slo" in err
    (profile / "model" / "config.json").unlink()
    err = _one_line(capsys, ["validate", "--profile", str(profile), "--workload", "chatbot"])
    assert "no model/config.json" in err


def test_the_command_runs_both_sides_end_to_end_on_a_tiny_trace(tmp_path, capsys):
    """Real processes (a router and two workers) on six requests at the knee load: a few
    seconds of serving, most of the test is the workers' start-up. (Both loads and their
    files: ``test_validate_finds_the_knee_...`` above, the sides replaced.)"""
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    needs.mooncake_engine()
    profile = make_profile(tmp_path / "prof", real_model=True)
    out, plot = tmp_path / "out", tmp_path / "cdf.png"
    assert main(["validate", "--profile", str(profile), "--workload", "chatbot",
                 "--num-requests", "6", "--rates", "knee", "--out", str(out),
                 "--plot", str(plot), "--json"]) == 0
    def refuse(token):
        raise AssertionError(f"non-JSON constant {token}")
    result = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert [load["name"] for load in result["loads"]] == ["knee"]
    assert result["loads"][0]["rate"] == pytest.approx(0.8 * result["simulated_knee_rate"])
    for load in result["loads"]:
        assert load["num_paired"] == 6 and load["only_real"] == load["only_sim"] == []
        assert load["statuses"] == {"real": {"ok": 6}, "sim": {"ok": 6}}
        paired = pd.read_parquet(out / load["name"] / "paired.parquet")
        # every instant of every request on both sides, in order
        for side in ("real", "sim"):
            instants = paired[[f"{name}_{side}" for name in val.INSTANTS]].to_numpy()
            assert not np.isnan(instants).any()
            assert (np.diff(instants, axis=1) >= -1e-6).all()
        assert (out / load["name"] / "real" / "records.parquet").is_file()
    assert plot.stat().st_size > 0 and (out / "validate.json").is_file()


def test_decode_step_ratios_price_the_batch_summed_and_padded_to_its_longest():
    # two requests decode side by side for 1 s, 11 tokens each (TPOT 0.1 s), prompts 90 and 10
    frame = make_records(2, stages={s: 0.0 for s in STAGE_S}, decode_s=1.0, gap_s=0.0)
    frame["num_prompt_tokens"] = [90, 10]
    ratios = val.decode_step_ratios(frame, lambda batch, context: 0.05 * batch)
    assert ratios == {"summed": pytest.approx(1.0), "padded": pytest.approx(1.0)}
    ratios = val.decode_step_ratios(frame, lambda batch, context: 1e-3 * context)
    grown = 11 * np.arange(16) / 16                  # tokens made by each sampled instant
    assert ratios["summed"] == pytest.approx(0.1 / np.mean(1e-3 * (100 + 2 * grown)))
    assert ratios["padded"] == pytest.approx(0.1 / np.mean(1e-3 * 2 * (90 + grown)))
    assert ratios["padded"] < ratios["summed"]      # padding costs more than the sum
    # a stream whose tokens all came in one burst (first token = finish) is left out
    frame.loc[1, "finished_at"] = frame.loc[1, "first_token_at"]
    ratios = val.decode_step_ratios(frame, lambda batch, context: 0.05 * batch)
    assert ratios["summed"] == pytest.approx(2.0)    # the other decoded alone: 0.1 / 0.05


def test_prefill_batch_ratios_price_each_batch_summed_and_padded_to_its_longest():
    # one batch of prompts 300 and 100 taking 0.6 s, then one of a single 200-token prompt
    frame = make_records(3, stages={"prefill": [0.6, 0.6, 0.2]}, gap_s=0.0)
    frame["num_prompt_tokens"] = [300, 100, 200]
    frame.loc[2, ["prefill_start_at", "prefill_end_at"]] += 1.0
    ratios = val.prefill_batch_ratios(frame, lambda lens: 1e-3 * sum(lens))
    assert ratios["summed"] == pytest.approx(np.median([0.6 / 0.4, 0.2 / 0.2]))
    assert ratios["padded"] == pytest.approx(np.median([0.6 / 0.6, 0.2 / 0.2]))


def test_the_knee_search_says_when_there_is_none():
    requests = vr.load_requests(None, "chatbot", 20, 512)
    never = vr.find_knee(lambda t, a, b: single_server(t, 0.1).assign(status="failed_error"),
                         requests, 1.0, 1.0)
    always = vr.find_knee(lambda t, a, b: single_server(t, 0.0), requests, 1.0, 1.0)
    assert math.isnan(never) and always == math.inf
    for knee in (never, always):
        with pytest.raises(ValueError, match="finds no knee"):
            vr.resolve_loads(["knee"], knee)
    assert vr.resolve_loads([3.0, "light"], 10.0) == [vr.Load("rate-3", 3.0),
                                                     vr.Load("light", vr.LIGHT_SHARE * 10.0)]


def test_the_knee_is_searched_on_the_requests_repeated_at_the_same_rate():
    requests = vr.load_requests(None, "chatbot", 8, 512)
    many = requests.repeated(30)
    t, r = many.trace, requests.trace
    assert len(t) == 32 and np.array_equal(t.num_prompt_tokens[8:16], r.num_prompt_tokens)
    np.testing.assert_allclose(t.arrival_at[8:16] - t.arrival_at[:8], r.arrival_at[-1] + 1.0)
    # eight requests meet the SLOs at any rate; thirty-two back to back on one server do not
    assert vr.find_knee(lambda t, a, b: single_server(t, 0.1), requests, 1.0, 1.0) == math.inf
    assert vr.find_knee(lambda t, a, b: single_server(t, 0.1), many, 1.0, 1.0) < 20
