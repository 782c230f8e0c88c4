"""The prefill instance on its own: exact batch logs for tiny chunked-prefill scenarios, the
one wake-up event it re-arms per batch, and the serving orders its two queue kinds keep."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from policies.batching import (BatchingTraits, chunked_prefill, fcfs_token_budget,
                               shortest_prompt_first, traits_of)
from policies.fairness import WeightedFair
from sim.engine.cluster import simulate
from sim.engine.ledger import Ledger
from sim.engine.prefill import PrefillInstance
from tests.builders import make_config, make_trace, random_trace


class PerToken:
    """Prefill predictor: ``seconds_per_token`` x the batch's tokens."""

    def __init__(self, seconds_per_token: float = 0.001):
        self.seconds_per_token = seconds_per_token

    def prefill_time(self, lens) -> float:
        return self.seconds_per_token * sum(lens)


def make_prefill(trace, predictor=None, max_batch_tokens=1000, fairness=None):
    """One chunked-prefill instance fed the whole trace at time 0; returns (env, instance,
    log of (instant, request) handed on)."""
    env, ledger, log = simpy.Environment(), Ledger(trace), []
    prefill = PrefillInstance(env, 0, ledger, predictor or PerToken(), max_batch_size=8,
                              max_batch_tokens=max_batch_tokens, buffer_blocks=1000,
                              block_size=16, pick=chunked_prefill, fairness=fairness,
                              on_prefilled=lambda i, source: log.append((env.now, i)))
    for i in range(ledger.n):
        prefill.enqueue(i)
    return env, prefill, log


def test_chunked_batches_split_a_long_prompt_and_hand_on_each_request_once():
    # budget 1000: [0: 600, 1: 400] at t=0; [1: 500 (900 - 400), 2: 300, ...] after 1 s
    trace = make_trace([0.0, 0.0, 0.0], [600, 900, 300], [5, 5, 5])
    env, prefill, log = make_prefill(trace)
    prefill.kick()
    env.run()
    assert log == [(pytest.approx(1.0), 0), (pytest.approx(1.8), 1), (pytest.approx(1.8), 2)]
    ledger = prefill.ledger
    assert list(ledger.prefill_start_at) == [0.0, 0.0, pytest.approx(1.0)]
    assert prefill.num_batches == 2 and prefill.done == {} and not prefill.queue
    assert prefill.free_blocks == 1000 - (38 + 57 + 19)       # held until the decode side pulls
    assert prefill.queued_tokens == 0


def test_one_wake_up_event_is_re_armed_for_every_batch():
    trace = make_trace([0.0] * 4, [1000] * 4, [5] * 4)          # four batches, one each
    env, prefill, log = make_prefill(trace)
    prefill.kick()
    pending = []
    while env.peek() < float("inf"):
        pending.append([entry[3] for entry in env._queue])
        env.step()
    assert [t for t, _ in log] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert all(events == [prefill._wakeup] for events in pending)   # no new event per batch


def test_a_negative_batch_time_is_refused_naming_the_instance():
    trace = make_trace([0.0], [100], [5])
    env, prefill, _ = make_prefill(trace, predictor=PerToken(-0.001))
    with pytest.raises(ValueError, match=r"prefill instance 0: a batch of \[100\] prompt "
                                         r"tokens priced at -0.1 s"):
        prefill.kick()


def test_arrival_order_queue_serves_as_the_fairness_queue_with_one_tenant():
    # the chunked path keeps a deque in arrival order without fairness, a sorted list with it
    trace = make_trace([0.0, 0.0, 0.1, 0.2, 0.2], [1500, 300, 2600, 40, 900], [5] * 5)
    logs = []
    for fairness in (None, WeightedFair()):
        env, prefill, log = make_prefill(trace, max_batch_tokens=1024, fairness=fairness)
        prefill.kick()
        env.run()
        logs.append((log, list(prefill.ledger.prefill_start_at)))
    assert logs[0] == logs[1]
    assert [i for _, i in logs[0][0]] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", range(6))
def test_a_lone_queued_request_is_batched_as_the_policy_picks_it(seed):
    # chunked prefill takes a lone request, and sees an empty pick coming, without the pick
    # list (``_take_chunked``): the same batches as the policy's general path, arrivals
    # spread out and the buffer short
    rng = np.random.default_rng(seed)
    n = 80
    trace = make_trace(np.cumsum(rng.exponential(1.2, n)), rng.integers(1, 3000, n), [5] * n)
    runs = []
    for general in (False, True):
        env, ledger, log = simpy.Environment(), Ledger(trace), []

        def handed_on(i, source, env=env, log=log):      # pulled 0.5 s later
            log.append((env.now, i))
            env.timeout(0.5).callbacks.append(lambda _e: source.release(i))

        prefill = PrefillInstance(env, 0, ledger, PerToken(0.0003), max_batch_size=3,
                                  max_batch_tokens=1024, buffer_blocks=300, block_size=16,
                                  pick=chunked_prefill, on_prefilled=handed_on)
        if general:
            prefill._take = prefill._take_general
        for i, at in enumerate(ledger.arrival_at):
            env.timeout(at).callbacks.append(
                lambda _e, i=i, prefill=prefill: (prefill.enqueue(i), prefill.kick()))
        env.run()
        runs.append((log, list(ledger.prefill_start_at), list(ledger.prefill_end_at),
                     prefill.num_batches, prefill.free_blocks))
    assert runs[0] == runs[1]
    assert sorted(i for _, i in runs[0][0]) == list(range(n))


