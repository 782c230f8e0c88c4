"""The front end's cost per request: measured by hawk profile --endpoint (bursts of one-token
requests) against a stub engine whose front end takes a set time per request, one at a time,
and simulated as a first-come-first-served queue before the engine. Also the engine's own
timing read from vLLM-style /metrics (traces.engine_metrics)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.engine.frontend import arrivals_seen, serve
from traces import engine_metrics

COST, TTFT, TPOT, CONTEXT = 0.01, 0.03, 0.01, 256


def test_a_front_end_serves_requests_one_at_a_time_in_arrival_order():
    # round trips of 1.5 s holding 1 s of the front end's work: 0 and 0 at once, the second
    # waits the first's 1 s; 0.5 comes while both are served (free at 2.5); 10 to an idle one
    assert arrivals_seen([0.0, 0.0, 0.5, 10.0], [1.5] * 4, 1.0) == pytest.approx(
        [1.5, 2.5, 3.5, 11.5])
    # no cost: each its own round trip, but never seen before the one ahead of it (the 4 s
    # stall of the first holds the second)
    assert arrivals_seen([0.0, 1.0, 9.0], [4.0, 0.5, 0.5], 0.0) == pytest.approx(
        [4.0, 4.0, 9.5])
    # a round trip shorter than the front end's work: a lone request waits that work
    assert arrivals_seen([0.0], [0.2], 1.0) == pytest.approx([1.0])


def test_streamed_tokens_and_admissions_share_the_front_end():
    # two requests, round trips 0.1 s holding 0.05 s of admission; the first's 3 tokens come
    # at 1.0, 1.1, 1.2 and cost 0.08 s each to stream; the second arrives at 1.0
    seen, first_wait, last_wait = serve([0.0, 1.0], [0.1, 0.1], 0.05, 0.08,
                                        [1.0, np.nan], [1.2, np.nan], [3, 2])
    # admission of the second is ready at 1.05, behind the first token (1.0 to 1.08)
    assert seen == pytest.approx([0.1, 1.08 + 0.05])
    # the first token waits nothing, the second (ready 1.1) waits for that admission (to
    # 1.13), so the third (ready 1.2) waits until 1.21: 0.01 s; the second request made none
    assert first_wait[0] == pytest.approx(0.0) and last_wait[0] == pytest.approx(0.01)
    assert np.isnan(first_wait[1]) and np.isnan(last_wait[1])
    # admitted in arrival order: a long round trip holds the one behind it
    seen, _, _ = serve([0.0, 0.1], [1.0, 0.1], 0.05, 0.0, [np.nan] * 2, [np.nan] * 2, [1, 1])
    assert seen == pytest.approx([1.0, 1.05])
    # alone, nothing waits: the round trip holds one admission and one token
    seen, first_wait, last_wait = serve([0.0], [0.1], 0.05, 0.08, [0.5], [0.9], [5])
    assert seen == pytest.approx([0.1]) and first_wait[0] == last_wait[0] == 0.0


METRICS = """# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase.
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 400.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 20.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_engine_metrics_are_means_over_what_happened_between_two_scrapes():
    before = engine_metrics.parse(METRICS)
    after = engine_metrics.parse(METRICS.replace("0.25", "0.45").replace(
        "prefill_time_seconds_count{engine=\"0\",model_name=\"m\"} 5.0",
        "prefill_time_seconds_count{engine=\"0\",model_name=\"m\"} 7.0"))
    assert before["request_prefill_time_seconds_count"] == 5.0
    means = engine_metrics.means(before, after)
    assert means == {"prefill_s": pytest.approx(0.1)}        # 0.2 s over 2 requests
    assert engine_metrics.means({}, after) == {}             # no /metrics: unknown, not zero
    assert engine_metrics.means(engine_metrics.parse(""), after) == {}


@pytest.fixture(scope="module")
def costly(tmp_path_factory):
    pytest.importorskip("aiohttp")
    from sim.commands.main import main
    from tests.builders import run_stub_server

    out = tmp_path_factory.mktemp("frontend") / "p"
    with run_stub_server("--models", "m", "--max-model-len", str(CONTEXT), "--request-cost",
                         str(COST), ttft_s=TTFT, tpot_s=TPOT) as url:
        assert main(["profile", "--endpoint", url, "--out", str(out), "--quick",
                     "--decode-tokens", "8", "--batches", "1,4"]) == 0
        yield out, url


