"""Prefix caching (``sim.engine.prefix_cache``): LRU eviction and references on a hand example,
hit rates on a hand-computed trace, conservation and no held block at the end, nothing
changed when it is off, and a shared-prefix workload served faster with it on."""

import json

import numpy as np
import pytest
import simpy
from hypothesis import given, settings, strategies as st

from policies.batching import chunked_prefill
from sim.config import ConfigError, from_dict
from sim.engine.aggregated import AggregatedInstance
from sim.engine.cluster import simulate
from sim.engine.ledger import Ledger
from sim.engine.prefill import PrefillInstance
from sim.engine.prefix_cache import PrefixCache
from sim.engine.router import LazyArrivals
from tests.builders import make_config
from tests.test_aggregated import StepClock
from traces.loaders import load_trace
from traces.sessions import SessionSpec, session_trace, write_mooncake
from traces.trace import Trace


def hashed_trace(arrivals, prompts, outputs, hashes, block=512, name="hashed"):
    ids = np.empty(len(hashes), dtype=object)
    ids[:] = [tuple(h) for h in hashes]
    return Trace(np.asarray(arrivals, float), np.asarray(prompts), np.asarray(outputs),
                 np.arange(len(prompts)), name=name, hash_ids=ids, hash_block_size=block)


# -- the cache by hand ------------------------------------------------------------------------

def test_lru_eviction_order_and_references_by_hand():
    """3 blocks of 4 tokens. Freed blocks join the LRU list tail first, a hit takes a block
    off the list, a held block is never evicted and a block that cannot be had is not cached."""
    cache = PrefixCache([(1, 2), (1, 3), (4, 5), (1, 2)], block_tokens=4, capacity_blocks=3)
    assert cache.admit(0, 9) == 0
    assert cache.admit(1, 9) == 4                       # block 1 hit
    assert cache.ref_count == {1: 2, 2: 1, 3: 1}
    cache.release(0)
    assert cache.ref_count == {1: 1, 2: 0, 3: 1} and list(cache.free) == [2]
    assert cache.admit(2, 9) == 0                       # 4 evicts 2; 5 finds every block held
    assert cache.held[2] == [4] and cache.num_evictions == 1
    cache.release(1)                                    # reversed: 3 then 1 join the list
    cache.release(2)
    assert list(cache.free) == [3, 1, 4]
    assert cache.admit(3, 9) == 4                       # 1 hit (off the list); 2 evicts 3
    assert list(cache.free) == [4] and cache.ref_count == {1: 1, 4: 0, 2: 1}
    assert cache.num_evictions == 2
    cache.release(3)
    assert cache.leaks() == {} and list(cache.free) == [4, 2, 1]
    assert (cache.num_hit_tokens, cache.num_query_tokens) == (8, 36)


def test_a_fully_cached_prompt_recomputes_its_last_block():
    """vLLM looks for hits within the first num_tokens - 1 tokens: a prompt of exactly two
    cached blocks hits one, and a partial last block never hits."""
    cache = PrefixCache([(1, 2), (1, 2), (1, 2)], block_tokens=4, capacity_blocks=8)
    cache.admit(0, 8)
    assert cache.peek(1, 8) == 4 and cache.admit(1, 8) == 4
    assert cache.admit(2, 7) == 4                       # 2 is a partial block of 3 tokens


# -- hit rates of whole runs --------------------------------------------------------------------

#: r1 shares 2 blocks with r0, r2 one, r3 two but it is exactly 2 blocks long: one hits
HAND = dict(arrivals=[0.0, 100.0, 200.0, 300.0], prompts=[1200, 1100, 600, 1024],
            outputs=[4, 4, 4, 4], hashes=[(1, 2, 3), (1, 2, 4), (1, 5), (1, 2)])
HAND_HIT = (1024 + 512 + 512) / (1200 + 1100 + 600 + 1024)

AGGREGATED = {"cluster": {"kind": "aggregated", "model": "llama-3.1-8b",
                          "aggregated": {"device": "h100-sxm", "tp": 1,
                                         "prefix_caching": True}}}
DISAGGREGATED = {"cluster": {"model": "llama-3.1-8b", "prefill": {"prefix_caching": True}}}


