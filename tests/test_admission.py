"""Decode KV admission: the policies as pure functions, on-demand blocks in the simulator."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sim.engine.cluster
from hardware.kv_layout import blocks_for
from policies.admission import (ADMISSION, DEFAULT_ADMISSION, pick_victim, reserve_tokens,
                                steps_until_full)
from sim.engine.cluster import simulate
from sim.config import ConfigError, RunConfig
from sim.engine.memory import BlockPool, GrowingKV
from sim.models.table import TablePredictor
from traces.schema import write_records
from tests.builders import FreeTransfer, make_config, random_trace

GOLDEN = Path(__file__).parent / "data" / "oracle_reserve_records.csv"


def table_run(tmp_path=None, trace_seed=11, num_requests=300, rate=4.0, **changes):
    """A small cluster timed by a table (independent of the roofline profile)."""
    config = make_config(**{"cluster.decode.max_batch_size": 8,
                            "cluster.decode.max_num_blocks": 300,
                            "cluster.link.bandwidth_gb_s": 50.0, **changes})
    table = TablePredictor([1, 4096], [0.02, 0.4], [1, 64], [0, 200_000],
                           [[0.02, 0.03], [0.05, 0.08]])
    trace = random_trace(np.random.default_rng(trace_seed), num_requests, rate,
                         max_prompt=2000, max_output=300)
    return simulate(config, trace, predictors=(table, table), pricing=FreeTransfer())


# -- the policies ----------------------------------------------------------------------
def brute_steps_until_full(contexts, free, block, max_steps):
    held = sum(blocks_for(c, block) for c in contexts)
    for k in range(max_steps):
        if sum(blocks_for(c + k, block) for c in contexts) - held > free:
            return k
    return max_steps


@settings(max_examples=200, deadline=None)
@given(contexts=st.lists(st.integers(1, 300), max_size=12), free=st.integers(0, 40),
       block=st.sampled_from([1, 4, 16, 32]), max_steps=st.integers(1, 400))
def test_steps_until_full_matches_stepping(contexts, free, block, max_steps):
    assert steps_until_full(np.array(contexts, dtype=np.int64), free, block, max_steps) == \
        brute_steps_until_full(contexts, free, block, max_steps)


def test_reservations_per_policy():
    prompt, output, context, longest = 100, 50, 101, 4096
    assert reserve_tokens(ADMISSION["oracle-reserve"], prompt, output, context, longest) == 150
    assert reserve_tokens(ADMISSION["reserve-max"], prompt, output, context, longest) == 4096
    for name in ("on-demand-recompute", "on-demand-swap"):
        assert reserve_tokens(ADMISSION[name], prompt, output, context, longest) == 101
    assert pick_victim({5: 0, 2: 0, 9: 0}) == 9          # the most recently admitted


@settings(max_examples=150, deadline=None)
@given(joins=st.lists(st.tuples(st.integers(1, 500), st.integers(0, 40)), min_size=1,
                      max_size=10),
       spare=st.integers(0, 30), steps=st.integers(1, 200), block=st.sampled_from([1, 16, 32]))
def test_growing_kv_matches_the_exact_sums(joins, spare, steps, block):
    """Requests join at different steps with the context they land with; the closed forms
    (upper bound, exact growth by residues, steps that fit) match summing block by block."""
    joins = sorted(joins, key=lambda j: j[1])          # joins come in step order
    t = joins[-1][1]
    pool = BlockPool(100_000, block)
    kv = GrowingKV(pool)
    for i, (context, at) in enumerate(joins):
        assert pool.try_reserve(i, context, 0) == "ok"
        kv.join(i, context - at, at)
    pool.free_blocks = spare                            # what is left for growth
    contexts = [c + t - at for c, at in joins]          # in step t
    held = [blocks_for(c, block) for c, _ in joins]
    for k in range(-t, steps, 5):
        exact = sum(max(0, blocks_for(c + t + k - at, block) - h)
                    for (c, at), h in zip(joins, held))
        assert kv.growth(t + k) == exact <= kv.growth_upper(max(t + k, t))
        if k >= 0:                                      # the bound holds from the newest join
            assert kv.short(t + k) == (exact > spare)
    base = sum(blocks_for(c, block) - h for c, h in zip(contexts, held))
    assert kv.steps_fitting(t, steps) == (
        0 if base > spare else brute_steps_until_full(contexts, spare - base, block, steps))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["join", "leave", "ask"]), st.integers(1, 300),
                              st.integers(0, 3)), min_size=1, max_size=40),
       block=st.sampled_from([1, 16, 32]))
def test_growing_kv_growth_stays_exact_through_joins_and_leaves(ops, block):
    """The growth remembered for the last step asked stays exact as requests join in that
    step or another, and leave (most recent first or not)."""
    pool = BlockPool(100_000, block)
    kv, t, running, joined = GrowingKV(pool), 0, {}, 0
    for op, context, dt in ops:
        if op == "join":
            t += dt                                     # joins come in step order
            pool.try_reserve(joined, context, 0)
            kv.join(joined, context - t, t)
            running[joined] = (context, t)
            joined += 1
        elif op == "leave" and running:
            i = list(running)[context % len(running)]
            kv.leave(i)
            del running[i]
            pool.release(i)
        ask = t + dt - 1
        exact = sum(max(0, blocks_for(c + ask - at, block) - blocks_for(c, block))
                    for c, at in running.values())
        assert kv.growth(ask) == exact


# -- configuration ---------------------------------------------------------------------
def test_default_admission_is_on_demand_and_names_are_checked():
    assert RunConfig().cluster.decode.admission == DEFAULT_ADMISSION == "on-demand-recompute"
    assert RunConfig().cluster.prefill.admission is None
    with pytest.raises(ConfigError, match=r"cluster.decode.admission must be one of .*"
                                          r"oracle-reserve"):
        make_config(**{"cluster.decode.admission": "oracle"})
    with pytest.raises(ConfigError, match="cluster.prefill.admission: KV admission is a decode"):
        make_config(**{"cluster.prefill.admission": "oracle-reserve"})


# -- in the simulator ------------------------------------------------------------------
def test_oracle_reserve_reproduces_the_records_of_up_front_reservation(tmp_path):
    """The committed records were written by the simulator before admission policies
    existed (it reserved prompt + true output), under whole-prompt prefill batches of up to
    8,192 tokens (the default then); the named policy gives the same bytes."""
    out = write_records(table_run(**{"cluster.decode.admission": "oracle-reserve",
                                     "cluster.policies.prefill_batching": "fcfs",
                                     "cluster.prefill.max_batch_tokens": 8192}).records,
                        tmp_path / "records.csv")
    assert out.read_bytes() == GOLDEN.read_bytes()


@pytest.mark.parametrize("admission", ["on-demand-recompute", "on-demand-swap"])
def test_on_demand_preempts_under_pressure_and_loses_nothing(admission):
    result = table_run(**{"cluster.decode.admission": admission,
                          "cluster.decode.max_num_blocks": 150})
    records = result.records
    assert (records["status"] == "ok").all()
    assert (records["num_generated_tokens"] == records["num_output_tokens"]).all()
    assert result.stats["decode_preemptions"][0] > 0
    memory = result.stats["decode_memory"][0]
    assert memory["occupancy"] == 0 and memory["num_requests"] == 0      # every block back


def test_on_demand_holds_more_requests_at_once_than_reserving_the_true_output():
    """Same trace and pool: reserving only what is used lets more KV caches in."""
    def peak_concurrency(records):
        start, end = records["transfer_start_at"].to_numpy(), records["finished_at"].to_numpy()
        events = sorted([(t, 1) for t in start] + [(t, -1) for t in end])
        return max(np.cumsum([d for _, d in events]))

    oracle = table_run(**{"cluster.decode.admission": "oracle-reserve",
                          "cluster.decode.max_batch_size": 64}).records
    on_demand = table_run(**{"cluster.decode.admission": "on-demand-recompute",
                             "cluster.decode.max_batch_size": 64}).records
    assert peak_concurrency(on_demand) > peak_concurrency(oracle)


def test_reserve_max_holds_one_request_when_the_pool_holds_one_longest_context():
    records = table_run(num_requests=40, **{"cluster.decode.admission": "reserve-max",
                                            "cluster.decode.max_num_blocks": 128}).records
    assert (records["status"] == "ok").all()
    spans = records.sort_values("transfer_start_at")[["transfer_start_at", "finished_at"]]
    starts, ends = spans.to_numpy().T
    assert (starts[1:] >= ends[:-1]).all()                     # one KV cache at a time


@pytest.mark.parametrize("admission,calls_per_preemption", [("on-demand-recompute", 1),
                                                           ("on-demand-swap", 2)])
def test_restoring_a_preempted_request_prices_its_context(monkeypatch, admission,
                                                          calls_per_preemption):
    """Recompute: one prefill-like pass over the tokens it had, less the newest (its KV is
    computed by the next decode step), priced once per context (the instance memoises it).
    Swap: the whole context out, then back in."""
    calls = []
    make = sim.engine.cluster.restore_time

    def spy(config, predictor):
        seconds = make(config, predictor)
        return lambda tokens, how: calls.append((tokens, how)) or seconds(tokens, how)

    monkeypatch.setattr(sim.engine.cluster, "restore_time", spy)
    result = table_run(**{"cluster.decode.admission": admission,
                          "cluster.decode.max_num_blocks": 150})
    preemptions = result.stats["decode_preemptions"][0]
    how = admission.rsplit("-", 1)[1]
    if how == "swap":
        assert preemptions > 0 and len(calls) == calls_per_preemption * preemptions
    else:                                # every restore's context, each priced once
        assert 0 < len(calls) == len(set(calls)) <= calls_per_preemption * preemptions
    assert {h for _, h in calls} == {how}
    prompts = set(result.records["num_prompt_tokens"])
    if how == "recompute":               # tokens = prompt + generated - 1 >= prompt
        assert all(t >= min(prompts) for t, _ in calls)


def test_a_single_staging_buffer_reserves_prompt_and_output_under_every_policy():
    """GN-Direct lays each request out whole when it lands: on-demand admission there is the
    up-front reservation, record for record."""
    runs = [table_run(num_requests=120, **{"cluster.link.mechanism": "GN-Direct",
                                            "cluster.decode.admission": name}).records
            for name in ("on-demand-recompute", "oracle-reserve")]
    assert runs[0].equals(runs[1])
