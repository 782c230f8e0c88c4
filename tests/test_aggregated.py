"""The aggregated instance (``sim.engine.aggregated``): its schedule step by step against
hand-computed ones, fast-forward against the step-by-step oracle, conservation under
preemption and instance loss."""

import math

import numpy as np
import pytest
import simpy
from hypothesis import given, settings, strategies as st

from sim.config import from_dict
from sim.engine.aggregated import AggregatedInstance
from sim.engine.cluster import simulate
from sim.engine.ledger import Ledger
from sim.engine.router import LazyArrivals, PoolRouter
from sim.models.predictor import Predictor
from policies.routing import least_work
from tests.builders import make_trace

INSTANTS = ["prefill_start_at", "prefill_end_at", "first_token_at", "finished_at"]


class StepClock(Predictor):
    """A step costs ``base`` + ``per_token`` per prompt token + ``per_context`` per token of
    decode context (a decode-only step is ``decode_step_time``'s line, as the interface asks)."""

    def __init__(self, base=1.0, per_token=0.1, per_context=0.0):
        self.base, self.per_token, self.per_context = base, per_token, per_context

    def decode_step_times(self, batch, contexts):
        return self.base + self.per_context * np.asarray(contexts, dtype=np.float64)

    def mixed_step_time(self, chunks, contexts):
        if not chunks:
            return self.decode_step_time(len(contexts), int(sum(contexts)))
        return (self.base + self.per_token * sum(n for n, _ in chunks)
                + self.per_context * sum(contexts))


def make_instance(trace, *, tokens=8, seqs=2, blocks=6, block_size=4, fast_forward=False,
                  predictor=None):
    env = simpy.Environment()
    ledger = Ledger(trace)
    inst = AggregatedInstance(env, 0, ledger, predictor or StepClock(), max_batch_size=seqs,
                              max_batch_tokens=tokens, num_blocks=blocks,
                              block_size=block_size, fast_forward=fast_forward)
    inst.log = []
    LazyArrivals(ledger, inst, max_context=10_000)
    env.run()
    return inst, ledger.frame()


def test_decodes_first_then_chunks_within_the_token_budget_and_max_num_seqs():
    """Budget 8 tokens, 2 sequences, 6 blocks of 4 tokens. Steps cost 1 s + 0.1 s per prompt
    token. r0 (10 tokens) is cut into 8 + 2; r1 joins beside r0's last chunk; r2 waits for a
    sequence slot until r1 ends, then its prompt rides beside r0's last decode."""
    trace = make_trace([0.0, 0.0, 0.5], [10, 3, 2], [3, 2, 4])
    inst, rec = make_instance(trace)
    assert inst.log == [
        (0.0, 1.8, (), ((0, 8, 0),), 1),                 # r0's first chunk fills the budget
        (1.8, 3.3, (), ((0, 2, 8), (1, 3, 0)), 1),       # r0 continues first; r1 (2 seqs)
        (3.3, 4.3, (0, 1), (), 1),                       # decodes; r2 waits: 2 running
        (4.3, 5.5, (0,), ((2, 2, 0),), 1),               # r1 ended: r2 joins r0's decode
        (5.5, 6.5, (2,), (), 1),
        (6.5, 7.5, (2,), (), 1),
        (7.5, 8.5, (2,), (), 1),
    ]
    assert rec["prefill_start_at"].tolist() == [0.0, 1.8, 4.3]
    assert rec["first_token_at"].tolist() == [3.3, 3.3, 5.5]
    assert rec["finished_at"].tolist() == [5.5, 4.3, 8.5]
    assert (rec["status"] == "ok").all() and inst.leaks() == {}


def test_the_newest_request_is_preempted_and_recomputes_its_prompt_and_output():
    """4 blocks of 2 tokens. r0 and r1 (3-token prompts) take 2 blocks each; at the third
    step r0 needs a third block: r1, the newest, is preempted, and r0 runs alone (no new
    request joins a step that preempted). r1 waits until r0 ends, then prefills its prompt
    and its 2 generated tokens again (5 tokens, 3 blocks), which samples its last token."""
    trace = make_trace([0.0, 0.0], [3, 3], [4, 3])
    inst, rec = make_instance(trace, tokens=8, seqs=4, blocks=4, block_size=2)
    assert inst.log == [
        (0.0, 1.6, (), ((0, 3, 0), (1, 3, 0)), 1),
        (1.6, 2.6, (0, 1), (), 1),
        (2.6, 3.6, (0,), (), 1),                 # r1 preempted at 2.6
        (3.6, 4.6, (0,), (), 1),                 # r1's 5 tokens need 3 blocks, 1 is free
        (4.6, 6.1, (), ((1, 5, 0),), 1),         # recompute: 1 s + 0.5 s
    ]
    assert inst.num_preemptions == 1
    assert rec["first_token_at"].tolist() == [1.6, 1.6]     # the first time counts
    assert rec["finished_at"].tolist() == [4.6, 6.1]
    assert inst.leaks() == {}


