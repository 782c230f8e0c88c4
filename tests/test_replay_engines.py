"""Replay against what real engines do, each behaviour reproduced by ``traces.stub_server``.

Seen replaying against llama-cpp-python's server and llama.cpp's ``llama-server``: streams cut
with ``data: [DONE]`` and no finish chunk, transfers dropped mid-stream, two tokens merged
into one chunk (half a UTF-8 character held back), no usage, prompts taken only as strings,
``timings`` with the server's own prompt and predicted milliseconds and cached tokens.
Neither engine installs from a wheel (llama-cpp-python builds llama.cpp from source), so the
tests run against the stand-in server, one subprocess per engine.
"""

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from traces.prompts import PromptSpec
from traces.replay import ReplayConfig, check_schedule, client_exhaustion
from traces.trace import Trace
from tests.builders import run_stub_server

ROOT = Path(__file__).resolve().parents[1]
CUT, DROP, BAD_USAGE = 20, 22, 9   # output lengths the stand-in cuts / drops / miscounts


def stub_server(*flags: str, ttft_s: float = 0.02, tpot_s: float = 0.005):
    pytest.importorskip("aiohttp", reason="the replay client needs aiohttp (extra 'replay')")
    return run_stub_server(*flags, ttft_s=ttft_s, tpot_s=tpot_s)


@pytest.fixture(scope="module")
def llama_cpp_python():
    """Cuts and drops streams, merges tokens, sends no usage, takes string prompts only."""
    with stub_server("--cut-lengths", str(CUT), "--drop-lengths", str(DROP), "--merge-utf8",
                     "--no-usage", "--string-prompts-only") as url:
        yield url


@pytest.fixture(scope="module")
def llama_server():
    """Sends usage (wrong for BAD_USAGE tokens) and timings with a one-slot prefix cache."""
    with stub_server("--timings", "--bad-usage-lengths", str(BAD_USAGE), ttft_s=0.05) as url:
        yield url


def make_trace(outputs, prompt=50, gap=0.02) -> Trace:
    n = len(outputs)
    return Trace.from_columns(np.arange(n) * gap, np.full(n, prompt), np.asarray(outputs))


def run(trace, url, **options):
    from traces.replay import replay

    return replay(trace, ReplayConfig(url, timeout_s=20, **options))


def test_cut_and_dropped_streams_are_failures_not_ok(llama_cpp_python):
    result = run(make_trace([8, CUT, 8, DROP, 8]), llama_cpp_python)
    records, client = result.records, result.client
    assert records["status"].tolist() == ["ok", "failed_truncated", "ok", "failed_truncated",
                                          "ok"]
    assert "no finish reason before data: [DONE]" in client["error"].iloc[1]
    assert "transfer broke" in client["error"].iloc[3]
    cut = records.iloc[[1, 3]]
    assert (cut["num_generated_tokens"] < cut["num_output_tokens"]).all()
    assert (cut["num_generated_tokens"] > 0).all()          # what came is counted
    summary = result.summary(2.0, 0.2)
    assert summary["statuses"] == {"ok": 3, "failed_truncated": 2}
    assert summary["slo_attainment"] == pytest.approx(3 / 5)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_merged_chunks_without_usage_are_counted_exactly(llama_cpp_python, api):
    n = 8
    plain = run(make_trace([n] * 4), llama_cpp_python, api=api)
    assert (plain.client["num_chunk_tokens"] == n - 1).all()     # one chunk holds two tokens
    assert (plain.client["token_count_source"] == "length").all()
    assert (plain.client["finish_reason"] == "length").all()
    assert (plain.records["num_generated_tokens"] == n).all()
    assert (plain.records["status"] == "ok").all()
    counted = run(make_trace([n] * 4), llama_cpp_python, api=api, logprobs=True)
    assert (counted.client["token_count_source"] == "logprobs").all()
    assert (counted.client["num_logprob_tokens"] == n).all()
    assert (counted.records["num_generated_tokens"] == n).all()


def test_token_id_prompts_on_a_string_only_engine_say_so(llama_cpp_python):
    result = run(make_trace([4, 4]), llama_cpp_python, prompt=PromptSpec(kind="token_ids"))
    assert (result.records["status"] == "failed_error").all()
    assert result.client["error"].str.contains("accept only string prompts").all()
    assert result.client["error"].str.contains("HTTP 422").all()