def test_the_profile_recovers_the_front_ends_cost_per_request(costly):
    from sim.models.profile_dir import load_profile_dir

    serving = load_profile_dir(costly[0]).serving
    # the stub's lock, and the client's and the server's own work per request beside it
    assert 0.8 * COST < serving["frontend_request_s"] < 2 * COST
    # a lone request pays the front end once, inside the latency beside the engine's step
    assert serving["api_latency_s"] > COST


def test_the_simulator_queues_a_burst_at_the_front_end_as_the_stub_does(costly, tmp_path):
    from sim.validation.run import endpoint_records, simulate_on_profile
    from traces import metrics
    from traces.trace import Trace

    profile, url = costly
    burst = Trace.from_columns(np.zeros(12), [16] * 12, [4] * 12, name="burst")
    real = endpoint_records(burst, url, 1.0, 0.1, tmp_path / "real")
    sim = simulate_on_profile(profile, burst, None, 1.0, 0.1)
    real_ttft, sim_ttft = np.sort(metrics.ttft(real)), np.sort(metrics.ttft(sim))
    # the last of twelve waits eleven costs at the front end, on both sides
    real_spread, sim_spread = real_ttft[-1] - real_ttft[0], sim_ttft[-1] - sim_ttft[0]
    assert real_spread > 8 * COST
    assert 0.6 * real_spread < sim_spread < 1.6 * real_spread
    assert np.median(sim_ttft) == pytest.approx(np.median(real_ttft), rel=0.4)
    # the records keep the requests' own arrivals
    assert np.all(sim["arrival_at"].to_numpy() == 0.0)


def test_a_noisy_tables_extrapolation_never_prices_a_step_below_its_fastest_point():
    from sim.models.table import TablePredictor

    # decode at batch 16 measured faster than at batch 4 (a noisy profile): the end segment
    # extrapolated to batch 64 would fall below zero
    table = TablePredictor([16, 512], [0.004, 0.02], [1, 4, 16], [64],
                           [[0.003], [0.012], [0.002]])
    assert table.decode_step_time(64, 64 * 64) == pytest.approx(0.002)
    assert table.decode_step_time(4, 4 * 64) == pytest.approx(0.012)   # measured: as measured
    assert table.mixed_step_time([(300, 0)], [64] * 64) >= 0.002


def test_churn_prices_each_request_whose_prompt_starts_in_a_step():
    from sim.engine.measured import ChurnPriced
    from sim.models.table import TablePredictor

    table = TablePredictor([1, 512], [0.004, 0.02], [1, 16], [64], [[0.003], [0.006]])
    priced = ChurnPriced(table, 0.001)
    decodes = [64] * 8
    assert priced.mixed_step_time([], decodes) == table.mixed_step_time([], decodes)
    # two prompts start here, a third one's later chunk goes on
    chunks = [(100, 0), (1, 0), (50, 200)]
    assert priced.mixed_step_time(chunks, decodes) == pytest.approx(
        table.mixed_step_time(chunks, decodes) + 0.002)
    assert priced.mixed_step(chunks, decodes)[0] == pytest.approx(
        table.mixed_step(chunks, decodes)[0] + 0.002)
    assert priced.decode_step_time(8, 512) == table.decode_step_time(8, 512)


def test_the_churn_cost_is_the_share_of_time_lost_per_request():
    from traces.endpoint_costs import churn_cost

    # steps 10 ms alone, 12.5 ms with 50 req/s coming and going: 20% of each second lost to
    # 50 requests, 4 ms each
    samples = {"churn:64:4:32": {"kind": "churn", "prompt": 64, "batch": 4, "max_tokens": 32,
                                 "baseline_seconds": [0.010, 0.010, 0.011],
                                 "seconds": [0.0125, 0.0125, 0.0110], "rates": [50, 50, 40]}}
    cost = churn_cost(samples)
    assert cost["request_churn_s"] == pytest.approx(0.004)     # the median run
    assert (cost["churn_batch"], cost["churn_context"]) == (4, 80)
    assert churn_cost({}) is None


