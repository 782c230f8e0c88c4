"""The simulator against queueing theory, over several seeds (never one pinned seed)."""

import numpy as np
import pytest

from sim.cluster import simulate
from tests.builders import make_trace, queue_cluster

SEEDS = (0, 1, 2, 3)
N = 40_000


def mean_wait(config, options, trace) -> float:
    records = simulate(config, trace, **options).records
    assert (records["status"] == "ok").all()
    return float((records["prefill_start_at"] - records["arrival_at"]).mean())


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_md1_mean_waiting_time(rho):
    """M/D/1: Wq = rho / (2 mu (1 - rho)); service 1 s, one request per batch."""
    config, options = queue_cluster(prefill_fixed_s=1.0)
    waits = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1 / rho, N))
        waits.append(mean_wait(config, options, make_trace(arrivals, [100] * N, [1] * N)))
    theory = rho / (2 * (1 - rho))
    assert np.mean(waits) == pytest.approx(theory, rel=0.03)


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_mm1_mean_waiting_time(rho):
    """M/M/1 via prompt lengths ~ geometric (mean 1000 tokens) at 1 ms/token: Wq by
    Pollaczek-Khinchine with the geometric's exact moments (= rho/(mu - lambda) to 0.1%)."""
    per_token, mean_tokens = 1e-3, 1000.0
    config, options = queue_cluster(prefill_service_per_token=per_token)
    p = 1 / mean_tokens
    es = per_token * mean_tokens
    es2 = per_token**2 * (2 - p) / p**2
    lam = rho / es
    waits = []
    for seed in SEEDS:
        rng = np.random.default_rng(100 + seed)
        arrivals = np.cumsum(rng.exponential(1 / lam, N))
        prompts = rng.geometric(p, N)
        waits.append(mean_wait(config, options, make_trace(arrivals, prompts, [1] * N)))
    theory = lam * es2 / (2 * (1 - rho))
    assert theory == pytest.approx(rho / (1 / es - lam), rel=2e-3)
    assert np.mean(waits) == pytest.approx(theory, rel=0.03)


def test_littles_law_on_the_full_pipeline():
    """L (sampled from the live system) = lambda x W (from the records), within 3%."""
    from sim.config import RunConfig

    config = RunConfig().replace(**{"workload.rate": 1.2, "workload.num_requests": 8000})
    ratios = []
    for seed in (0, 1, 2):
        result = simulate(config.replace(seed=seed), monitor_interval_s=0.25)
        records = result.records
        samples = np.array([count for _, count in result.stats["in_system"]])
        horizon = len(samples) * 0.25
        lam = len(records) / horizon
        w = float((records["finished_at"] - records["arrival_at"]).mean())
        ratios.append(samples.mean() / (lam * w))
    assert np.mean(ratios) == pytest.approx(1.0, rel=0.03)