def test_usage_that_disagrees_with_the_stream_is_not_trusted(llama_server):
    result = run(make_trace([6, BAD_USAGE, 6]), llama_server)
    client = result.client
    assert result.records["num_generated_tokens"].tolist() == [6, BAD_USAGE, 6]
    assert client["usage_completion_tokens"].tolist() == [6, 10 * BAD_USAGE, 6]
    assert client["usage_mismatch"].tolist() == [False, True, False]
    assert client["token_count_source"].tolist() == ["usage", "timings", "usage"]
    assert result.summary(2.0, 0.2)["num_usage_mismatch"] == 1


def test_server_timings_are_kept_and_prompts_share_no_prefix(llama_server, tmp_path):
    result = run(make_trace([6] * 8, prompt=40, gap=0.05), llama_server)
    client = result.client
    assert (client["server_prompt_ms"] == 50.0).all()
    np.testing.assert_allclose(client["server_predicted_ms"], 25.0)
    assert client["server_cached_tokens"].iloc[1:].eq(0).all()   # each differs at token one
    assert client["server_prompt_tokens_evaluated"].iloc[1:].eq(40).all()
    summary = result.write(tmp_path / "run", 2.0, 0.2)
    assert summary["server_ttft_p50_s"] == pytest.approx(0.05)
    assert summary["ttft_client_minus_server_p50_s"] >= 0.0
    assert summary["server_cached_tokens"] == int(client["server_cached_tokens"].sum())


def test_a_shared_prefix_ratio_is_what_the_server_caches(llama_server):
    spec = PromptSpec(shared_prefix_ratio=0.5, seed=7)
    result = run(make_trace([4] * 8, prompt=40, gap=0.05), llama_server, prompt=spec)
    assert result.client["server_cached_tokens"].iloc[1:].eq(20).all()


def test_an_absurd_arrival_is_refused_before_anything_is_sent():
    trace = Trace.from_columns(np.array([0.0, 1e9]), np.array([5, 5]), np.array([2, 2]))
    with pytest.raises(ValueError, match=r"request 1 arrives at 1e\+09 s, past the replay's "
                                         r"limit of 86400 s \(--max-duration\)"):
        check_schedule(trace, ReplayConfig("http://127.0.0.1:9"))


def test_cli_refuses_an_absurd_arrival(tmp_path, capsys):
    pytest.importorskip("aiohttp")
    from sim.commands.main import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n0,5,2\n1e7,5,2\n")
    code = main(["replay", "--endpoint", "http://127.0.0.1:9", "--trace", str(trace),
                 "--max-duration", "3600"])
    assert code == 2
    assert "past the replay's limit of 3600 s" in capsys.readouterr().err


def test_resource_exhaustion_is_named_as_the_clients():
    import aiohttp

    class Key:
        ssl, host, port = False, "127.0.0.1", 80

    emfile = aiohttp.ClientConnectorError(Key(), OSError(errno.EMFILE, "Too many open files"))
    assert client_exhaustion(emfile) == "Too many open files"
    try:
        try:
            raise OSError(errno.ENFILE, "Too many open files in system")
        except OSError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as wrapped:
        assert client_exhaustion(wrapped) == "Too many open files in system"
    refused = aiohttp.ClientConnectorError(Key(), OSError(errno.ECONNREFUSED, "refused"))
    assert client_exhaustion(refused) is None


EXHAUST = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from traces.replay import ReplayConfig, replay
    from traces.trace import Trace

    trace = Trace.from_columns(np.zeros(40), np.full(40, 10), np.full(40, 2))
    config = ReplayConfig(sys.argv[1], timeout_s=30)
    import aiohttp  # noqa: F401  (loaded before the limit)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    result = replay(trace, config)
    print(json.dumps({"statuses": result.records["status"].tolist(),
                      "errors": sorted(set(result.client["error"]))}))
""")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_running_out_of_file_descriptors_is_a_client_failure():
    with stub_server(ttft_s=1.0) as url:                 # 40 requests held open at once
        out = subprocess.run([sys.executable, "-c", EXHAUST, url], cwd=ROOT, text=True,
                             capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.splitlines()[-1])
    statuses = set(report["statuses"])
    assert statuses <= {"ok", "failed_client"} and {"ok", "failed_client"} <= statuses, report
    client_errors = [e for e in report["errors"] if e]
    assert all(e.startswith("client: Too many open files") for e in client_errors), report


def test_without_aiohttp_replay_prints_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from sim.commands.main import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n0,5,2\n")
    monkeypatch.setitem(sys.modules, "aiohttp", None)          # import aiohttp now fails
    code = main(["replay", "--endpoint", "http://127.0.0.1:9", "--trace", str(trace)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "pip install -e .[replay]" in err and "Traceback" not in err
