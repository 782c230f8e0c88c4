"""Decode KV pools: BlockPool behaviour, the single buffer's OOM under serving, leak checks."""

import heapq

import numpy as np
import pytest

from sim.engine.memory import BlockPool, HawkPool, SingleBufferPool, make_pool
from traces.workloads import sample_lengths

#: raw fp8 KV per token over one bank-slot of bfloat8_b blocks (32 tokens, 8 banks)
STAGING = 160 / 170 * 8 / 32


def test_block_pool_reserves_whole_and_waits():
    pool = BlockPool(capacity_blocks=10, block_size=16)
    assert pool.try_reserve("a", 100, 28) == "ok"          # 8 blocks
    assert pool.try_reserve("b", 30, 10) == "wait"          # 3 blocks, 2 free
    assert pool.fits_ever(150, 10) and not pool.fits_ever(150, 11)
    pool.relayout_done("a")
    pool.release("a")
    assert pool.try_reserve("b", 30, 10) == "ok"
    pool.release("b")
    assert pool.free_blocks == 10 and pool.stats()["num_requests"] == 0


def test_pools_refuse_double_reserve_and_unknown_release():
    for pool in (BlockPool(8, 16), HawkPool(8, 8, 32), SingleBufferPool(8, 8, 32, STAGING)):
        assert pool.try_reserve(1, 10, 10) == "ok"
        with pytest.raises(ValueError, match="already holds"):
            pool.try_reserve(1, 10, 10)
        with pytest.raises(ValueError, match="holds no reservation"):
            pool.release(2)


def test_single_buffer_loads_bank_zero_first():
    pool = SingleBufferPool(8, 400, 32, STAGING)
    assert pool.try_reserve("r", 500, 10) == "ok"           # 118 staging slots, 16 blocks
    occ = pool.stats()["bank_occupancy"]
    assert occ[0] > occ[1] and pool.stats()["imbalance"] > 1.5
    pool.relayout_done("r")
    assert pool.stats()["imbalance"] == pytest.approx(1.0)   # only interleaved blocks left
    pool.release("r")
    assert not pool.used.any()


def test_oom_means_free_room_left_but_layout_unservable():
    pool = SingleBufferPool(4, 10, 32, 1.0 / 8)             # a staging slot per 8 tokens
    assert pool.try_reserve("a", 32, 32) == "ok"             # staging bank 0 [0, 4), blocks 4-5
    free = int((~pool.used).sum())
    # b needs 6 blocks (24 cells) + 4 staging slots = 28 = all the free cells, but its staging
    # takes bank 0 [6, 10) and no slot column is then free in every bank
    assert pool.try_reserve("b", 32, 160) == "oom"
    assert free == 28 and int((~pool.used).sum()) == free    # nothing stayed reserved
    assert pool.stats()["num_oom"] == 1 and "b" not in pool.blocks


def _serve(pool, n=1500, rate=2.0, seed=0):
    """A serving-like sequence: Poisson arrivals of Chatbot requests, re-layout shortly after
    landing, release after their decode; waiting requests retry on every release."""
    rng = np.random.default_rng(seed)
    prompts, outputs = sample_lengths("chatbot", n, rng)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    events, waiting, outcome = [], [], {"ok": 0, "oom": 0}

    def admit(i, now):
        result = pool.try_reserve(i, int(prompts[i]), int(outputs[i]))
        if result == "wait":
            return False
        outcome[result] += 1
        if result == "ok":
            heapq.heappush(events, (now + 0.2, 0, i))
            heapq.heappush(events, (now + 0.2 + 0.07 * outputs[i], 1, i))
        return True

    def drain(until):
        while events and events[0][0] <= until:
            now, kind, i = heapq.heappop(events)
            (pool.relayout_done if kind == 0 else pool.release)(i)
            while waiting and admit(waiting[0], now):
                waiting.pop(0)

    for i, t in enumerate(arrivals):
        drain(t)
        if waiting or not admit(i, t):
            waiting.append(i)
    drain(np.inf)
    return outcome, waiting


def test_single_buffer_fails_under_serving_load_hawk_does_not():
    single = SingleBufferPool(8, 800, 32, STAGING)
    hawk = HawkPool(8, 800, 32)
    single_out, _ = _serve(single)
    hawk_out, hawk_left = _serve(hawk)
    assert single_out["oom"] > 0 and single.stats()["peak_bank_occupancy"][0] > 0.9
    assert hawk_out["oom"] == 0 and hawk_out["ok"] == 1500 and not hawk_left
    peak = hawk.stats()["peak_bank_occupancy"]
    assert max(peak) == pytest.approx(min(peak))              # HAWK fills banks evenly
    assert not single.used.any() and not single.blocks and not single.staging   # leak check
    assert not hawk.held and hawk.stats()["occupancy"] == 0


def test_make_pool_follows_the_mechanism():
    assert isinstance(make_pool("block", 10, 16), BlockPool)
    assert isinstance(make_pool("hawk", 10, 32, 8), HawkPool)
    assert isinstance(make_pool("single_buffer", 10, 32, 8, STAGING), SingleBufferPool)
    with pytest.raises(ValueError, match="unknown pool"):
        make_pool("ring", 10, 32, 8)


@pytest.mark.parametrize("pool", [BlockPool(40, 16), HawkPool(8, 40, 32),
                                  SingleBufferPool(8, 40, 32, STAGING),
                                  SingleBufferPool(12, 7, 32, 3.7)])
def test_fits_ever_many_agrees_with_fits_ever(pool):
    rng = np.random.default_rng(5)
    prompts, outputs = rng.integers(1, 3000, 400), rng.integers(1, 1000, 400)
    many = pool.fits_ever_many(prompts, outputs)
    assert many.tolist() == [pool.fits_ever(int(p), int(o)) for p, o in zip(prompts, outputs)]
    assert many.any() and not many.all()         # both verdicts are exercised
