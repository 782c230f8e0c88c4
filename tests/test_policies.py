"""Policies are pure functions: decisions as data, testable without a simulation."""

from policies.batching import blocks_for, fcfs_decode_admit, fcfs_prefill_batch
from policies.routing import least_loaded, round_robin


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
    assert [round_robin([0, 0, 0], k) for k in range(4)] == [0, 1, 2, 0]
    assert least_loaded([5, 2, 2, 9], 0) == 1
