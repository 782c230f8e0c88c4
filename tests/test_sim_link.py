"""The KV link: fixed costs, bandwidth sharing, closed-form transfer times."""

import pytest
import simpy

from sim.link import KVLink

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
