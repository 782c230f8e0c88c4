"""The served path in separate processes: router, prefill and decode workers on loopback.

Greedy tokens streamed by the router equal the single-process reference (quantised as the
decode side holds its KV); both sides end with nothing held; a killed worker fails only its
own in-flight requests, the router keeps serving, and a restarted worker rejoins.
"""

import json
import threading
import urllib.request

import numpy as np
import pytest

from tests import needs

torch = pytest.importorskip("torch")
pytest.importorskip("aiohttp")
needs.mooncake_engine()

from hardware.model.config import tiny_config  # noqa: E402
from hardware.model.generate import greedy_generate, quantize_kv  # noqa: E402
from hardware.model.llama import LlamaModel  # noqa: E402
from hardware.serve.cluster import ClusterConfig, LocalCluster  # noqa: E402


def stream(endpoint, body, chat=False, on_token=None):
    """POST one streaming request; (token ids, error text or None)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(endpoint + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    tokens, error = [], None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                error = event["error"]["message"]
                break
            tokens += event["choices"][0].get("token_ids", [])
            if on_token is not None and tokens:
                on_token(len(tokens))
    return tokens, error


def run_all(endpoint, bodies, chat_flags=None, on_token=None):
    results = [None] * len(bodies)
    chat_flags = chat_flags or [False] * len(bodies)

    def one(i):
        results[i] = stream(endpoint, bodies[i], chat_flags[i],
                            on_token and (lambda n, i=i: on_token(i, n)))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return results


def no_leaks(cluster):
    workers = cluster.get("/hawk/workers")
    for w in workers:
        assert w["held_blocks"] == [], w
        if w["role"] == "prefill":
            assert w["send_buffer"] == [] and w["open_regions"] == 0, w
        else:
            assert w["running"] == 0 and w["registered"] == 8, w   # the 8 bank buffers only
    return workers


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return LlamaModel.random(tiny_config(), seed=0, device="cpu")


def test_two_prefill_workers_and_a_decode_worker_stream_the_reference_tokens(model, tmp_path):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (7, 50, 33, 120, 2)]
    max_new = [20, 3, 41, 16, 9]
    config = ClusterConfig(num_prefill=2, num_decode=1, mechanism="GN-HAWK")
    with LocalCluster(config, log_dir=tmp_path) as cluster:
        bodies = [{"prompt": p, "max_tokens": n} for p, n in zip(prompts, max_new)]
        bodies[2] = {"messages": [{"role": "user", "content": prompts[2]}],
                     "max_tokens": max_new[2]}
        results = run_all(cluster.endpoint, bodies, [False, False, True, False, False])
        log = cluster.get("/hawk/requests")
        no_leaks(cluster)
    want = greedy_generate(model, prompts, max_new, kv_quantize=quantize_kv("bfloat8_b"))
    assert [r[0] for r in results] == want
    assert all(r[1] is None for r in results)
    assert {e["prefill_instance"] for e in log} == {0, 1}          # both prefill workers used
    for e in log:
        assert e["status"] == "ok"
        assert (e["arrival_at"] <= e["prefill_start_at"] <= e["prefill_end_at"]
                <= e["transfer_start_at"] <= e["transfer_end_at"] <= e["first_token_at"]
                <= e["finished_at"])


def test_bad_requests_are_refused_by_name_and_gg_direct_serves_the_plain_reference(model,
                                                                                  tmp_path):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    with LocalCluster(ClusterConfig(mechanism="GG-Direct"), log_dir=tmp_path) as cluster:
        got = run_all(cluster.endpoint, [{"prompt": p, "max_tokens": 30} for p in prompts])
        assert [r[0] for r in got] == greedy_generate(model, prompts, [30, 30])
        for body, message in (({"prompt": [5000], "max_tokens": 2}, "token ids in 0..1023"),
                              ({"prompt": [1] * 500, "max_tokens": 20}, "context of 512"),
                              ({"prompt": [1], "max_tokens": 0}, "max_tokens 0")):
            req = urllib.request.Request(cluster.endpoint + "/v1/completions",
                                         json.dumps(body).encode())
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=60)
            assert err.value.code == 400 and message in err.value.read().decode()


def test_killed_workers_fail_only_their_requests_and_restarted_ones_rejoin(model, tmp_path):
    config = ClusterConfig(num_prefill=2, num_decode=2, mechanism="GN-HAWK",
                           worker_args=["--max-batch-size", "8"])
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 1024, 6).tolist() for _ in range(4)]
    with LocalCluster(config, log_dir=tmp_path) as cluster:
        started = threading.Barrier(5, timeout=300)
        seen = set()
        lock = threading.Lock()

        def on_token(i, n):
            with lock:
                if i not in seen:
                    seen.add(i)
                    threading.Thread(target=started.wait, daemon=True).start()

        bodies = [{"prompt": p, "max_tokens": 300} for p in prompts]
        box = {}
        runner = threading.Thread(target=lambda: box.update(
            r=run_all(cluster.endpoint, bodies, on_token=on_token)))
        runner.start()
        started.wait()                                # every request is decoding
        before = {e["rid"]: e["status"] for e in cluster.get("/hawk/requests")}
        cluster.kill_worker("decode", 0)
        runner.join(timeout=600)
        log = {e["rid"]: e for e in cluster.get("/hawk/requests")}
        on_dead = [e for e in log.values() if e["decode_instance"] == 0]
        on_live = [e for e in log.values() if e["decode_instance"] == 1]
        assert on_dead and on_live, log
        for e in on_dead:          # in flight when killed: lost; finished just before: ok
            lost = e["status"] == "failed_instance_lost" and "decode worker 0 lost" in e["error"]
            done = e["status"] == "ok" and e["num_generated_tokens"] == 300
            assert lost or done, (e, before[e["rid"]])
        assert any(e["status"] == "failed_instance_lost" for e in on_dead), log
        assert all(e["status"] == "ok" and e["num_generated_tokens"] == 300 for e in on_live)
        errors = [r[1] for r in box["r"] if r[1]]
        assert len(errors) == sum(e["status"] != "ok" for e in on_dead)
        assert all("decode worker 0 lost" in e for e in errors)

        cluster.kill_worker("prefill", 1)
        cluster.wait_for(1, 1, exact=True)            # the router saw both go
        cluster.start_worker("decode")
        cluster.start_worker("prefill")
        cluster.wait_for(2, 2)                        # both rejoined under new indices
        again = run_all(cluster.endpoint, [{"prompt": p, "max_tokens": 5} for p in prompts])
        no_leaks(cluster)
    want = greedy_generate(model, prompts, [5] * 4, kv_quantize=quantize_kv("bfloat8_b"))
    assert [r[0] for r in again] == want


def test_a_missing_worker_dependency_names_its_extra_or_the_system_library(monkeypatch):
    import importlib
    import importlib.util

    from hardware.serve import cluster

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else object())
    with pytest.raises(cluster.ClusterError, match=r"the model needs torch \(pip install -e "
                                                   r"'\.\[torch\]'\)"):
        cluster.check_worker_dependencies()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())

    def no_verbs(name):
        raise ImportError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(importlib, "import_module", no_verbs)
    with pytest.raises(cluster.ClusterError, match="libibverbs .* scripts/install-rdma-packages"):
        cluster.check_worker_dependencies()
