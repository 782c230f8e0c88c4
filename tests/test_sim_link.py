"""The KV link: fixed costs, bandwidth sharing, closed-form transfer times."""

import pytest
import simpy

from sim.engine.link import KVLink

GB = 1e9


def run_transfers(starts, sizes, bandwidth=10 * GB, fixed=0.0):
    env = simpy.Environment()
    link = KVLink(env, bandwidth, latency_s=fixed)
    done = {}

    def starter(k, at, size):
        yield env.timeout(at)
        link.start(0.0, size, lambda i: done.__setitem__(i, env.now), k)

    for k, (at, size) in enumerate(zip(starts, sizes)):
        env.process(starter(k, at, size))
    env.run()
    return done, link


def test_single_transfer_takes_fixed_plus_bytes_over_bandwidth():
    done, link = run_transfers([1.0], [5 * GB], fixed=0.002)
    assert done[0] == pytest.approx(1.0 + 0.002 + 0.5, abs=1e-12)
    assert link.busy_time == pytest.approx(0.5)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_equal_simultaneous_transfers_share_bandwidth(n):
    done, _ = run_transfers([0.0] * n, [GB] * n)
    assert all(t == pytest.approx(n * 0.1, rel=1e-12) for t in done.values())


def test_processor_sharing_with_staggered_arrivals():
    # A: 2 GB at t=0; B: 1 GB at t=0.1. Alone A moves 1 GB by 0.1; then they share 5 GB/s
    # each: B needs 0.2 s (done 0.3), A has 0 GB left at 0.3? A had 1 GB left, moved 1 GB by 0.3.
    done, _ = run_transfers([0.0, 0.1], [2 * GB, GB])
    assert done[1] == pytest.approx(0.3, rel=1e-12)
    assert done[0] == pytest.approx(0.3, rel=1e-12)
    done, _ = run_transfers([0.0, 0.1], [3 * GB, GB])
    assert done[1] == pytest.approx(0.3, rel=1e-12)
    assert done[0] == pytest.approx(0.4, rel=1e-12)   # 1 GB left alone at 10 GB/s


def test_bad_bandwidth_is_refused():
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        KVLink(simpy.Environment(), 0.0)


def test_host_queue_is_fifo_and_exact():
    from sim.engine.link import HostQueue

    host = HostQueue()
    assert host.reserve(1.0, 0.5) == 1.5            # idle: starts at once
    assert host.reserve(1.2, 0.5) == 2.0            # waits behind the first
    assert host.reserve(3.0, 0.25) == 3.25          # idle again
    assert host.busy_time == pytest.approx(1.25) and host.num_jobs == 3
    with pytest.raises(ValueError, match="must be >= 0"):
        host.reserve(0.0, -1.0)


def test_source_host_work_queues_before_the_wire():
    """Two transfers with 0.3 s of host work each on one host: the second enters the wire
    only when the host is free, so the two never share the bandwidth."""
    from sim.engine.link import HostQueue

    env = simpy.Environment()
    link, host, done = KVLink(env, 10 * GB), HostQueue(), {}
    for k in range(2):
        link.start(0.3, GB, lambda i: done.__setitem__(i, env.now), k, host, 0.3)
    env.run()
    assert done[0] == pytest.approx(0.4, abs=1e-12)       # 0.3 host + 0.1 wire
    assert done[1] == pytest.approx(0.7, abs=1e-12)       # waits to 0.6, then 0.1 alone


def test_each_decode_node_has_its_own_nic():
    """Two decode instances pulling at once do not share one link: each transfer runs at the
    full NIC rate (the old single shared link halved both)."""
    from sim.engine.cluster import simulate
    from tests.builders import FreeTransfer, make_config, make_trace

    config = make_config(**{"cluster.decode.num_instances": 2, "cluster.prefill.num_instances": 2,
                            "cluster.link.bandwidth_gb_s": 1.0, "cluster.link.latency_s": 0.0,
                            "cluster.decode_routing": "round_robin"})
    tokens = 1000                     # FreeTransfer: one byte per token, no fixed costs
    trace = make_trace([0.0, 0.0], [tokens, tokens], [2, 2])
    recs = simulate(config, trace, pricing=FreeTransfer()).records
    took = recs["transfer_end_at"] - recs["transfer_start_at"]
    assert set(recs["decode_instance"]) == {0, 1}
    assert took.tolist() == pytest.approx([tokens / 1e9] * 2, rel=1e-9)


def test_the_link_fires_once_per_completion_instant():
    """Each start that moves the next completion moves the link's one timer (sim.engine.timers): the
    run's events are the starts and the distinct completion instants, no stale timers."""
    env = simpy.Environment()
    link = KVLink(env, 10 * GB)
    done = {}
    starts = [(0.0, 4 * GB), (0.05, GB), (0.1, 0.1 * GB), (0.12, 3 * GB), (0.5, GB)]
    for k, (at, size) in enumerate(starts):
        simpy.events.Timeout(env, at).callbacks.append(
            lambda _e, k=k, size=size: link.start(0.0, size, lambda i: done.__setitem__(
                i, env.now), k))
    events = 0
    while env.peek() < float("inf"):
        env.step()
        events += 1
    assert len(done) == len(starts)
    assert events == len(starts) + len(set(done.values()))


def test_a_join_that_keeps_the_next_completion_keeps_its_place_among_ties():
    """A solo transfer's completion is queued when it starts; a transfer that starts later
    but reaches the wire only after it leaves that entry in place, so an event scheduled in
    between for the same instant still runs after the completion (SimPy's tie order)."""
    env = simpy.Environment()
    link = KVLink(env, 10 * GB)
    log = []
    link.start(0.0, GB, lambda k: log.append((env.now, k)), "solo")       # ends at 0.1
    simpy.events.Timeout(env, 0.1).callbacks.append(lambda _e: log.append((env.now, "tie")))
    simpy.events.Timeout(env, 0.05).callbacks.append(
        lambda _e: link.start(0.2, GB, lambda k: log.append((env.now, k)), "late"))
    env.run()
    assert log == [(0.1, "solo"), (0.1, "tie"), (pytest.approx(0.35, rel=1e-12), "late")]
    assert link.busy_time == pytest.approx(0.2)
