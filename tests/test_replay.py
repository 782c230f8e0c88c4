"""Replay client against a real streaming server in a subprocess: timing, schedule, failures."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="the replay client needs aiohttp (extra 'replay')")

from traces.prompts import PromptSpec  # noqa: E402
from traces.replay import ReplayConfig, replay, request_body  # noqa: E402
from traces.schema import Status, read_records  # noqa: E402
from traces.trace import Trace  # noqa: E402
from tests.builders import run_stub_server  # noqa: E402

FAIL, HANG, GARBAGE = 13, 17, 19   # output lengths the stand-in server refuses / never
                                   # answers / answers with a non-object JSON event


def stub_server(ttft_s: float, tpot_s: float):
    return run_stub_server("--fail-lengths", str(FAIL), "--hang-lengths", str(HANG),
                           "--garbage-lengths", str(GARBAGE), ttft_s=ttft_s, tpot_s=tpot_s)


def make_trace(arrivals, prompt=100, output=8) -> Trace:
    n = len(arrivals)
    return Trace.from_columns(np.asarray(arrivals, float), np.broadcast_to(prompt, n),
                              np.broadcast_to(output, n))


@pytest.fixture(scope="module")
def fast_server():
    with stub_server(ttft_s=0.02, tpot_s=0.005) as url:
        yield url


def test_prompt_and_body():
    body = request_body(ReplayConfig("http://h:1"), "a b c d", 9)
    assert body["prompt"] == "a b c d" and body["max_tokens"] == 9
    assert body["ignore_eos"] is True and body["min_tokens"] == 9 and body["stream"] is True
    assert "logprobs" not in body and "cache_prompt" not in body
    ids = PromptSpec(kind="token_ids")
    body = request_body(ReplayConfig("http://h:1", prompt=ids, ignore_eos=False, logprobs=True,
                                     cache_prompt=False), [42, 43], 2)
    assert body["prompt"] == [42, 43] and "ignore_eos" not in body
    assert body["logprobs"] == 1 and body["cache_prompt"] is False
    chat = ReplayConfig("http://h:1/v1", api="chat", logprobs=True)
    assert chat.url == "http://h:1/v1/chat/completions"
    body = request_body(chat, "hello there", 1)
    assert body["messages"][0]["content"] == "hello there" and body["logprobs"] is True
    with pytest.raises(ValueError, match="api 'embed' is not one of"):
        ReplayConfig("http://h:1", api="embed")
    with pytest.raises(ValueError, match="token-id prompts need api='completions'"):
        ReplayConfig("http://h:1", api="chat", prompt=ids)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_measured_ttft_tpot_match_the_server_delays(api):
    ttft, tpot, n_out = 0.15, 0.03, 10
    with stub_server(ttft, tpot) as url:
        result = replay(make_trace(np.arange(20) * 0.05, output=n_out),
                        ReplayConfig(url, api=api, timeout_s=10))
    records = result.records
    assert (records["status"] == Status.OK.value).all()
    assert (records["num_generated_tokens"] == n_out).all()
    measured_ttft = records["first_token_at"] - records["arrival_at"]
    measured_tpot = (records["finished_at"] - records["first_token_at"]) / (n_out - 1)
    assert measured_ttft.min() >= ttft
    assert measured_ttft.median() == pytest.approx(ttft, abs=0.02)
    assert measured_tpot.median() == pytest.approx(tpot, abs=0.003)
    assert len(result.itl) == 20 * (n_out - 1)
    assert result.itl["latency_s"].median() == pytest.approx(tpot, abs=0.003)
    assert records["prefill_start_at"].isna().all() and records["transfer_end_at"].isna().all()
    assert (result.client["server_prompt_tokens"] == 100).all()


def test_keeps_an_open_loop_schedule_at_200_per_second():
    """Sends follow the trace, not the responses: at 200 req/s against a server that takes
    about 1 s per request, some 200 requests are in flight at once. A client that waited for
    answers, or capped its connections (aiohttp's default is 100: about 93 requests/s here),
    would fall behind and keep falling, about 3 s by the last of 600; an open-loop one lags only by
    scheduling noise, tens of milliseconds, up to about a second on a heavily loaded 2-core
    machine, and that lag does not build up over the run."""
    rate, seconds = 200.0, 3.0
    arrivals = np.arange(int(rate * seconds)) / rate
    with stub_server(ttft_s=1.0, tpot_s=0.01) as url:
        result = replay(make_trace(arrivals, output=8), ReplayConfig(url, timeout_s=30))
    summary = result.summary(2.0, 0.2)
    assert summary["statuses"] == {"ok": len(arrivals)}
    sent = result.client["sent_at"].to_numpy()
    assert np.all(sent >= arrivals - 1e-3)                      # never early
    lag = result.client["send_lag_s"].to_numpy()
    assert lag.max() < 2.0, summary                             # a 100-connection cap: 3 s
    tail, head = np.median(lag[-100:]), np.median(lag[:100])
    assert tail < head + 1.0, (head, tail)                      # capped: + 3 s by the end
    assert summary["ttft_p50_s"] == pytest.approx(1.0, abs=0.5)   # the answers really were slow


def test_summary_is_broken_down_per_tenant(fast_server):
    trace = dataclasses.replace(make_trace(np.arange(6) * 0.01, output=4),
                                tenant=np.array(["a", "b", "a", "b", "a", "a"], dtype=object))
    result = replay(trace, ReplayConfig(fast_server, timeout_s=10))
    assert list(result.records["tenant"]) == ["a", "b", "a", "b", "a", "a"]
    tenants = result.summary(2.0, 0.2)["tenants"]
    assert {k: v["num_requests"] for k, v in tenants.items()} == {"a": 4, "b": 2}


def test_sends_do_not_wait_for_responses():
    with stub_server(ttft_s=1.0, tpot_s=0.01) as url:
        result = replay(make_trace(np.arange(20) * 0.02, output=2), ReplayConfig(url))
    sent = result.client["sent_at"].to_numpy()
    first = result.records["first_token_at"].to_numpy()
    assert sent[-1] < first[0]                 # all 20 sent before the first answer came
    # a send that waited for an answer would lag by the server's 1 s TTFT; scheduling noise
    # on a loaded 2-core machine reaches about 0.1 s
    assert np.nanmax(result.client["send_lag_s"]) < 0.5


def test_errors_and_timeouts_are_recorded_not_fatal(fast_server):
    outputs = np.array([8, FAIL, 8, HANG, 8, FAIL, 8])
    trace = Trace.from_columns(np.arange(7) * 0.01, np.full(7, 50), outputs)
    result = replay(trace, ReplayConfig(fast_server, timeout_s=0.5))
    status = result.records["status"].tolist()
    assert status == ["ok", "failed_error", "ok", "failed_timeout", "ok", "failed_error", "ok"]
    failed = result.records.iloc[[1, 3]]
    assert failed["first_token_at"].isna().all() and failed["num_generated_tokens"].eq(0).all()
    timed_out = result.records.iloc[3]
    assert timed_out["finished_at"] - timed_out["arrival_at"] == pytest.approx(0.5, abs=0.1)
    assert "HTTP 500" in result.client["error"].iloc[1]
    assert result.summary(2.0, 0.2)["slo_attainment"] == pytest.approx(4 / 7)


def test_malformed_stream_event_fails_that_request_only(fast_server):
    outputs = np.array([8, GARBAGE, 8])
    trace = Trace.from_columns(np.arange(3) * 0.01, np.full(3, 50), outputs)
    result = replay(trace, ReplayConfig(fast_server, timeout_s=5))
    assert result.records["status"].tolist() == ["ok", "failed_error", "ok"]
    assert "not a JSON object" in result.client["error"].iloc[1]


def test_unreachable_endpoint_fails_every_request_without_raising():
    result = replay(make_trace([0.0, 0.01]), ReplayConfig("http://127.0.0.1:9", timeout_s=2))
    assert (result.records["status"] == Status.FAILED_ERROR.value).all()
    assert result.client["error"].str.len().gt(0).all()


def run_cli(argv) -> int:
    from traces import commands

    parser = argparse.ArgumentParser(prog="hawk")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_replays_a_trace_file_and_writes_the_simulator_outputs(fast_server, tmp_path,
                                                                   capsys):
    trace = tmp_path / "t.csv"
    rows = "\n".join(f"{0.01 * i},{40 + i},{6}" for i in range(30))
    trace.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n" + rows + "\n")
    out = tmp_path / "run"
    code = run_cli(["replay", "--endpoint", fast_server, "--trace", str(trace), "--out", str(out),
                    "--num-requests", "25", "--rate-scale", "2", "--workload", "summarization",
                    "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    records = read_records(out / "records.parquet")
    assert len(records) == 25 and (records["status"] == "ok").all()
    np.testing.assert_allclose(records["arrival_at"], 0.005 * np.arange(25))
    summary = json.loads((out / "summary.json").read_text())
    assert summary == printed and summary["ttft_slo_s"] == 15.0
    assert {"send_lag_p50_s", "send_lag_p99_s", "send_lag_max_s"} <= set(summary)
    assert (out / "itl.parquet").exists() and (out / "client.parquet").exists()


def test_cli_bad_trace_row_is_a_named_error(fast_server, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n0,5,2\n1,5,zero\n")
    with pytest.raises(ValueError, match=r"t.csv: line 3: field 'num_output_tokens'"):
        run_cli(["replay", "--endpoint", fast_server, "--trace", str(trace)])


def test_choose_model_takes_the_only_served_one_and_names_the_served_ones():
    from traces.replay import ReplayError, choose_model

    assert choose_model(None, ["tiny-llama"]) == "tiny-llama"
    assert choose_model(None, None) == "default"              # no listing: as before
    assert choose_model("m", None) == "m"
    assert choose_model("b", ["a", "b"]) == "b"
    with pytest.raises(ReplayError, match=r"serves 2 models \(a, b\): name one with --model"):
        choose_model(None, ["a", "b"])
    with pytest.raises(ReplayError, match=r"does not serve model 'default'; it serves a"):
        choose_model("default", ["a"])


def test_the_models_url_follows_the_endpoint():
    for endpoint in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions",
                     "http://h:1/v1/chat/completions"):
        assert ReplayConfig(endpoint).models_url == "http://h:1/v1/models"


def test_a_server_listing_one_model_is_sent_that_model():
    # as vLLM: any other model name is answered 404 ("The model `default` does not exist")
    with run_stub_server("--models", "tiny-llama", ttft_s=0.01, tpot_s=0.002) as url:
        result = replay(make_trace([0.0, 0.01]), ReplayConfig(url, timeout_s=5))
        assert (result.records["status"] == "ok").all()
        assert result.summary(2.0, 0.2)["model"] == "tiny-llama"
        with pytest.raises(ValueError, match="does not serve model 'other'; it serves tiny-llama"):
            replay(make_trace([0.0]), ReplayConfig(url, model="other", timeout_s=5))


def test_the_summary_names_the_most_common_errors(fast_server, capsys):
    from traces.commands import format_replay_summary

    outputs = np.array([8, FAIL, FAIL, GARBAGE, 8])
    trace = Trace.from_columns(np.arange(5) * 0.01, np.full(5, 50), outputs)
    summary = replay(trace, ReplayConfig(fast_server, timeout_s=5)).summary(2.0, 0.2)
    top = summary["top_errors"]
    assert [(e["count"], e["status"]) for e in top] == [(2, "failed_error"), (1, "failed_error")]
    assert "HTTP 500" in top[0]["error"] and "refusing 13 tokens" in top[0]["error"]
    assert "not a JSON object" in top[1]["error"]
    text = format_replay_summary(summary)
    assert "most common errors" in text and "2 x failed_error: HTTP 500" in text


def test_a_status_the_server_names_survives_the_http_boundary():
    lost = 11
    with run_stub_server("--lost-lengths", str(lost), ttft_s=0.01, tpot_s=0.002) as url:
        trace = Trace.from_columns(np.array([0.0, 0.01]), np.full(2, 50), np.array([8, lost]))
        result = replay(trace, ReplayConfig(url, timeout_s=5))
    assert result.records["status"].tolist() == ["ok", "failed_instance_lost"]
    assert "decode instance lost" in result.client["error"].iloc[1]


def test_cli_reads_a_trace_with_its_own_column_names(fast_server, tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("ts_ms,in,out\n" + "\n".join(f"{10 * i},{30 + i},4" for i in range(5)) + "\n")
    out = tmp_path / "run"
    assert run_cli(["replay", "--endpoint", fast_server, "--trace", str(trace), "--columns",
                    "arrival_at=ts_ms,num_prompt_tokens=in,num_output_tokens=out,time_unit=ms",
                    "--out", str(out), "--json"]) == 0
    records = read_records(out / "records.parquet")
    assert records["num_prompt_tokens"].tolist() == [30, 31, 32, 33, 34]
    assert records["arrival_at"].tolist() == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04])
    with pytest.raises(ValueError, match="--columns arrival_at=COL"):   # unnamed: says how
        run_cli(["replay", "--endpoint", fast_server, "--trace", str(trace)])


def test_cli_columns_flag_names_the_fields_it_takes(capsys):
    with pytest.raises(SystemExit):
        run_cli(["replay", "--endpoint", "http://h:1", "--trace", "t.csv", "--columns", "ts"])
    assert "FIELD=COLUMN pairs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli(["replay", "--endpoint", "http://h:1", "--trace", "t.csv", "--columns",
                 "arrival=ts"])
    assert "not among" in capsys.readouterr().err
