"""Policies are pure functions: decisions as data, testable without a simulation."""

from sim.config import RunConfig

from policies.batching import blocks_for, fcfs_decode_admit, fcfs_prefill_batch
from policies.routing import least_work, round_robin


def test_blocks_round_up():
    assert [blocks_for(n, 16) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_prefill_batch_respects_every_limit_and_never_overtakes():
    lens = {0: 100, 1: 200, 2: 5000, 3: 10}
    queue = [0, 1, 2, 3]
    assert fcfs_prefill_batch(queue, lens, 8, 8192, 10_000, 16) == 4
    assert fcfs_prefill_batch(queue, lens, 2, 8192, 10_000, 16) == 2          # batch size
    assert fcfs_prefill_batch(queue, lens, 8, 1000, 10_000, 16) == 2          # token budget
    # the send buffer holds 7 + 13 blocks for requests 0 and 1, not 313 more for 2;
    # request 3 would fit but must not overtake 2
    assert fcfs_prefill_batch(queue, lens, 8, 8192, 30, 16) == 2
    assert fcfs_prefill_batch([], lens, 8, 8192, 30, 16) == 0


def test_decode_admission_fills_the_batch():
    assert fcfs_decode_admit(5, 30, 32) == 2
    assert fcfs_decode_admit(1, 32, 32) == 0
    assert fcfs_decode_admit(0, 0, 32) == 0


def test_routing_policies():
    assert [round_robin([0, 0, 0], [0, 0, 0], k) for k in range(4)] == [0, 1, 2, 0]
    assert least_work([5, 2, 2, 9], [0] * 4, 0) == 1


# -- the policy library: each policy alone, then the selector, then inside a run -----------

import numpy as np
import pytest

from policies import PolicyError, parse_assignment, resolve
from policies.batching import chunked_prefill, fcfs_token_budget, shortest_prompt_first
from policies.fairness import Fcfs, WeightedFair
from policies.routing import ROUTING, kv_aware, power_of_two


def test_least_work_and_kv_aware_read_different_signals():
    loads, free = [30, 10, 20], [5, 1, 9]
    assert least_work(loads, free, 0) == 1
    assert kv_aware(loads, free, 0) == 2                   # most free blocks
    assert kv_aware([30, 10, 20], [9, 9, 1], 0) == 1       # tie on blocks: less work


def test_power_of_two_takes_the_lesser_of_two_distinct_draws():
    loads = [5, 0, 7, 3]
    picks = [power_of_two(loads, [0] * 4, k) for k in range(400)]
    assert picks == [power_of_two(loads, [0] * 4, k) for k in range(400)]   # deterministic
    assert 2 not in picks                    # the most loaded never wins a pair
    assert set(picks) == {0, 1, 3}           # every other instance wins some pair
    # with two instances, two distinct draws see both: the least loaded always wins
    assert {power_of_two([4, 1], [0, 0], k) for k in range(50)} == {1}
    counts = np.bincount([power_of_two([0] * 4, [0] * 4, k) for k in range(4000)], minlength=4)
    assert counts.min() > 800                # equal loads: spread over all instances


def test_shortest_prompt_first_reorders_but_keeps_every_limit():
    lens = {0: 500, 1: 100, 2: 300, 3: 100}
    assert shortest_prompt_first([0, 1, 2, 3], lens, {}, 8, 8192, 1000, 16) == [
        (1, 100), (3, 100), (2, 300), (0, 500)]
    assert shortest_prompt_first([0, 1, 2, 3], lens, {}, 8, 450, 1000, 16) == [
        (1, 100), (3, 100)]                  # 300 more would pass the 450-token budget
    assert fcfs_token_budget([0, 1, 2, 3], lens, {}, 8, 450, 1000, 16) == []   # 500 first


def test_chunked_prefill_splits_a_long_prompt_and_lets_short_ones_in():
    lens = {0: 1000, 1: 50}
    first = chunked_prefill([0, 1], lens, {}, 8, 600, 1000, 16)
    assert first == [(0, 600)]               # the budget is spent on request 0's first chunk
    second = chunked_prefill([0, 1], lens, {0: 600}, 8, 600, 1000, 16)
    assert second == [(0, 400), (1, 50)]     # the rest of 0, then 1 in the same iteration
    # a started request holds its blocks already; a new one must fit the free blocks
    assert chunked_prefill([0, 1], lens, {0: 600}, 8, 600, 0, 16) == [(0, 400)]


def test_weighted_fair_lets_a_quiet_tenant_past_a_burst():
    fair, fifo = WeightedFair(), Fcfs()
    keys = [fair.tag("bursty", 100) for _ in range(10)] + [fair.tag("quiet", 100)]
    order = sorted(range(11), key=lambda k: (keys[k], k))
    assert order.index(10) == 1              # quiet is served second, not eleventh
    keys = [fifo.tag("bursty", 100) for _ in range(10)] + [fifo.tag("quiet", 100)]
    assert sorted(range(11), key=lambda k: (keys[k], k))[-1] == 10


def test_weighted_fair_shares_by_weight_and_serves_priority_first():
    fair = WeightedFair({"a": 2.0}, priority=("vip",))
    tagged = [("a", fair.tag("a", 100)) for _ in range(6)] + [("b", fair.tag("b", 100))
                                                              for _ in range(6)]
    tagged.append(("vip", fair.tag("vip", 100)))
    served = [t for t, _ in sorted(tagged, key=lambda p: p[1])]
    assert served[0] == "vip"
    assert served[1:7].count("a") == 4       # a gets two shares for b's one
    with pytest.raises(ValueError, match="tenant weight 'a' must be a number > 0"):
        WeightedFair({"a": 0})


def test_an_idle_tenant_banks_no_credit():
    fair = WeightedFair()
    for _ in range(5):
        fair.served(fair.tag("a", 100))      # a alone, served as it comes: clock at 400
    late = fair.tag("b", 100)                # b arrives now: starts at the clock, not at 0
    assert late[1] == 400.0


def test_selector_by_name_by_dash_name_and_by_import_path():
    assert resolve("routing", "least-work") is least_work
    assert resolve("routing", "least_loaded") is least_work           # older configs' name
    assert resolve("routing", "policies.routing:kv_aware") is kv_aware
    assert resolve("prefill_batching", "chunked") is chunked_prefill
    assert parse_assignment("routing=least-work") == ("routing", "least-work")
    with pytest.raises(PolicyError, match=r"routing policy 'random' is not one of \['kv_aware'"):
        resolve("routing", "random")
    with pytest.raises(PolicyError, match="cannot import 'no_such_module'"):
        resolve("routing", "no_such_module:route")
    with pytest.raises(PolicyError, match="'policies.routing' has no 'nope'"):
        resolve("routing", "policies.routing:nope")
    with pytest.raises(PolicyError, match="expected KIND=NAME"):
        parse_assignment("routing")
    with pytest.raises(PolicyError, match="kind 'colour' is not one of"):
        parse_assignment("colour=red")
    assert set(ROUTING) >= {"round_robin", "least_work", "kv_aware", "power_of_two"}


@pytest.mark.parametrize("changes", [
    {"cluster.routing": name} for name in ("round_robin", "least_work", "kv_aware",
                                           "power_of_two")] + [
    {"cluster.policies.prefill_batching": name} for name in ("shortest_prompt_first",
                                                             "chunked")] + [
    {"cluster.policies.fairness": "weighted_fair"}])
def test_every_policy_serves_every_request_in_a_run(changes):
    from sim.engine.cluster import simulate

    config = RunConfig().replace(**{"cluster.prefill.num_instances": 3,
                                    "cluster.prefill.max_batch_tokens": 2048,
                                    "workload.num_requests": 300, "workload.rate": 2.0,
                                    **changes})
    r = simulate(config)
    rec = r.records
    assert r.summary["statuses"] == {"ok": 300}
    assert (rec["prefill_start_at"] >= rec["arrival_at"]).all()
    assert (rec["prefill_end_at"] > rec["prefill_start_at"]).all()
    assert set(rec["prefill_instance"]) == {0, 1, 2}


def test_policies_that_change_the_order_change_the_run_and_fcfs_is_the_fast_path():
    from sim.engine.cluster import simulate
    from traces.trace import Trace

    # request 0 is prefilled alone; 1 (long) and 2 (short) arrive while it runs
    trace = Trace.from_columns([0.0, 0.001, 0.002], [1000, 2000, 100], [5, 5, 5])
    base = RunConfig().replace(**{"cluster.prefill.max_batch_size": 1})

    def order(**changes):
        rec = simulate(base.replace(**changes), trace).records
        assert (rec["status"] == "ok").all()
        return rec.sort_values("prefill_start_at")["request_id"].tolist()

    assert order() == [0, 1, 2]
    assert order(**{"cluster.policies.fairness": "weighted_fair"}) == [0, 1, 2]   # one tenant
    assert order(**{"cluster.policies.prefill_batching": "shortest_prompt_first"}) == [0, 2, 1]
    fcfs = simulate(base, trace).records
    same = simulate(base.replace(**{"cluster.policies.fairness": "weighted_fair"}), trace)
    assert fcfs.equals(same.records)        # the general path reproduces the fast path


def test_fair_sharing_shields_the_quiet_customers_from_a_burst():
    from sim.engine.cluster import simulate
    from traces.synthetic import bursty_customers

    trace = bursty_customers(rate=4.0, duration_s=300, seed=3)   # well past the knee
    config = RunConfig()
    quiet = trace.tenant != "bursty"
    waits = {}
    for fairness in ("fcfs", "weighted_fair"):
        rec = simulate(config.replace(**{"cluster.policies.fairness": fairness}), trace).records
        assert (rec["status"] == "ok").all()
        wait = (rec["prefill_start_at"] - rec["arrival_at"]).to_numpy()
        waits[fairness] = (wait[quiet].mean(), wait[~quiet].mean())
    assert waits["weighted_fair"][0] < waits["fcfs"][0]      # quiet customers wait less
    assert waits["weighted_fair"][1] > waits["fcfs"][1]      # the burst pays for it


def test_policy_flags_set_the_config_under_each_kinds_own_names(capsys):
    import json

    from sim.commands.main import main

    assert main(["simulate", "--show-config", "--json", "--policy", "routing=least-work",
                 "--policy", "prefill_batching=chunked", "--policy",
                 "admission=reserve_max"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["cluster.routing"] == {"value": "least_work", "source": "user"}
    assert shown["cluster.policies.prefill_batching"]["value"] == "chunked"
    assert shown["cluster.decode.admission"]["value"] == "reserve-max"   # its dict's key
    assert main(["simulate", "--policy", "routing=random"]) == 2
    assert "routing policy 'random' is not one of" in capsys.readouterr().err
