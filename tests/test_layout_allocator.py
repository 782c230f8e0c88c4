"""Receive allocators: per-request reserve/release, occupancy, fragmentation, bank imbalance."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hardware.allocator import ContiguousAllocator, OutOfMemory, ReceiveAllocator
from hardware.dram import DramConfig, blackhole_p150a
from hardware.kv_layout import TTKVSpec


def make_tt(blocks=16, heads=1, banks=8, layers=2):
    return TTKVSpec(num_layers=layers, max_num_blocks=blocks, num_kv_heads=heads, head_dim=128,
                    dram=DramConfig(num_banks=banks, bank_bytes=1 << 20))


def test_reserve_prefers_one_run_and_release_frees():
    alloc = ReceiveAllocator(make_tt())
    assert alloc.reserve("a", 100).tolist() == [0, 1, 2, 3]
    assert alloc.reserve("b", 64).tolist() == [4, 5]
    alloc.release("a")
    assert alloc.reserve("c", 150).tolist() == list(range(6, 11))   # 5 blocks: a's gap too small
    s = alloc.stats()
    assert (s.num_requests, s.free_units, s.largest_free_run) == (2, 9, 5)
    assert s.fragmentation == pytest.approx(1 - 5 / 9)
    assert alloc.reserve("d", 32 * 9).tolist() == [0, 1, 2, 3, 11, 12, 13, 14, 15]  # scattered
    with pytest.raises(OutOfMemory, match="needs 1 blocks, 0 free"):
        alloc.reserve("e", 1)


def test_bad_requests_name_the_value():
    alloc = ReceiveAllocator(make_tt())
    alloc.reserve("a", 10)
    with pytest.raises(ValueError, match="'a' already"):
        alloc.reserve("a", 10)
    with pytest.raises(ValueError, match="'z' holds no"):
        alloc.release("z")
    with pytest.raises(ValueError, match="num_tokens 0"):
        alloc.reserve("b", 0)


def test_layout_aware_banks_fill_evenly():
    tt = make_tt(blocks=64, heads=1, banks=8)          # 4 pages per block
    alloc = ReceiveAllocator(tt)
    for r in range(5):
        alloc.reserve(r, 32 * 6)                        # 6 blocks = 24 pages = 3 per bank
    s = alloc.stats()
    page = tt.page_bytes
    assert s.bank_used_bytes == (2 * 2 * 15 * page,) * 8   # 2 layers x K,V x 15 pages each
    assert s.imbalance == 1.0
    assert s.bank_capacity_bytes == tt.region_sizes[0]


def test_contiguous_buffer_piles_into_low_banks():
    dram = DramConfig(num_banks=8, bank_bytes=1 << 20)
    alloc = ContiguousAllocator(dram)
    assert alloc.reserve("a", 600_000) == 0
    assert alloc.reserve("b", 600_000) == 600_000
    s = alloc.stats()
    assert s.bank_used_bytes[:2] == (1 << 20, 1_200_000 - (1 << 20))
    assert sum(s.bank_used_bytes[2:]) == 0
    assert s.imbalance == pytest.approx((1 << 20) / (1_200_000 / 8))
    assert s.interleaved_free_bytes == 0               # bank 0 is full: no interleaved room
    alloc.release("a")
    s = alloc.stats()
    assert s.largest_free_run == 8 * (1 << 20) - 1_200_000
    assert s.fragmentation == pytest.approx(1 - s.largest_free_run / s.free_units)
    assert alloc.reserve("c", 500_000) == 0            # first fit back into the hole
    with pytest.raises(OutOfMemory, match="contiguous"):
        alloc.reserve("d", 8 << 20)


def test_same_request_imbalance_in_numbers():
    """One 4096-token Llama-70B request's K/V on one p150a chip, both designs."""
    tt = TTKVSpec(num_layers=80, max_num_blocks=1024, num_kv_heads=1, head_dim=128,
                  dram=blackhole_p150a())
    aware = ReceiveAllocator(tt)
    aware.reserve("r", 4096)
    single = ContiguousAllocator(tt.dram)
    single.reserve("r", 160 * 128 * 4 * 1088)          # the same bytes, one linear buffer
    assert aware.stats().imbalance == 1.0
    assert single.stats().imbalance == pytest.approx(8.0)   # 85 MiB all in bank 0


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 200)), max_size=40))
def test_reservations_never_overlap_and_all_come_back(ops):
    tt = make_tt(blocks=24)
    alloc = ReceiveAllocator(tt)
    held = {}
    for i, (grow, tokens) in enumerate(ops):
        if grow or not held:
            try:
                held[i] = alloc.reserve(i, tokens)
            except OutOfMemory:
                assert alloc.free.sum() < tt.blocks_for(tokens)
        else:
            alloc.release(next(iter(held)))
            held.pop(next(iter(held)))
        taken = np.concatenate([np.zeros(0, np.int64)] + list(held.values()))
        assert np.unique(taken).size == taken.size
        assert alloc.free.sum() + taken.size == tt.max_num_blocks
    for r in list(held):
        alloc.release(r)
    s = alloc.stats()
    assert s.free_units == tt.max_num_blocks and sum(s.bank_used_bytes) == 0
    assert s.num_requests == 0 and s.fragmentation == 0.0
