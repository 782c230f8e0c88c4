"""Shaping: window, rate scale, length caps and sampling change only what they report."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from traces.shaping import ShapeSpec, cap_lengths, sample, scale_rate, shape, window
from traces.trace import Trace
from traces.workloads import poisson_arrivals


def make_trace(arrivals, prompt=None, output=None) -> Trace:
    n = len(arrivals)
    prompt = np.full(n, 100) if prompt is None else prompt
    output = np.full(n, 10) if output is None else output
    return Trace.from_columns(np.asarray(arrivals, float), prompt, output)


def test_window_keeps_half_open_interval_and_rebases():
    trace = make_trace([0.0, 1.0, 2.0, 3.0, 4.0])
    out = window(trace, 1.0, 3.0)
    np.testing.assert_array_equal(out.arrival_at, [0.0, 1.0])
    np.testing.assert_array_equal(out.request_id, [1, 2])
    np.testing.assert_array_equal(window(trace, 2.5).request_id, [3, 4])


def test_scale_rate_two_is_twice_as_fast():
    trace = make_trace([0.0, 1.0, 3.0])
    out = scale_rate(trace, 2.0)
    np.testing.assert_array_equal(out.arrival_at, [0.0, 0.5, 1.5])
    np.testing.assert_array_equal(out.num_prompt_tokens, trace.num_prompt_tokens)
    with pytest.raises(ValueError, match="rate scale must be finite and > 0, got 0"):
        scale_rate(trace, 0)


def test_caps_truncate_counts_each_change():
    trace = make_trace([0, 1, 2, 3], prompt=[10, 5000, 7000, 20], output=[5, 900, 1, 2000])
    out, counts = cap_lengths(trace, max_prompt_tokens=4096, max_output_tokens=1024)
    assert counts == {"num_prompt_capped": 2, "num_output_capped": 1}
    np.testing.assert_array_equal(out.num_prompt_tokens, [10, 4096, 4096, 20])
    np.testing.assert_array_equal(out.num_output_tokens, [5, 900, 1, 1024])


def test_caps_drop_removes_and_counts():
    trace = make_trace([0, 1, 2, 3], prompt=[10, 5000, 7000, 20], output=[5, 900, 1, 2000])
    out, counts = cap_lengths(trace, 4096, 1024, mode="drop")
    assert counts == {"num_dropped_by_caps": 3}
    np.testing.assert_array_equal(out.request_id, [0])
    with pytest.raises(ValueError, match="'clip' is not one of"):
        cap_lengths(trace, 10, mode="clip")


def test_sample_exact_count_is_deterministic_and_ordered():
    trace = make_trace(np.arange(100.0))
    a = sample(trace, np.random.default_rng(3), num_requests=10)
    b = sample(trace, np.random.default_rng(3), num_requests=10)
    np.testing.assert_array_equal(a.request_id, b.request_id)
    assert len(a) == 10 and np.all(np.diff(a.request_id) > 0)
    with pytest.raises(ValueError, match="exactly one"):
        sample(trace, np.random.default_rng(0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thinning_poisson_keeps_it_poisson_at_the_thinned_rate(seed):
    rng = np.random.default_rng(seed)
    trace = make_trace(poisson_arrivals(100.0, 20000, rng))
    out = sample(trace, rng, fraction=0.25)
    gaps = np.diff(out.arrival_at)
    assert np.mean(gaps) == pytest.approx(1 / 25.0, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)   # exponential: CV 1


def test_shape_applies_all_steps_and_reports():
    trace = make_trace(np.arange(20.0), prompt=np.arange(1, 21) * 100)
    spec = ShapeSpec(start_s=5.0, end_s=15.0, rate_scale=2.0, max_prompt_tokens=1200,
                     sample_requests=8, seed=1)
    out, report = shape(trace, spec)
    assert report.num_in == 20 and report.num_outside_window == 10
    assert report.num_sampled_out == 2 and report.num_out == len(out) == 8
    assert report.num_prompt_capped == int(np.sum(trace.num_prompt_tokens[out.request_id] > 1200))
    np.testing.assert_allclose(out.arrival_at, (trace.arrival_at[out.request_id] - 5.0) / 2.0)
    assert "arrivals 2x faster" in report.describe()
    again, _ = shape(trace, spec)
    np.testing.assert_array_equal(again.request_id, out.request_id)


def test_default_spec_changes_nothing():
    trace = make_trace([0.0, 0.5, 2.0], prompt=[1, 2, 3])
    out, report = shape(trace, ShapeSpec())
    np.testing.assert_array_equal(out.arrival_at, trace.arrival_at)
    assert report.describe() == "3 of 3 requests kept"


@pytest.mark.parametrize("kwargs,message", [
    ({"end_s": 0.0}, "end_s must be > start_s"),
    ({"rate_scale": -1.0}, "rate scale"),
    ({"sample_fraction": 1.5}, "sample fraction"),
    ({"max_output_tokens": 0}, "max_output_tokens must be >= 1"),
    ({"cap_mode": "clip"}, "cap_mode 'clip'"),
])
def test_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShapeSpec(**kwargs)


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=50),
       start=st.floats(0, 500), scale=st.floats(0.1, 10), cap=st.integers(1, 500),
       seed=st.integers(0, 5))
def test_shaping_keeps_order_ids_and_conservation(arrivals, start, scale, cap, seed):
    trace = make_trace(sorted(arrivals), prompt=np.arange(1, len(arrivals) + 1) * 17)
    out, report = shape(trace, ShapeSpec(start_s=start, rate_scale=scale, max_prompt_tokens=cap,
                                         sample_fraction=0.5, seed=seed))
    assert report.num_in == report.num_out + report.num_outside_window + report.num_sampled_out
    assert np.all(np.diff(out.arrival_at) >= 0) and np.all(out.arrival_at >= 0)
    assert set(out.request_id) <= set(trace.request_id)
    assert np.all(out.num_prompt_tokens <= cap)
    assert report.num_prompt_capped == int(np.sum(trace.num_prompt_tokens[out.request_id] > cap))