def test_fast_forward_takes_a_decode_stretch_as_one_run():
    trace = make_trace([0.0, 0.0, 0.5], [10, 3, 2], [3, 2, 4])
    slow, rec_slow = make_instance(trace)
    fast, rec_fast = make_instance(trace, fast_forward=True)
    assert fast.log[-1] == (5.5, 8.5, (2,), (), 3)   # r2's three decodes: one timer
    assert fast.num_wakeups < slow.num_wakeups
    for name in INSTANTS:
        np.testing.assert_allclose(rec_fast[name], rec_slow[name], rtol=0, atol=1e-12)


def _random_trace(seed, n):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.7, n))
    arrivals[rng.random(n) < 0.2] = 0.0          # some arrive together
    return make_trace(np.sort(arrivals), rng.integers(1, 40, n), rng.integers(1, 30, n))


def _oracle_pair(trace, num_instances, **sizes):
    out = []
    for fast in (False, True):
        env = simpy.Environment()
        ledger = Ledger(trace)
        pool = [AggregatedInstance(env, k, ledger, StepClock(0.05, 0.002, 1e-4),
                                   fast_forward=fast, **sizes) for k in range(num_instances)]
        if num_instances == 1:
            LazyArrivals(ledger, pool[0], max_context=10_000)
        else:
            PoolRouter(env, ledger, pool, least_work, 10_000)
        env.run()
        assert all(a.leaks() == {} for a in pool)
        out.append((ledger.frame(), sum(a.num_preemptions for a in pool)))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), instances=st.sampled_from([1, 2]),
       tokens=st.integers(8, 64), seqs=st.integers(1, 8), blocks=st.integers(20, 60))
def test_fast_forward_matches_the_step_by_step_oracle(seed, n, instances, tokens, seqs, blocks):
    trace = _random_trace(seed, n)
    (slow, pre_slow), (fast, pre_fast) = _oracle_pair(
        trace, instances, max_batch_tokens=tokens, max_batch_size=min(seqs, tokens),
        num_blocks=blocks, block_size=4)
    assert slow["status"].tolist() == fast["status"].tolist()
    assert pre_slow == pre_fast
    for name in INSTANTS:
        a, b = slow[name].to_numpy(), fast[name].to_numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b))
        assert np.nanmax(np.abs(a - b), initial=0.0) <= 1e-9


def test_preemptions_happen_in_the_oracle_check():
    """The random cases above include preemption (the check is not vacuous)."""
    (_, pre), _ = _oracle_pair(_random_trace(7, 40), 1, max_batch_tokens=32,
                               max_batch_size=8, num_blocks=20, block_size=4)
    assert pre > 0


def _aggregated(**cluster):
    return from_dict({"seed": 5, "workload": {"num_requests": 300, "rate": 1.5},
                      "cluster": {"kind": "aggregated", **cluster}, **cluster.pop("top", {})})


@pytest.mark.parametrize("fast_forward", [True, False])
def test_conservation_under_instance_loss_and_preemption(fast_forward):
    config = from_dict({"seed": 5, "workload": {"num_requests": 300, "rate": 1.5},
                        "faults": {"instance_loss": [[1, 60.0]]},
                        "cluster": {"kind": "aggregated", "fast_forward": fast_forward,
                                    "aggregated": {"num_instances": 2, "max_num_blocks": 300}}})
    result = simulate(config)
    rec = result.records
    counts = rec["status"].value_counts().to_dict()
    assert set(counts) == {"ok", "failed_instance_lost"}
    assert sum(counts.values()) == len(rec) == 300
    assert sum(result.stats["aggregated_preemptions"]) > 0
    lost = rec[rec["status"] == "failed_instance_lost"]
    assert (lost["decode_instance"] == 1).all() and (lost["finished_at"] >= 60.0).all()
    later = rec[rec["arrival_at"] > 60.0]                 # routed past the loss: to 0 only
    assert len(later) and (later["decode_instance"] == 0).all()
    assert result.stats["aggregated_blocks_in_use"] == [0, 0]
    ok = rec[rec["status"] == "ok"]
    assert (ok["first_token_at"] >= ok["prefill_start_at"]).all()
    assert (ok["finished_at"] >= ok["first_token_at"]).all()
    assert rec["kv_bytes"].eq(0).all() and rec["transfer_start_at"].isna().all()


