"""Prefix caching against a live engine: the same shared-prefix trace replayed and simulated.

``measure(endpoint, trace)`` replays ``trace`` (``traces.replay``; a trace with prefix hashes
sends prompts that share exactly the blocks its hashes share) and reads the engine's
prefix-cache counters from its Prometheus ``/metrics`` before and after: vLLM V1's
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (prompt tokens looked up and
found cached), whose ratio is the hit rate. ``predict(profile, trace)`` runs the simulator on
a measured profile of that engine (``hawk profile --endpoint``, taken with its prefix cache
off) with prefix caching off and on. The trace's hash blocks must be the engine's KV block
size, so that a hit means the same tokens to both.

    python -m sim.validation.prefix --endpoint http://127.0.0.1:8011 --profile P --block 32

Restart the engine between an ``--off`` run (its prefix cache disabled) and an on run: the
TTFT effect is the pair's difference. docs/vllm.md has the recipe and what it measured.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request

from traces.sessions import SessionSpec, session_trace

#: the counters read from ``/metrics`` (vLLM V1's names; Prometheus adds ``_total``)
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total")


def small_sessions(block: int) -> SessionSpec:
    """Sessions that fit a 512-token context: two 192-token system prompts, about three
    turns of 32-token messages and 16-token answers (illustrative, not fitted)."""
    return SessionSpec(num_sessions=24, rate=0.4, num_system_prompts=2,
                       system_prompt_tokens=192, mean_turns=3.0, user_tokens=32.0,
                       output_tokens=16.0, think_time_s=5.0, max_tokens=500,
                       hash_block_size=block)


def parse_counters(text: str) -> dict[str, float]:
    """``COUNTERS`` from Prometheus text, each summed over its label sets (0 if absent)."""
    out = {}
    for name in COUNTERS:
        pattern = re.escape(name) + r"(?:\{[^}]*\})? ([0-9.eE+-]+)$"
        out[name] = sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
    return out


def ttft_summary(records) -> dict:
    ttft = records["first_token_at"] - records["arrival_at"]
    return {"ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(ttft.median()),
            "ttft_p90_s": float(ttft.quantile(0.9)),
            "num_ok": int((records["status"] == "ok").sum())}


def measure(endpoint: str, trace, vocab: tuple[int, int]) -> dict:
    """Replay ``trace`` as token-id prompts in [vocab) and read the counters around it."""
    from traces.prompts import PromptSpec
    from traces.replay import ReplayConfig, replay

    def counters():
        with urllib.request.urlopen(endpoint.rstrip("/") + "/metrics", timeout=10) as r:
            return parse_counters(r.read().decode())

    before = counters()
    result = replay(trace, ReplayConfig(endpoint, prompt=PromptSpec(
        kind="token_ids", token_id_low=vocab[0], token_id_high=vocab[1])))
    delta = {k: v - before[k] for k, v in counters().items()}
    queries, hits = delta["vllm:prefix_cache_queries_total"], delta["vllm:prefix_cache_hits_total"]
    return {**ttft_summary(result.records), "counters": delta,
            "hit_rate": hits / queries if queries else None}


def predict(profile: str, trace) -> dict:
    """The simulator on the measured profile, prefix caching off and on."""
    from sim.config import RunConfig
    from sim.engine.cluster import simulate

    out = {}
    for on in (False, True):
        config = RunConfig().replace(**{"cluster.profile": profile,
                                        "cluster.aggregated.prefix_caching": on})
        result = simulate(config, trace=trace)
        out["on" if on else "off"] = {**ttft_summary(result.records), "hit_rate": (
            result.summary.get("prefix_cache_hit_rate"))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.validation.prefix",
                                description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", help="the engine's base URL (omit: only the simulator)")
    p.add_argument("--profile", help="a measured profile of the engine (omit: no prediction)")
    p.add_argument("--block", type=int, default=32, help="the engine's KV block size, tokens")
    p.add_argument("--vocab", default="3:1024", metavar="LOW:HIGH",
                   help="token ids the prompts draw from (the tiny Llama's: 3:1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the session trace")
    args = p.parse_args(argv)
    low, _, high = args.vocab.partition(":")
    trace = session_trace(small_sessions(args.block), seed=args.seed)
    out = {"num_requests": len(trace), "prompt_tokens": int(trace.num_prompt_tokens.sum())}
    if args.endpoint:
        out["engine"] = measure(args.endpoint, trace, (int(low), int(high)))
    if args.profile:
        out["simulator"] = predict(args.profile, trace)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
