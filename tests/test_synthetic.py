"""Synthetic workloads: arrival processes against theory, length sources, determinism."""

import numpy as np
import pytest
import scipy.stats

from traces.bundled import data_dir
from traces.synthetic import (ArrivalSpec, EmpiricalLengths, FittedLengths, WorkloadLengths,
                              arrival_times, fit_lengths, synthesize)

DATA = data_dir()                   # traces/data/, shipped with the package
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_gaps_have_the_chosen_mean_and_cv(cv):
    for seed in SEEDS:
        times = arrival_times(ArrivalSpec("gamma", rate=50.0, cv=cv), 20000,
                              np.random.default_rng(seed))
        gaps = np.diff(times)
        assert np.mean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(cv, rel=0.08)


def test_poisson_counts_have_poisson_dispersion():
    for seed in SEEDS:
        times = arrival_times(ArrivalSpec("poisson", rate=20.0), 40000,
                              np.random.default_rng(seed))
        counts = np.bincount(times.astype(int))[:-1]        # whole seconds only
        assert np.mean(counts) == pytest.approx(20.0, rel=0.03)
        assert np.var(counts) / np.mean(counts) == pytest.approx(1.0, abs=0.15)


def test_onoff_is_silent_when_off_and_keeps_the_mean_rate():
    spec = ArrivalSpec("onoff", rate=100.0, on_s=2.0, off_s=3.0)
    assert spec.mean_rate == pytest.approx(40.0)
    for seed in SEEDS:
        times = arrival_times(spec, 20000, np.random.default_rng(seed))
        phase = np.mod(times, 5.0)
        assert np.all(phase < 2.0)                          # nothing in an off-period
        assert len(times) / times[-1] == pytest.approx(40.0, rel=0.05)
        counts = np.bincount(times.astype(int))[:-1]
        assert np.var(counts) / np.mean(counts) > 5           # bursty: far above Poisson's 1


def test_duration_mode_fills_the_whole_window():
    for kind in ("poisson", "gamma", "onoff"):
        spec = ArrivalSpec(kind, rate=30.0, cv=3.0, on_s=1.0, off_s=1.0)
        trace = synthesize(spec, WorkloadLengths("chatbot"), duration_s=200.0, seed=4)
        assert trace.arrival_at[-1] < 200.0
        assert len(trace) == pytest.approx(spec.mean_rate * 200.0, rel=0.2)
        assert trace.arrival_at[-1] > 190.0


def test_same_seed_same_trace_and_different_seed_differs():
    spec = ArrivalSpec("gamma", rate=10.0, cv=2.0)
    a = synthesize(spec, WorkloadLengths("summarization"), num_requests=500, seed=7)
    b = synthesize(spec, WorkloadLengths("summarization"), num_requests=500, seed=7)
    c = synthesize(spec, WorkloadLengths("summarization"), num_requests=500, seed=8)
    np.testing.assert_array_equal(a.arrival_at, b.arrival_at)
    np.testing.assert_array_equal(a.num_output_tokens, b.num_output_tokens)
    assert not np.array_equal(a.arrival_at, c.arrival_at)
    assert np.all((a.num_prompt_tokens >= 1900) & (a.num_prompt_tokens <= 2040))


def test_empirical_lengths_keep_pairs():
    table = EmpiricalLengths.from_workload("chatbot")
    prompt, output = table.sample(2000, np.random.default_rng(0))
    pairs = set(zip(table.prompt.tolist(), table.output.tolist()))
    assert all(pair in pairs for pair in zip(prompt.tolist(), output.tolist()))
    assert np.mean(prompt) == pytest.approx(743, rel=0.1)   # the table's documented mean


def test_empirical_lengths_from_the_bundled_csv_match_the_documented_table():
    path = DATA / "sharegpt-chatbot-lengths.csv"
    with pytest.raises(ValueError, match=r"line \d+: field 'output_tokens': must be >= 1"):
        EmpiricalLengths.from_csv(path)                     # the table has zero-token rows
    table = EmpiricalLengths.from_csv(path, skip_bad=True)
    assert 13_200 < len(table.prompt) < 13_303
    assert np.mean(table.prompt) == pytest.approx(743, rel=0.02)


def test_fitted_lognormal_recovers_its_parameters():
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        prompt = scipy.stats.lognorm.rvs(0.8, scale=600, size=20000, random_state=rng)
        output = scipy.stats.lognorm.rvs(1.2, scale=100, size=20000, random_state=rng)
        fitted = fit_lengths(prompt, output, "lognorm")
        assert fitted.prompt_params[0] == pytest.approx(0.8, rel=0.03)
        assert fitted.prompt_params[2] == pytest.approx(600, rel=0.03)
        assert fitted.output_params[0] == pytest.approx(1.2, rel=0.03)


def test_fitted_lengths_are_integers_at_least_one_and_deterministic():
    fitted = FittedLengths("expon", (0.0, 3.0), (0.0, 0.5))
    a = fitted.sample(5000, np.random.default_rng(1))
    b = fitted.sample(5000, np.random.default_rng(1))
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].dtype == np.int64 and a[1].min() >= 1
    assert np.mean(a[0]) == pytest.approx(3.0 + 0.5, rel=0.05)    # ceil adds half a token


def test_fit_to_a_real_table_then_synthesize():
    table = EmpiricalLengths.from_workload("chatbot")
    fitted = fit_lengths(table.prompt, table.output, "gamma")
    trace = synthesize(ArrivalSpec("poisson", rate=5.0), fitted, num_requests=3000, seed=0)
    assert np.mean(trace.num_prompt_tokens) == pytest.approx(np.mean(table.prompt), rel=0.1)


@pytest.mark.parametrize("build,message", [
    (lambda: ArrivalSpec("weibull"), "arrival kind 'weibull' is not one of"),
    (lambda: ArrivalSpec("gamma", cv=0.0), "cv must be finite and > 0, got 0.0"),
    (lambda: ArrivalSpec(rate=-1.0), "rate must be finite and > 0"),
    (lambda: ArrivalSpec("onoff", off_s=-1.0), "off_s must be finite and >= 0"),
    (lambda: FittedLengths("normal", (), ()), "family 'normal'"),
    (lambda: EmpiricalLengths(np.array([1, 0]), np.array([1, 1])), "row 1: prompt length 0"),
    (lambda: fit_lengths([1.0, -2.0], [1.0, 2.0]), "prompt lengths must be"),
    (lambda: synthesize(ArrivalSpec(), WorkloadLengths("chatbot")), "exactly one"),
    (lambda: WorkloadLengths("coding"), "unknown workload 'coding'"),
])
def test_bad_configuration_is_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()