def test_a_simulated_aggregated_run_matches_its_oracle_on_the_roofline():
    runs = [simulate(from_dict({"seed": 2, "workload": {"num_requests": 200, "rate": 1.0},
                                "cluster": {"kind": "aggregated", "fast_forward": ff,
                                            "aggregated": {"max_num_blocks": 600}}}))
            for ff in (True, False)]
    assert sum(runs[0].stats["aggregated_preemptions"]) > 0
    assert runs[0].stats["aggregated_wakeups"][0] < runs[1].stats["aggregated_wakeups"][0]
    for name in INSTANTS:
        np.testing.assert_allclose(runs[0].records[name], runs[1].records[name], rtol=0,
                                   atol=1e-9)


def test_both_pools_serve_behind_one_router():
    config = from_dict({"seed": 1, "workload": {"num_requests": 200, "rate": 1.0},
                        "cluster": {"kind": "both", "pool_routing": "share",
                                    "aggregated_share": 0.25}})
    rec = simulate(config).records
    assert (rec["status"] == "ok").all()
    aggregated = rec["prefill_instance"] == 1        # after the one P/D prefill instance
    assert aggregated.sum() == 50
    assert rec.loc[aggregated, "kv_bytes"].eq(0).all()
    assert rec.loc[~aggregated, "kv_bytes"].gt(0).all()


def test_streamed_aggregated_records_equal_the_whole_run(tmp_path):
    from sim.engine.stream import Stream
    import pandas as pd

    config = from_dict({"seed": 4, "workload": {"num_requests": 500, "rate": 1.0},
                        "cluster": {"kind": "aggregated"}})
    whole = simulate(config).records
    simulate(config, stream=Stream(tmp_path / "records.parquet", chunk_size=64))
    streamed = pd.read_parquet(tmp_path / "records.parquet").sort_values("request_id")
    for name in INSTANTS + ["status"]:
        assert streamed[name].tolist() == whole[name].tolist() or np.allclose(
            streamed[name], whole[name], equal_nan=True)


def test_an_aggregated_request_arriving_at_a_boundary_joins_the_step_starting_there():
    trace = make_trace([0.0, 1.8], [10, 3], [1, 1])
    inst, rec = make_instance(trace)
    assert inst.log[1][0] == 1.8 and [c[0] for c in inst.log[1][3]] == [0, 1]
    assert math.isclose(rec["finished_at"][1], 1.8 + 1.5)


def test_a_priority_tenant_is_served_first_from_the_waiting_queue():
    from traces.trace import Trace

    n = 400
    rng = np.random.default_rng(3)
    base = make_trace(np.cumsum(rng.exponential(0.3, n)), rng.integers(200, 2000, n),
                      rng.integers(10, 200, n))
    tenant = np.where(np.arange(n) % 2 == 0, "a", "b")
    trace = Trace(base.arrival_at, base.num_prompt_tokens, base.num_output_tokens,
                  base.request_id, tenant=tenant)
    waits = {}
    for fairness in ("fcfs", "weighted_fair"):
        config = from_dict({"cluster": {"kind": "aggregated",
                                        "aggregated": {"max_batch_size": 8},
                                        "policies": {"fairness": fairness,
                                                     "priority_tenants": ["a"]}}})
        rec = simulate(config, trace).records
        assert (rec["status"] == "ok").all()
        wait = rec["prefill_start_at"] - rec["arrival_at"]
        waits[fairness] = wait.groupby(rec["tenant"]).mean()
    assert waits["weighted_fair"]["a"] < 0.5 * waits["weighted_fair"]["b"]
    assert waits["fcfs"]["a"] == pytest.approx(waits["fcfs"]["b"], rel=0.5)