@pytest.mark.parametrize("table", [AGGREGATED, DISAGGREGATED], ids=["aggregated", "pd"])
def test_hit_rate_of_a_hand_computed_trace(table):
    result = simulate(from_dict(table), trace=hashed_trace(**HAND))
    assert result.summary["prefix_cache_hit_rate"] == pytest.approx(HAND_HIT, abs=1e-12)
    assert result.summary["prefix_cache_hit_tokens"] == 2048
    assert (result.records["status"] == "ok").all()


def test_the_hit_rate_is_in_the_text_and_json_summaries(tmp_path, capsys):
    from sim.commands.main import main

    path = tmp_path / "hand.jsonl"
    write_mooncake(hashed_trace(**HAND), path)
    assert main(["simulate", "--trace", str(path), "--prefix-caching", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefix_cache_hit_rate"] == \
        pytest.approx(HAND_HIT)
    assert main(["simulate", "--trace", str(path), "--prefix-caching"]) == 0
    assert "prefix cache hit rate" in capsys.readouterr().out


# -- conservation and leaks --------------------------------------------------------------------

def _shared_trace(seed: int, n: int) -> Trace:
    """Random prompts over a few shared prefixes of 4-token blocks."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(np.cumsum(rng.exponential(0.5, n)))
    prompts = rng.integers(1, 40, n)
    stems = rng.integers(0, 3, n)
    hashes = [tuple(range(100 * s, 100 * s + (-(-int(p) // 4)))) for s, p in
              zip(stems, prompts)]
    return hashed_trace(arrivals, prompts, rng.integers(1, 30, n), hashes, block=4)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), blocks=st.integers(18, 40),
       cache_blocks=st.integers(0, 20))
def test_aggregated_conservation_and_no_block_held_at_the_end(seed, n, blocks, cache_blocks):
    trace = _shared_trace(seed, n)
    env, ledger = simpy.Environment(), Ledger(trace)
    inst = AggregatedInstance(env, 0, ledger, StepClock(0.05, 0.002, 1e-4), max_batch_size=4,
                              max_batch_tokens=16, num_blocks=blocks, block_size=4)
    inst.prefix = PrefixCache(trace.hash_ids.tolist(), 4, cache_blocks)
    LazyArrivals(ledger, inst, max_context=10_000)
    env.run()
    rec = ledger.frame()
    assert len(rec) == n and (rec["status"] == "ok").all()      # each ends once, ok
    assert inst.leaks() == {}                                   # prefix cache included
    assert inst.prefix.num_hit_tokens <= inst.prefix.num_query_tokens


class PerToken:
    def prefill_time(self, lens):
        return 0.001 * sum(lens)

    def mixed_step_time(self, chunks, contexts):
        return 0.001 * sum(n for n, _ in chunks)


def test_prefill_side_hands_on_each_request_once_and_releases_every_block():
    """A chunked prefill instance with a cache; the decode side pulls each request 0.5 s after
    its prefill. Every request is handed on once, and the cache holds nothing at the end."""
    trace = _shared_trace(3, 30)
    env, ledger, log = simpy.Environment(), Ledger(trace), []
    cache = PrefixCache(trace.hash_ids.tolist(), 4, 10)
    prefill = PrefillInstance(env, 0, ledger, PerToken(), max_batch_size=8,
                              max_batch_tokens=16, buffer_blocks=40, block_size=4,
                              on_prefilled=lambda i, source: (log.append(i), env.timeout(
                                  0.5).callbacks.append(lambda _: source.release(i))),
                              pick=chunked_prefill, prefix=cache)
    for i in range(ledger.n):
        prefill.enqueue(i)
    prefill.kick()
    env.run()
    assert sorted(log) == list(range(30))
    assert cache.leaks() == {} and prefill.free_blocks == 40
    assert cache.num_hit_tokens > 0


def test_a_prefix_caching_value_that_is_not_a_boolean_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"cluster.prefill.prefix_caching must be true or"):
        make_config(**{"cluster.prefill.prefix_caching": "yes"})


def test_the_decode_side_pulls_only_what_it_lacks():
    """Decode-side caching: the hand trace's hits are tokens not pulled; r0 pulls all."""
    off = from_dict(DISAGGREGATED)
    on = off.replace(**{"cluster.decode.prefix_caching": True})
    both = simulate(on, trace=hashed_trace(**HAND))
    prefill_only = simulate(off, trace=hashed_trace(**HAND))
    assert both.summary["decode_prefix_cache_hit_tokens"] == 2048
    assert "decode_prefix_cache_hit_rate" not in prefill_only.summary
    pulled = both.records["kv_bytes"].to_numpy()
    whole = prefill_only.records["kv_bytes"].to_numpy()
    assert pulled[0] == whole[0] and (pulled[1:] < whole[1:]).all()


@pytest.mark.parametrize("faults", [{}, {"faults.transfer_failure_prob": 0.3,
                                         "faults.max_retries": 1},
                                    {"faults.instance_loss": [[0, 40.0]]}],
                         ids=["plain", "failed-transfers", "instance-loss"])
def test_decode_side_caching_keeps_every_invariant_and_holds_nothing_at_the_end(faults):
    """A decode instance short of blocks (it preempts), with failed transfers or not: every
    request ends once and its prefix cache holds no block at the end."""
    from tests.builders import checked_simulate

    trace = session_trace(SessionSpec(num_sessions=60, rate=2.0), seed=7)
    config = make_config(**{"cluster.decode.max_batch_size": 32,
                            "cluster.decode.max_num_blocks": 200,
                            "cluster.decode.prefix_caching": True,
                            "cluster.prefill.prefix_caching": True, **faults})
    result = checked_simulate(config, trace)             # end check includes the cache
    assert len(result.records) == len(trace)
    assert result.summary["decode_prefix_cache_hit_tokens"] > 0
    if not faults:
        assert result.stats["decode_preemptions"][0] > 0


# -- off changes nothing; on serves shared prefixes faster --------------------------------------

def _records_csv(config, trace) -> str:
    return simulate(config, trace=trace).records.to_csv(index=False)


@pytest.mark.parametrize("table", [AGGREGATED, DISAGGREGATED], ids=["aggregated", "pd"])
def test_off_or_without_hashes_the_records_are_the_same_bytes(table):
    """Off, a trace's hashes change nothing; on, a trace without hashes changes nothing either
    (the prefill instance then takes its general path, priced by mixed_step_time)."""
    with_hashes = session_trace(SessionSpec(num_sessions=30, rate=0.2), seed=5)
    without = Trace(with_hashes.arrival_at, with_hashes.num_prompt_tokens,
                    with_hashes.num_output_tokens, with_hashes.request_id)
    role = "aggregated" if "aggregated" in table["cluster"] else "prefill"
    on = from_dict(table)
    off = on.replace(**{f"cluster.{role}.prefix_caching": False})
    reference = _records_csv(off, without)
    assert _records_csv(off, with_hashes) == reference
    assert _records_csv(on, without) == reference
    assert _records_csv(on, with_hashes) != reference


@pytest.mark.parametrize("table", [AGGREGATED, DISAGGREGATED], ids=["aggregated", "pd"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shared_prefix_workload_has_a_lower_ttft_with_caching_on(table, seed):
    trace = session_trace(SessionSpec(num_sessions=60, rate=1.0), seed=seed)
    role = "aggregated" if "aggregated" in table["cluster"] else "prefill"
    on = from_dict(table)
    off = on.replace(**{f"cluster.{role}.prefix_caching": False})
    ttft_on = simulate(on, trace=trace).records.eval("first_token_at - arrival_at").mean()
    ttft_off = simulate(off, trace=trace).records.eval("first_token_at - arrival_at").mean()
    assert ttft_on < ttft_off


# -- the traces ---------------------------------------------------------------------------------

def test_sessions_share_system_prompts_and_earlier_turns_deterministically():
    spec = SessionSpec(num_sessions=20, hash_block_size=16)
    a, b = session_trace(spec, seed=4), session_trace(spec, seed=4)
    assert list(a.hash_ids) == list(b.hash_ids)
    assert list(session_trace(spec, seed=5).hash_ids) != list(a.hash_ids)
    blocks = -(-a.num_prompt_tokens // 16)
    assert [len(h) for h in a.hash_ids] == blocks.tolist()
    system_blocks = 1024 // 16
    firsts = {h[:system_blocks] for h in a.hash_ids}
    assert len(firsts) <= spec.num_system_prompts      # every prompt starts with one of them
    seen = set()                                       # a later turn extends an earlier one
    extended = 0
    for h in a.hash_ids:
        extended += any(h[:k] in seen for k in range(system_blocks + 1, len(h)))
        seen.update(h[:k] for k in range(1, len(h) + 1))
    assert extended > 0


def test_a_written_session_trace_loads_back_with_its_hashes(tmp_path):
    trace = session_trace(SessionSpec(num_sessions=10), seed=2)
    write_mooncake(trace, tmp_path / "s.jsonl")
    loaded, report = load_trace(tmp_path / "s.jsonl")
    assert list(loaded.hash_ids) == list(trace.hash_ids) and loaded.hash_block_size == 512
    assert any("hash_ids carried" in note for note in report.notes)


def test_the_bundled_mooncake_trace_loads_by_name_with_its_hashes():
    trace, report = load_trace("mooncake-conversation")
    assert report.format == "mooncake" and len(trace) == 1000
    blocks = -(-trace.num_prompt_tokens // 512)
    assert [len(h) for h in trace.hash_ids] == blocks.tolist()
    head = trace.head(10).select(slice(2, 5))          # selections keep their rows' hashes
    assert head.hash_ids[0] == trace.hash_ids[2]


def test_replayed_prompts_share_exactly_the_blocks_their_hashes_share():
    from traces.prompts import PromptMaker, PromptSpec

    maker = PromptMaker(PromptSpec(kind="token_ids"), 100)
    a = maker.prompt(0, 10, (7, 8, 9), 4)
    b = maker.prompt(1, 11, (7, 8, 5), 4)
    c = maker.prompt(2, 6, (6, 8), 4)
    assert len(a) == 10 and len(b) == 11 and len(c) == 6
    assert a[:8] == b[:8] and a[8:] != b[8:10]
    assert c[:4] != a[:4] and c[4:] == a[4:6]       # the same hash, the same tokens
    assert maker.prompt(0, 10) != a                  # without hashes: the distinct prompt


def test_a_run_of_cells_reports_the_hit_rate_over_its_cells():
    """Per-cell instances: each cell's cache sees its share of the requests; the run's hit
    rate is their hit tokens over their prompt tokens, summed."""
    from sim.runs.cells.run import simulate_cells

    trace = session_trace(SessionSpec(num_sessions=30, rate=0.5), seed=3)
    config = from_dict({**DISAGGREGATED, "cells": {"count": 2, "instances": "per-cell"}})
    result = simulate_cells(config, trace, workers=1)
    summary = result.summary
    assert summary["prefix_cache_query_tokens"] == int(trace.num_prompt_tokens.sum())
    assert 0 < summary["prefix_cache_hit_tokens"] < summary["prefix_cache_query_tokens"]
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        summary["prefix_cache_hit_tokens"] / summary["prefix_cache_query_tokens"])


def test_the_engine_counters_are_read_from_prometheus_text():
    from sim.validation.prefix import parse_counters

    text = ('# HELP vllm:prefix_cache_hits_total x\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 17275.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 13440.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0\n')
    assert parse_counters(text) == {"vllm:prefix_cache_queries_total": 17275.0,
                                    "vllm:prefix_cache_hits_total": 13450.0,
                                    "vllm:prompt_tokens_total": 0.0}


def test_a_streamed_run_with_prefix_caching_is_refused_by_name(tmp_path):
    from sim.engine.stream import Stream

    config = from_dict(DISAGGREGATED)
    with pytest.raises(ConfigError, match=r"prefix_caching: a streamed run"):
        simulate(config, stream=Stream(tmp_path / "records.parquet"))


def test_hash_ids_that_are_not_integers_are_refused_naming_the_row():
    with pytest.raises(ValueError, match=r"row 1: hash_ids must be a list of integers"):
        hashed_trace([0.0, 1.0], [10, 10], [1, 1], [(1,), ("x",)])
