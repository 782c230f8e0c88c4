"""Batching decisions as closed forms over a grid of queue states (``policies.batching``)."""

from __future__ import annotations

import itertools

from policies.batching import chunked_prefill, fcfs_decode_admit


def test_decode_admission_fills_the_free_slots_and_never_goes_negative():
    for waiting, running, size in itertools.product(range(6), range(10), range(1, 8)):
        assert fcfs_decode_admit(waiting, running, size) == max(0, min(waiting, size - running))
    assert fcfs_decode_admit(3, 9, 8) == 0           # over its size (a shrunk batch): none join


def test_chunked_prefill_splits_at_the_budget_and_stops_at_the_blocks():
    prompts = [600, 900, 300, 17]
    # request 1 is half done: it needs no blocks, and its 450 remaining tokens fit the budget
    assert chunked_prefill([0, 1, 2, 3], prompts, {1: 450}, 8, 1200, 1000, 16) == [
        (0, 600), (1, 450), (2, 150)]
    assert chunked_prefill([0, 1, 2, 3], prompts, {}, 8, 2048, 38 + 57, 16) == [
        (0, 600), (1, 900)]                          # request 2's 19 blocks do not fit
    assert chunked_prefill([0, 1, 2, 3], prompts, {}, 2, 4096, 1000, 16) == [(0, 600), (1, 900)]
    assert chunked_prefill([], prompts, {}, 8, 2048, 1000, 16) == []