def test_both_pools_match_their_oracle_and_conserve_requests_under_a_decode_loss():
    runs = []
    for ff in (True, False):
        config = from_dict({"seed": 3, "workload": {"num_requests": 300, "rate": 1.5},
                            "faults": {"instance_loss": [[0, 80.0]]},
                            "cluster": {"kind": "both", "fast_forward": ff,
                                        "aggregated": {"max_num_blocks": 400}}})
        runs.append(simulate(config))
    fast, slow = runs[0].records, runs[1].records
    assert fast["status"].tolist() == slow["status"].tolist()
    for name in INSTANTS:
        np.testing.assert_allclose(fast[name], slow[name], rtol=0, atol=1e-9)
    counts = fast["status"].value_counts().to_dict()
    assert set(counts) == {"ok", "failed_instance_lost"} and sum(counts.values()) == 300
    lost = fast[fast["status"] == "failed_instance_lost"]
    assert (lost["prefill_instance"] == 0).all()             # only the P/D pool lost one
    assert runs[0].stats["aggregated_blocks_in_use"] == [0]


def test_a_cut_run_shows_what_the_oracle_had_by_the_cut():
    """With lazy arrivals the instance commits steps ahead of the clock; a run cut at
    ``until`` still shows only what had happened by then, as the oracle does."""
    runs = [simulate(from_dict({"seed": 3, "workload": {"num_requests": 400, "rate": 0.7},
                                "cluster": {"kind": "aggregated", "fast_forward": ff,
                                            "aggregated": {"max_num_blocks": 500}}}),
                     until=150.0) for ff in (True, False)]
    fast, slow = runs[0].records, runs[1].records
    assert fast["status"].tolist() == slow["status"].tolist()
    assert 0 < (fast["status"] == "ok").sum() < len(fast)
    for name in INSTANTS:
        np.testing.assert_allclose(fast[name], slow[name], rtol=0, atol=1e-9)
    assert runs[0].stats["aggregated_busy_s"][0] == pytest.approx(
        runs[1].stats["aggregated_busy_s"][0], abs=1e-9)


def test_a_request_longer_than_the_model_context_is_rejected_at_its_arrival():
    trace = make_trace([0.0, 1.0, 2.0], [100, 140_000, 50], [10, 10, 10])
    rec = simulate(from_dict({"cluster": {"kind": "aggregated"}}), trace).records
    assert rec["status"].tolist() == ["ok", "rejected_prompt_too_long", "ok"]
    assert rec["finished_at"][1] == 1.0


def test_a_routed_run_cut_before_the_next_arrival_ends_there_without_a_timer():
    """Steps cost 1 s + 0.1 s per prompt token. r0 (10 + 20 tokens) decodes from 2.0; r1
    arrives at 5.5 and joins at the boundary 6.0 (its step 6.0-7.3, its last token 8.3); r0
    ends 13 steps later at 21.3, r2 runs alone from its arrival at 50. Nothing can reach the
    instance before each step ends, so every step is committed at once: no timer fires."""
    trace = make_trace([0.0, 5.5, 50.0], [10, 3, 2], [20, 2, 2])
    runs = []
    for fast in (False, True):
        env = simpy.Environment()
        ledger = Ledger(trace)
        inst = AggregatedInstance(env, 0, ledger, StepClock(), max_batch_size=2,
                                  max_batch_tokens=16, num_blocks=30, block_size=4,
                                  fast_forward=fast)
        inst.log = []
        PoolRouter(env, ledger, [inst], least_work, 10_000)
        env.run()
        runs.append((inst, ledger.frame()))
    (slow, rec_slow), (fast, rec_fast) = runs
    assert fast.log == [(0.0, 2.0, (), ((0, 10, 0),), 1), (2.0, 6.0, (0,), (), 4),
                        (6.0, 7.3, (0,), ((1, 3, 0),), 1), (7.3, 8.3, (0, 1), (), 1),
                        (8.3, 21.3, (0,), (), 13), (50.0, 51.2, (), ((2, 2, 0),), 1),
                        (51.2, 52.2, (2,), (), 1)]
    assert fast.num_wakeups == 0 < slow.num_wakeups
    assert rec_fast["finished_at"].tolist() == pytest.approx([21.3, 8.3, 52.2], abs=1e-12)
    for name in INSTANTS:
        np.testing.assert_allclose(rec_fast[name], rec_slow[name], rtol=0, atol=1e-12)
