"""Prefix caching against a live engine: the same shared-prefix trace replayed and simulated.

``measure(endpoint, trace)`` replays ``trace`` (``traces.replay``; a trace with prefix hashes
sends prompts that share exactly the blocks its hashes share) and reads the engine's
prefix-cache counters from its Prometheus ``/metrics`` before and after: vLLM V1's
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (prompt tokens looked up and
found cached), whose ratio is the hit rate. ``predict(profile, trace)`` runs the simulator on
a measured profile of that engine (``hawk profile --endpoint``, taken with its prefix cache
off) with prefix caching off and on. ``simulate_hit_rate(trace, num_blocks)`` needs no
profile: the simulator's counters with a cache of the engine's own size
(``engine_cache_blocks``: vLLM keeps one block of its pool back). The trace's hash blocks must
be the engine's KV block size, so that a hit means the same tokens to both.
``with_unshared_twins`` adds to a trace, beside each request, one of the same lengths whose
prompt shares nothing, so that one replay measures the TTFT effect of the cache under the same
load (``paired_ttft``).

    python -m sim.validation.prefix --endpoint http://127.0.0.1:8011 --profile P --block 32

Restart the engine between an ``--off`` run (its prefix cache disabled) and an on run: the
TTFT effect is the pair's difference. docs/vllm.md has the recipe and what it measured.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request

import numpy as np

from traces.sessions import SessionSpec, session_trace
from traces.trace import Trace

#: the counters read from ``/metrics`` (vLLM V1's names; Prometheus adds ``_total``)
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total")
#: blocks of an engine's pool that never hold KV: vLLM V1 takes one as its null block
#: (``vllm/v1/core/block_pool.py``, ``BlockPool.__init__``: ``self.null_block =
#: self.free_block_queue.popleft()``), so ``--num-gpu-blocks-override N`` caches N - 1
NULL_BLOCKS = 1


def engine_cache_blocks(num_gpu_blocks: int) -> int:
    """The blocks an engine of ``num_gpu_blocks`` (its ``num_gpu_blocks``) can cache."""
    if num_gpu_blocks <= NULL_BLOCKS:
        raise ValueError(f"num_gpu_blocks must exceed {NULL_BLOCKS}, got {num_gpu_blocks}")
    return num_gpu_blocks - NULL_BLOCKS


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


def measure(endpoint: str, trace, vocab: tuple[int, int], seed: int = 0,
            keep_records: bool = False) -> dict:
    """Replay ``trace`` as token-id prompts in [vocab) and read the counters around it.
    ``seed`` seeds the prompts: replays with different seeds share no token sequence, so a
    later one finds nothing an earlier one cached. ``keep_records``: the replay's records
    under ``"records"`` too."""
    from traces.prompts import PromptSpec
    from traces.replay import ReplayConfig, replay

    def counters():
        with urllib.request.urlopen(endpoint.rstrip("/") + "/metrics", timeout=10) as r:
            return parse_counters(r.read().decode())

    before = counters()
    result = replay(trace, ReplayConfig(endpoint, prompt=PromptSpec(
        kind="token_ids", seed=seed, token_id_low=vocab[0], token_id_high=vocab[1])))
    delta = {k: v - before[k] for k, v in counters().items()}
    queries, hits = delta["vllm:prefix_cache_queries_total"], delta["vllm:prefix_cache_hits_total"]
    out = {**ttft_summary(result.records), "counters": delta,
           "hit_rate": hits / queries if queries else None}
    return {**out, "records": result.records} if keep_records else out


def simulate_hit_rate(trace, num_blocks: int | None = None, model: str | None = None) -> dict:
    """The simulator's prefix-cache counters and records for ``trace`` on one aggregated
    instance whose KV pool (and so its cache) holds ``num_blocks`` blocks of the trace's hash
    block (None: what the default device's memory holds, some 10^4 blocks or more: unbounded
    for these traces); ``model`` a catalog model (None: the default).

    No profile: the timing is the roofline's of ``model`` on the default device. A hit depends on what
    is cached when a request is scheduled, so on the order requests come in and the cache
    size; the timing enters only through which requests run at once (their blocks are held,
    not evictable), and requests that arrive seconds apart rarely do on either side."""
    from sim.config import RunConfig
    from sim.engine.cluster import simulate

    changes = {"cluster.kind": "aggregated", "cluster.aggregated.prefix_caching": True,
               "cluster.aggregated.block_size": trace.hash_block_size}
    if num_blocks is not None:
        changes["cluster.aggregated.max_num_blocks"] = num_blocks
    if model is not None:
        changes["cluster.model"] = model
    result = simulate(RunConfig().replace(**changes), trace=trace)
    s = result.summary
    return {"hit_rate": s["prefix_cache_hit_rate"], "hit_tokens": s["prefix_cache_hit_tokens"],
            "query_tokens": s["prefix_cache_query_tokens"],
            "evictions": s["prefix_cache_evictions"], "records": result.records}


def with_unshared_twins(trace, delay_s: float) -> tuple[Trace, np.ndarray]:
    """``trace`` and, ``delay_s`` after each request, its twin: the same prompt and output
    lengths, hashes no other request has (a prompt that shares nothing). Returns the merged
    trace (ids 0..2n-1 in arrival order) and, per id, the id of its twin's original (-1 for
    an original)."""
    if trace.hash_ids is None:
        raise ValueError(f"trace {trace.name!r} has no prefix hashes to pair")
    if not delay_s >= 0:
        raise ValueError(f"twin delay must be >= 0 s, got {delay_s}")
    fresh = 1 + max((max(h) for h in trace.hash_ids if h), default=-1)
    rows = []                       # (arrival, is twin, original index, hashes)
    for i, hashes in enumerate(trace.hash_ids):
        rows.append((float(trace.arrival_at[i]), 0, i, tuple(hashes)))
        rows.append((float(trace.arrival_at[i]) + delay_s, 1, i,
                     tuple(range(fresh, fresh + len(hashes)))))
        fresh += len(hashes)
    rows.sort(key=lambda r: r[:3])
    ids = {(r[1], r[2]): k for k, r in enumerate(rows)}
    original = np.array([ids[(0, r[2])] if r[1] else -1 for r in rows], dtype=np.int64)
    index = [r[2] for r in rows]
    hashes = np.empty(len(rows), dtype=object)
    hashes[:] = [r[3] for r in rows]
    merged = Trace(np.array([r[0] for r in rows]), trace.num_prompt_tokens[index],
                   trace.num_output_tokens[index], np.arange(len(rows)),
                   name=f"{trace.name}+twins", hash_ids=hashes,
                   hash_block_size=trace.hash_block_size)
    return merged, original


def paired_ttft(records, original: np.ndarray) -> dict:
    """TTFT of the originals and of their unshared twins (``with_unshared_twins``): each
    side's mean, and the mean and median of (original - twin) over the pairs."""
    ttft = (records["first_token_at"] - records["arrival_at"]).to_numpy()
    by_id = dict(zip(records["request_id"].to_numpy().tolist(), ttft))
    twins = np.flatnonzero(original >= 0)
    shared = np.array([by_id[int(original[t])] for t in twins])
    alone = np.array([by_id[int(t)] for t in twins])
    diff = shared - alone
    ok = np.isfinite(diff)
    return {"shared_ttft_mean_s": float(np.nanmean(shared)),
            "twin_ttft_mean_s": float(np.nanmean(alone)),
            "diff_mean_s": float(diff[ok].mean()), "diff_median_s": float(np.median(diff[ok])),
            "num_pairs": int(ok.sum())}


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
    p.add_argument("--blocks", type=int, help="the engine's KV blocks (--num-gpu-blocks-override):"
                   " the simulator's hit rate with a cache of that engine's size too")
    p.add_argument("--vocab", default="3:1024", metavar="LOW:HIGH",
                   help="token ids the prompts draw from (the tiny Llama's: 3:1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the session trace")
    args = p.parse_args(argv)
    try:
        low, _, high = args.vocab.partition(":")
        vocab = (int(low), int(high))
    except ValueError:
        p.error(f"--vocab takes LOW:HIGH, got {args.vocab!r}")
    try:
        trace = session_trace(small_sessions(args.block), seed=args.seed)
        sizes = {"unbounded": None}
        if args.blocks is not None:
            sizes[f"{args.blocks} blocks"] = engine_cache_blocks(args.blocks)
        rates = {k: simulate_hit_rate(trace, n)["hit_rate"] for k, n in sizes.items()}
    except ValueError as exc:           # sim.config.ConfigError is one
        p.error(str(exc))
    out = {"num_requests": len(trace), "prompt_tokens": int(trace.num_prompt_tokens.sum()),
           "simulator_hit_rate": rates}
    if args.endpoint:
        out["engine"] = measure(args.endpoint, trace, vocab)
    if args.profile:
        out["simulator"] = predict(args.profile, trace)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
