"""The knee search by simulation (sim/runs/knee.py) against a known threshold: a predicate that
meets the target below ``KNEE`` req/s and misses above, with a log of the rates it was asked."""

import math

import pytest

from sim.runs.knee import bisect_knee, bracket_knee, search_knee

KNEE = 3.0


@pytest.fixture
def log():
    return []


@pytest.fixture
def meets(log):
    def meets(rate: float) -> bool:
        log.append(rate)
        return rate <= KNEE
    return meets


def test_bisection_uses_geometric_midpoints_and_keeps_a_passing_lower_end(meets, log):
    lo, hi = bisect_knee(meets, 2.0, 8.0, steps=2)
    assert log == [4.0, pytest.approx(math.sqrt(8.0))]      # sqrt(2 * 8), then sqrt(2 * 4)
    assert (lo, hi) == (pytest.approx(math.sqrt(8.0)), 4.0)
    assert lo <= KNEE < hi


def test_bisection_from_zero_halves_until_a_rate_meets(meets, log):
    lo, hi = bisect_knee(meets, 0.0, 16.0, steps=3)
    assert log[:2] == [8.0, 4.0]                            # no rate known to meet: halve
    assert log[2] == 2.0 and (lo, hi) == (2.0, 4.0)
    assert bisect_knee(lambda r: False, 0.0, 1.0, steps=3) == (0.0, 0.125)   # none meets


def test_a_bad_bracket_is_named():
    for lo, hi in ((2.0, 1.0), (-1.0, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError, match="knee bracket needs 0 <= lo < hi < inf"):
            bisect_knee(lambda r: True, lo, hi, steps=1)


def test_bracket_doubles_up_or_halves_down_to_a_factor_of_two(meets, log):
    assert bracket_knee(meets, 1.0) == (2.0, 4.0) and log == [1.0, 2.0, 4.0]
    log.clear()
    assert bracket_knee(meets, 10.0) == (2.5, 5.0) and log == [10.0, 5.0, 2.5]


def test_search_returns_the_highest_rate_found_to_meet(meets):
    for start in (0.01, 1.0, 7.0, 300.0):
        knee = search_knee(meets, start, steps=8)
        assert knee <= KNEE < knee * 2 ** (2 ** -8) * (1 + 1e-12)
        assert meets(knee)


def test_search_says_when_every_or_no_rate_meets():
    assert search_knee(lambda r: True, 1.0, steps=4) == math.inf
    assert math.isnan(search_knee(lambda r: False, 1.0, steps=4))
    with pytest.raises(ValueError, match="starts at a rate > 0"):
        search_knee(lambda r: True, 0.0, steps=4)
