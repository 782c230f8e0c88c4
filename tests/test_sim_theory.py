"""The simulator against queueing theory, over several seeds (never one pinned seed)."""

import numpy as np
import pytest

from sim.engine.cluster import simulate
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


def _roofline(device: str, **eff_changes):
    from dataclasses import replace

    from hardware import catalog
    from sim.models.predictor import RooflinePredictor, load_profile

    eff = replace(load_profile("paper")[device], **eff_changes)
    return RooflinePredictor(catalog.model("llama-3.1-70b"), catalog.device(device), 4, eff,
                             "bfloat16", "fp8"), eff


def test_prefill_counts_tensor_parallel_communication_once():
    """Prefill = max(compute, memory) + all-reduces + overhead: the all-reduce term is the only
    communication, so changing its bus bandwidth changes the time by exactly its own change,
    and the compute efficiency is the kernels' own (not a fitted 17.5%)."""
    pred, eff = _roofline("a100-pcie")
    assert eff.prefill_compute_efficiency >= 0.5
    slow, _ = _roofline("a100-pcie", allreduce_bus_gb_s=eff.allreduce_bus_gb_s / 2)
    n = 2000
    gained = slow.prefill_time([n]) - pred.prefill_time([n])
    assert gained == pytest.approx(slow.allreduce_time(n) - pred.allreduce_time(n), rel=1e-9)
    message = n * 8192 * 2.0
    ring = 2 * 3 / 4 * message / (eff.allreduce_bus_gb_s * 1e9)
    assert pred.allreduce_time(n) == pytest.approx(2 * 80 * (eff.allreduce_latency_s + ring))


def test_npu_decode_step_grows_with_batch_and_each_requests_context():
    """Decode step = fixed per-step costs + max(compute, weights + every request's KV reads):
    at a fixed batch it grows linearly with total context at the attention's KV-read rate."""
    pred, eff = _roofline("p150a")
    b = 32
    t1, t2 = pred.decode_step_time(b, b * 1000), pred.decode_step_time(b, b * 3000)
    kv_rate = 4 * 512e9 * (eff.decode_attention_efficiency or eff.decode_memory_efficiency)
    assert t2 - t1 == pytest.approx(b * 2000 * pred._kv_per_token / kv_rate, rel=1e-9)
    assert pred.decode_step_time(1, 1000) < pred.decode_step_time(b, b * 1000)
    slower, _ = _roofline("p150a", decode_attention_efficiency=0.05)
    assert slower.decode_step_time(b, b * 3000) > pred.decode_step_time(b, b * 3000)
