"""DRAM banks: interleaved page addressing and per-bank shares of a page range."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hardware.dram import (GiB, DramConfig, bank_major_order, bank_shares, blackhole_p150a,
                           contiguous_runs, page_location, wormhole)


def test_presets():
    bh, wh = blackhole_p150a(), wormhole()
    assert (bh.num_banks, bh.alignment, set(bh.bank_offsets)) == (8, 64, {0})
    assert (wh.num_banks, wh.alignment, wh.bank_bytes) == (12, 32, GiB)
    assert wh.bank_offsets[2] == 0 and wh.bank_offsets[3] == GiB
    assert wh.device_address(5, 100) == GiB + 100


def test_page_location_formula():
    dram = DramConfig(num_banks=3, alignment=64)
    bank, offset = page_location(np.arange(7), 1000, dram, base=4096)
    assert bank.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert offset.tolist() == [4096] * 3 + [4096 + 1024] * 3 + [4096 + 2048]
    assert dram.aligned(1088) == 1088 and dram.aligned(1000) == 1024


def test_bad_config_names_the_value():
    with pytest.raises(ValueError, match="num_banks 0"):
        DramConfig(num_banks=0)
    with pytest.raises(ValueError, match="alignment 48"):
        DramConfig(num_banks=8, alignment=48)
    with pytest.raises(ValueError, match="3 bank offsets for 8"):
        DramConfig(num_banks=8, bank_offsets=(0, 0, 0))
    with pytest.raises(ValueError, match=r"\[5, 2\)"):
        bank_shares(5, 2, 4)


@settings(max_examples=80, deadline=None)
@given(p0=st.integers(0, 200), length=st.integers(0, 200), n=st.integers(1, 12))
def test_each_bank_share_is_one_contiguous_slot_range(p0, length, n):
    p1 = p0 + length
    pages = np.arange(p0, p1)
    first, count, slot = bank_shares(p0, p1, n)
    assert count.sum() == length
    for k in range(n):
        mine = pages[pages % n == k]
        assert count[k] == mine.size
        if mine.size:
            assert first[k] == mine[0] and slot[k] == mine[0] // n
            assert np.array_equal(mine // n, slot[k] + np.arange(mine.size))   # contiguous slots
    order = bank_major_order(p0, p1, n)
    assert sorted(order.tolist()) == pages.tolist()
    assert np.array_equal(order, pages[np.lexsort((pages // n, pages % n))])


def test_contiguous_runs():
    assert contiguous_runs([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
    assert contiguous_runs([]) == []
