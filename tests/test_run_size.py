"""Work that cannot finish in reason is refused up front, with its estimate and the way out."""

import pytest

from sim.config import ConfigError, WorkloadConfig
from sim.config.run_size import (SECONDS_PER_REQUEST, check_run_time, describe_duration,
                                 estimated_wall_s)


def test_a_duration_at_a_rate_past_the_request_limit_is_refused_without_counting():
    # rate 1e6 for 1e9 s: 1e15 arrivals, which the generator used to count one by one
    with pytest.raises(ConfigError, match=r"rate 1e\+06 x duration_s 1e\+09 = 1e\+15 requests"):
        WorkloadConfig(rate=1e6, duration_s=1e9, num_requests=None)
    # a count that bounds the run first keeps it small
    assert WorkloadConfig(rate=1e6, duration_s=1e9, num_requests=1000).num_requests == 1000
    assert WorkloadConfig(rate=2.0, duration_s=100.0, num_requests=None).duration_s == 100.0


def test_the_wall_time_estimate_grows_with_the_requests_and_names_the_flag():
    assert estimated_wall_s(2e6) - estimated_wall_s(1e6) == pytest.approx(1e6 * SECONDS_PER_REQUEST)
    assert check_run_time(1e6, max_wall_s=3600) == pytest.approx(estimated_wall_s(1e6))
    with pytest.raises(ConfigError) as err:
        check_run_time(1e8, max_wall_s=1800, what="hawk simulate")
    text = str(err.value)
    assert "100,000,000 simulated requests would take about 41.7 min" in text
    assert "past the 30.0 min limit" in text and "--max-wall-s" in text
    assert check_run_time(1e8, max_wall_s=None) > 1800           # no limit: the estimate only


def test_durations_read_as_people_say_them():
    assert describe_duration(42) == "42 s"
    assert describe_duration(600) == "10.0 min"
    assert describe_duration(5400) == "90.0 min"
    assert describe_duration(3 * 86400) == "3.0 days"


def test_a_sweep_of_more_rates_than_a_sweep_may_have_is_refused_before_listing_them():
    from sim.runs.sweep import MAX_POINTS, parse_rates

    with pytest.raises(ConfigError, match=r"999,999,900,001 rates, more than the 10,000"):
        parse_rates("0.1:1e6:1e-6")                     # a list of 1e12 floats before
    with pytest.raises(ConfigError, match="more than the 10,000"):
        parse_rates(",".join(["1"] * (MAX_POINTS + 1)))
    assert len(parse_rates(f"1:{MAX_POINTS}:1")) == MAX_POINTS