def test_the_profile_recovers_what_each_request_costs_the_others_steps(tmp_path):
    pytest.importorskip("aiohttp")
    from sim.commands.main import main
    from sim.engine.measured import measured_parts
    from sim.config import RunConfig
    from sim.models.profile_dir import load_profile_dir
    from tests.builders import run_stub_server

    churn = 0.004
    with run_stub_server("--models", "m", "--max-model-len", str(CONTEXT), "--churn-cost",
                         str(churn), ttft_s=TTFT, tpot_s=TPOT) as url:
        assert main(["profile", "--endpoint", url, "--out", str(tmp_path / "p"), "--quick",
                     "--decode-tokens", "32", "--batches", "1,4"]) == 0
    serving = load_profile_dir(tmp_path / "p").serving
    assert 0.5 * churn < serving["request_churn_s"] < 1.6 * churn
    m = measured_parts(RunConfig().replace(**{"cluster.profile": str(tmp_path / "p")}))
    # the table prices a one-token prompt joining a step at about nothing (the stub's steps
    # do not grow with the batch): what the simulator adds is about the churn itself
    assert 0.5 * churn < m.request_overhead_s < 1.6 * churn


def test_both_sides_are_judged_from_when_the_client_really_sent_each_request():
    import pandas as pd

    from sim.validation.endpoint import as_sent
    from traces.trace import Trace

    trace = Trace.from_columns([0.0, 0.1, 0.11, 0.3], [8] * 4, [4] * 4, name="t")
    real = pd.DataFrame({"request_id": trace.request_id, "arrival_at": trace.arrival_at,
                         "first_token_at": [0.05, 0.2, 0.3, 0.4]})
    # the second left 30 ms late, the third before it (a task run out of order: never before
    # the one before it), the fourth's instant is unknown (its due one)
    real.attrs["sent_at"] = np.array([0.0, 0.13, 0.12, np.nan])
    shifted, sent = as_sent(real, trace)
    assert sent.arrival_at == pytest.approx([0.0, 0.13, 0.13, 0.3])
    assert shifted["arrival_at"].to_numpy() == pytest.approx([0.0, 0.13, 0.13, 0.3])
    assert real["arrival_at"].to_numpy() == pytest.approx(trace.arrival_at)  # not changed
    del real.attrs["sent_at"]
    assert as_sent(real, trace)[1] is trace


def test_the_api_servers_ttft_percentiles_come_from_its_histograms_buckets():
    def text(counts):
        edges = ("0.01", "0.02", "0.1", "+Inf")
        return "".join(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{e}",'
                       f'model_name="m"}} {c}\n' for e, c in zip(edges, counts)) + (
            f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} '
            f'{counts[-1]}\nvllm:time_to_first_token_seconds_sum{{engine="0",'
            f'model_name="m"}} {0.02 * counts[-1]}\n')
    before, after = engine_metrics.parse(text([1, 1, 1, 1])), engine_metrics.parse(
        text([3, 9, 11, 11]))
    # 10 new: 2 under 10 ms, 6 more under 20 ms, 2 more under 100 ms
    means = engine_metrics.means(before, after)
    assert means["api_ttft_p50_s"] == pytest.approx(0.015)   # the 5th of 10: 3 of 6 in
    assert means["api_ttft_p90_s"] == pytest.approx(0.06)    # the 9th: 1 of 2 in
    assert means["api_ttft_s"] == pytest.approx(0.02)


def test_the_cpu_per_streamed_token_is_what_decode_runs_spend_beyond_their_admissions():
    from traces.endpoint_costs import frontend_token_cost

    # 64 one-token requests cost 0.128 s of the API server's CPU: 2 ms each; 8 requests of
    # 33 tokens cost 0.016 s for their admissions and 8 x 32 x 0.5 ms for their other tokens
    samples = {"burst:1:64:1": {"kind": "burst", "batch": 64, "max_tokens": 1,
                                "api_cpu_seconds": [0.128, 0.13, 0.126]},
               "burst:1:8:1": {"kind": "burst", "batch": 8, "max_tokens": 1,
                               "api_cpu_seconds": [0.05]},
               "decode:64:8:33": {"kind": "decode", "batch": 8, "max_tokens": 33,
                                  "api_cpu_seconds": [0.016 + 8 * 32 * 5e-4] * 3}}
    assert frontend_token_cost(samples) == pytest.approx(5e-4)
    del samples["decode:64:8:33"]["api_cpu_seconds"]
    assert frontend_token_cost(samples) is None             # no /metrics: not measured