def test_chunked_runs_match_with_and_without_a_fairness_policy():
    config = make_config(**{"cluster.policies.prefill_batching": "chunked",
                            "workload.num_requests": 300, "workload.rate": 1.5})
    plain = simulate(config).records
    fair = simulate(config.replace(**{"cluster.policies.fairness": "weighted_fair"})).records
    assert (plain["status"] == "ok").all()
    assert plain.equals(fair)


@pytest.mark.parametrize("tp", [1, 2])
def test_roofline_prefill_time_of_a_batch_is_its_closed_form(tp):
    from hardware import catalog
    from sim.models.predictor import RooflinePredictor, load_profile

    config = make_config()
    model, device = catalog.model(config.cluster.model), config.cluster.prefill.device
    eff = load_profile(config.cluster.profile)[device]
    pred = RooflinePredictor(model, catalog.device(device), tp, eff)
    lens = [1500, 548, 7]
    tokens, pairs = sum(lens), sum(n * (n + 1) / 2 for n in lens)   # causal attention pairs
    flops = (pred._body_flops_per_token * tokens + pred._lm_head_flops * len(lens)
             + pred._attn_flops_per_ctx * pairs)
    nbytes = pred._weights + pred._kv_per_token * tokens
    expected = (max(flops / pred._prefill_flops_rate, nbytes / pred._prefill_bytes_rate)
                + pred.allreduce_time(tokens) + eff.step_overhead_s)
    assert pred.prefill_time(lens) == pytest.approx(expected, rel=1e-12)
    assert (pred.allreduce_time(tokens) > 0) == (tp > 1)


# -- what a batching policy declares (policies.batching.BatchingTraits) ----------------------
def declared_chunked(*args):
    """A user's chunked prefill that declares the built-in one's traits."""
    return chunked_prefill(*args)


def declared_fcfs(*args):
    """A user's whole-prompt FCFS that declares the built-in one's traits."""
    return fcfs_token_budget(*args)


def undeclared_chunked(*args):
    """A user's chunked prefill that declares nothing: the general path."""
    return chunked_prefill(*args)


declared_chunked.traits = chunked_prefill.traits
declared_fcfs.traits = fcfs_token_budget.traits


def run_policy(monkeypatch, name: str, max_batch_tokens: int):
    """Records of a loaded run with prefill batching ``name``, and the path the prefill
    instance took (the name of its ``_take``)."""
    import sim.engine.cluster

    made, base = [], sim.engine.cluster.PrefillInstance
    monkeypatch.setattr(sim.engine.cluster, "PrefillInstance",
                        lambda *a, **k: made.append(base(*a, **k)) or made[-1])
    trace = random_trace(np.random.default_rng(5), 300, 3.0, max_prompt=4000)
    config = make_config(**{"cluster.policies.prefill_batching": name,
                            "cluster.prefill.max_batch_tokens": max_batch_tokens})
    return simulate(config, trace).records, made[0]._take.__name__


@pytest.mark.parametrize("builtin, user, path", [
    ("chunked", "tests.test_prefill_instance:declared_chunked", "_take_chunked"),
    ("fcfs", "tests.test_prefill_instance:declared_fcfs", "_take_fcfs")])
def test_a_user_policy_declaring_a_builtins_traits_takes_its_path_and_gives_its_records(
        monkeypatch, builtin, user, path):
    # a budget shorter than the longest prompts: chunked splits them, FCFS rejects them
    reference, builtin_path = run_policy(monkeypatch, builtin, max_batch_tokens=3000)
    records, user_path = run_policy(monkeypatch, user, max_batch_tokens=3000)
    assert builtin_path == user_path == path
    assert records.equals(reference)
    assert (reference["status"] == "ok").all() == (builtin == "chunked")   # FCFS rejects some
    assert (reference["status"] == "ok").mean() > 0.5


def test_a_user_policy_declaring_nothing_takes_the_general_path_with_the_same_records(
        monkeypatch):
    # every prompt fits the budget (a policy that promises nothing may not split them); a
    # batch's last request still gets a chunk, so chunked and FCFS batches differ
    reference, _ = run_policy(monkeypatch, "chunked", max_batch_tokens=4096)
    records, path = run_policy(monkeypatch, "tests.test_prefill_instance:undeclared_chunked",
                               max_batch_tokens=4096)
    fcfs, _ = run_policy(monkeypatch, "fcfs", max_batch_tokens=4096)
    assert path == "_take_general"
    assert records.equals(reference)
    assert (records["status"] == "ok").all() and not records.equals(fcfs)


def test_traits_that_are_not_batching_traits_are_refused_naming_the_policy():
    def odd(*args):
        return []

    odd.traits = {"in_order": True}
    with pytest.raises(TypeError, match="prefill batching policy 'odd': traits must be"):
        traits_of(odd)
    assert traits_of(undeclared_chunked) == BatchingTraits()
    assert traits_of(shortest_prompt_first) == BatchingTraits()
