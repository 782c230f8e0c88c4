"""Sweeps, comparisons and plans run in this process, on a process pool or on a local Ray
cluster with the same results."""

import json

import pytest

from sim.runs import compare as cmp
from sim.config import RunConfig
from sim.runs.sweep import run_parallel, sweep
from traces.jsonout import dumps

CONFIG = RunConfig().replace(**{"workload.num_requests": 80})


def _same(points):
    """Summaries as comparable text, without the wall time each run measured."""
    return [dumps({k: v for k, v in p.summary.items() if k != "sim_wall_time_s"})
            for p in points]


def test_a_process_pool_gives_the_points_of_a_serial_sweep_in_order():
    serial = sweep(CONFIG, [0.4, 1.2], [0, 1], workers=1, progress=False)
    pooled = sweep(CONFIG, [0.4, 1.2], [0, 1], workers=2, progress=False)
    assert [(p.rate, p.seed) for p in pooled] == [(0.4, 0), (0.4, 1), (1.2, 0), (1.2, 1)]
    assert _same(pooled) == _same(serial)
    assert len(set(_same(serial))) == 4                   # the points do differ


def test_a_local_ray_cluster_gives_the_same_sweep_and_comparison():
    ray = pytest.importorskip("ray")
    serial = sweep(CONFIG, [0.4, 1.2], [0], workers=1, progress=False)
    base = CONFIG.replace(**{"cluster.prefill.max_batch_tokens": 2048})
    cand = base.replace(**{"cluster.policies.prefill_batching": "shortest_prompt_first"})
    inputs = cmp.Inputs(workload="chatbot", rate=1.0, num_requests=80)
    local = cmp.run_pairs(base, cand, inputs, repeats=2, workers=1, progress=False)
    try:
        on_ray = sweep(CONFIG, [0.4, 1.2], [0], workers=2, progress=False, ray_address="local")
        pairs = cmp.run_pairs(base, cand, inputs, repeats=2, workers=2, progress=False,
                              ray_address="local")
    finally:
        ray.shutdown()
    assert _same(on_ray) == _same(serial)
    for (b1, c1), (b2, c2) in zip(local, pairs):
        assert b1[0].equals(b2[0]) and c1[0].equals(c2[0])   # identical records


def test_run_parallel_keeps_the_order_of_its_jobs():
    assert run_parallel(abs, [-3, 1, -2], workers=2, progress=False) == [3, 1, 2]
    assert json.loads(dumps(run_parallel(abs, [], workers=1, progress=False))) == []
