"""Cells: a cluster as independent router domains, run serially, on a pool or on Ray, with
the same merged records and summary; the split rule; refusals and a failing cell."""

import json

import numpy as np
import pandas as pd
import pytest

from sim.runs.cells.run import (CellError, cell_of, cell_seed, instances_per_cell, simulate_cells,
                       split_trace)
from sim.runs.cells.summary import summarize_file
from sim.commands.main import main
from sim.engine.cluster import simulate
from sim.config import ConfigError, RunConfig
from tests.builders import make_trace, random_trace
from traces import metrics
from traces.jsonout import dumps
from traces.schema import read_records
from traces.tenants import by_tenant
from traces.workloads import make_workload

#: 4 cells of one prefill and one decode instance each, loaded near the single cell's knee
CELLS4 = RunConfig().replace(**{"cells.count": 4, "cells.instances": "per-cell",
                                "workload.num_requests": 240, "workload.rate": 2.0})


def _run(config, tmp_path, name, **kwargs):
    path = tmp_path / f"{name}.parquet"
    result = simulate_cells(config, records_path=path, **kwargs)
    return path.read_bytes(), dumps(result.summary), result


def test_serial_pool_and_ray_give_the_same_records_and_summary_bytes(tmp_path):
    ray = pytest.importorskip("ray")
    serial = _run(CELLS4, tmp_path, "serial", workers=1)
    pooled = _run(CELLS4, tmp_path, "pooled", workers=2)
    try:
        on_ray = _run(CELLS4, tmp_path, "ray", workers=2, ray_address="local")
    finally:
        ray.shutdown()
    assert pooled[:2] == serial[:2]
    assert on_ray[:2] == serial[:2]
    assert on_ray[2].timing["backend"] == "ray"
    records = pd.read_parquet(tmp_path / "serial.parquet")
    assert len(records) == 240 and records["cell"].nunique() == 4


def test_merged_records_are_every_cells_records_sorted_by_request_id(tmp_path):
    trace = make_workload("chatbot", 2.0, 240, seed=3)
    _run(CELLS4, tmp_path, "merged", trace=trace, workers=1)
    merged = pd.read_parquet(tmp_path / "merged.parquet")
    assert merged["request_id"].tolist() == sorted(trace.request_id.tolist())
    assert (merged["cell"].to_numpy() == cell_of(merged["request_id"].to_numpy(), 4)).all()
    # cell c's instances are numbered c * per_cell + local (one of each per cell here)
    assert (merged["prefill_instance"] == merged["cell"]).all()
    assert (merged["decode_instance"] == merged["cell"]).all()
    # each cell is the plain simulation of its share, under its own seed
    for k, share in enumerate(split_trace(trace, 4)):
        alone = simulate(CELLS4.replace(**{"cells.count": 1, "seed": cell_seed(0, k)}), share)
        mine = merged[merged["cell"] == k].drop(columns=["cell", "prefill_instance",
                                                         "decode_instance"])
        expect = alone.records.sort_values("request_id").drop(
            columns=["prefill_instance", "decode_instance"])
        pd.testing.assert_frame_equal(mine.reset_index(drop=True), expect.reset_index(drop=True),
                                      check_dtype=False)


def test_the_streamed_summary_equals_metrics_over_all_records(tmp_path):
    from traces.synthetic import bursty_customers

    trace = bursty_customers(rate=2.0, duration_s=200, seed=1)       # with tenants
    _, _, result = _run(CELLS4, tmp_path, "tenants", trace=trace, workers=1)
    records = read_records(tmp_path / "tenants.parquet")
    expect = metrics.summarize(records, 2.0, 0.2)
    assert dumps({k: result.summary[k] for k in expect}) == dumps(expect)
    assert dumps(result.summary["tenants"]) == dumps(by_tenant(records, 2.0, 0.2))
    assert result.summary["num_requests"] == len(trace)
    assert sum(result.summary["cells"]["num_requests"]) == len(trace)
    one = summarize_file(tmp_path / "tenants.parquet", 2.0, 0.2, tenant="bursty")
    assert dumps(one) == dumps(metrics.summarize(records[records["tenant"] == "bursty"],
                                                 2.0, 0.2))


def test_the_split_puts_every_request_in_exactly_one_cell_by_its_id_alone():
    trace = random_trace(np.random.default_rng(0), 5000, rate=10.0)
    shares = split_trace(trace, 7)
    ids = np.concatenate([s.request_id for s in shares])
    assert sorted(ids.tolist()) == trace.request_id.tolist()         # complete, no repeats
    for k, share in enumerate(shares):
        assert (cell_of(share.request_id, 7) == k).all()
        assert (np.diff(share.arrival_at) >= 0).all()               # arrival order kept
    # deterministic, and a request's cell does not depend on the other requests
    assert all((a.request_id == b.request_id).all()
               for a, b in zip(shares, split_trace(trace, 7)))
    half = trace.select(slice(0, 2500))
    assert (cell_of(half.request_id, 7) == cell_of(trace.request_id, 7)[:2500]).all()
    assert cell_seed(0, 3) == cell_seed(0, 3)
    assert len({cell_seed(s, k) for s in range(3) for k in range(16)}) == 48


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_cell_sees_poisson_arrivals_at_its_share_of_the_rate(seed):
    """Thinning by a hash keeps Poisson arrivals Poisson (interarrival CV 1, mean C/rate);
    round-robin on arrival order would make them Erlang-C (CV 1/sqrt(C) = 0.5 here)."""
    rate, count = 20.0, 4
    trace = random_trace(np.random.default_rng(seed), 40_000, rate)
    for share in split_trace(trace, count):
        gaps = np.diff(share.arrival_at)
        assert gaps.mean() == pytest.approx(count / rate, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    round_robin = np.diff(trace.arrival_at[::count])
    assert round_robin.std() / round_robin.mean() == pytest.approx(0.5, abs=0.05)


def test_a_split_that_does_not_divide_the_instances_is_refused(capsys):
    with pytest.raises(ConfigError, match=r"cells.count = 3 does not divide "
                                          r"cluster.decode.num_instances = 4"):
        RunConfig().replace(**{"cells.count": 3, "cluster.prefill.num_instances": 3,
                               "cluster.decode.num_instances": 4})
    config = RunConfig().replace(**{"cells.count": 2, "cluster.prefill.num_instances": 4,
                                    "cluster.decode.num_instances": 6})
    assert instances_per_cell(config) == (2, 3)
    assert main(["simulate", "--cells", "4", "--num-requests", "10"]) == 2
    assert "--cell-instances per-cell" in capsys.readouterr().err
    assert main(["simulate", "--workers", "2", "--num-requests", "10"]) == 2
    assert "give --cells N" in capsys.readouterr().err


def test_an_instance_loss_is_held_by_the_cell_of_that_global_instance(tmp_path):
    config = CELLS4.replace(**{"faults.instance_loss": [[3, 30.0]]})
    _run(config, tmp_path, "loss", workers=1)
    records = pd.read_parquet(tmp_path / "loss.parquet")
    lost = records[records["status"] == "failed_instance_lost"]
    assert len(lost) > 0 and (lost["decode_instance"] == 3).all() and (lost["cell"] == 3).all()
    with pytest.raises(ConfigError, match=r"decode_index 4, but the 4 cells have 4"):
        simulate_cells(CELLS4.replace(**{"faults.instance_loss": [[4, 30.0]]}), workers=1)


def explode_after_20(loads, free_blocks, counter):
    """A routing policy that fails on a cell's 21st request."""
    if counter >= 20:
        raise RuntimeError("routing table corrupt")
    return counter % len(loads)


def _lopsided_trace():
    """30 requests in cell 2 of 4 and 5 in each other cell."""
    ids, want = [], {0: 5, 1: 5, 2: 30, 3: 5}
    for rid in range(10_000):
        k = int(cell_of(np.array([rid]), 4)[0])
        if want[k]:
            want[k] -= 1
            ids.append(rid)
    n = len(ids)
    trace = make_trace(np.arange(n) * 0.5, [200] * n, [20] * n)
    return type(trace)(trace.arrival_at, trace.num_prompt_tokens, trace.num_output_tokens,
                       np.array(ids), name="lopsided")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_cell_is_named_and_stops_the_run(workers):
    config = CELLS4.replace(**{"cluster.prefill.num_instances": 2,
                               "cluster.routing": "tests.test_cells:explode_after_20"})
    with pytest.raises(CellError, match=r"cell 2 of 4 \(30 requests, seed \d+\) failed: "
                                        r"RuntimeError: routing table corrupt \(at "
                                        r"test_cells.py:\d+ in explode_after_20\)"):
        simulate_cells(config, _lopsided_trace(), workers=workers)


def test_hawk_simulate_cells_writes_merged_records_and_a_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--cells", "2", "--cell-instances", "per-cell", "--workers", "2",
                 "--num-requests", "60", "--rate", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefill 2x(4x a100-pcie) -> decode 2x(4x p150a)" in text
    assert "cells: 2 of 1 prefill + 1 decode instances" in text
    records = pd.read_parquet(out / "records.parquet")
    assert len(records) == 60 and set(records["cell"]) == {0, 1}
    read = read_records(out / "records.parquet")
    assert read["request_id"].is_monotonic_increasing
    assert (read["cell"].to_numpy() == cell_of(read["request_id"].to_numpy(), 2)).all()
    assert (out / "summary.json").exists() and (out / "cells.json").exists()


def exit_after_20(loads, free_blocks, counter):
    """A routing policy whose process dies on a cell's 21st request."""
    if counter >= 20:
        import os

        os._exit(3)
    return counter % len(loads)


def test_a_worker_that_dies_is_reported_with_the_cells_it_was_running():
    config = CELLS4.replace(**{"cluster.prefill.num_instances": 2,
                               "cluster.routing": "tests.test_cells:exit_after_20"})
    with pytest.raises(CellError, match=r"a worker process died while running cells \[.*2.*\]"):
        simulate_cells(config, _lopsided_trace(), workers=2)


def test_cells_without_requests_count_as_idle_instances():
    trace = make_trace([0.0, 1.0, 2.0], [100, 200, 300], [5, 5, 5])
    result = simulate_cells(CELLS4, trace, workers=1)
    cells = result.summary["cells"]
    assert sum(cells["num_requests"]) == 3 and 0 in cells["num_requests"]
    busy = [simulate(CELLS4.replace(**{"cells.count": 1}), share).stats["prefill_busy_s"][0]
            for share in split_trace(trace, 4) if len(share)]
    span = result.summary["simulated_time_s"]
    assert result.summary["prefill_utilization"] == pytest.approx(sum(busy) / 4 / span)


def test_the_cells_benchmark_times_each_worker_count_on_the_same_run(capsys):
    from sim.bench import cells as cells_bench

    assert cells_bench.main(["--num-requests", "120", "--cells", "2", "--workers", "1,2",
                             "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    one, two = report["runs"]
    assert (one["workers"], two["workers"]) == (1, 2) and one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(one["wall_time_s"] / two["wall_time_s"])
    assert one["num_requests"] == two["num_requests"] == 120
    assert one["slo_attainment"] == two["slo_attainment"]       # the same run, either way
    assert not report["streamed"] and not one["streamed"]


def test_the_cells_benchmark_streams_every_cell_when_asked(capsys):
    from sim.bench import cells as cells_bench

    args = ["--num-requests", "120", "--cells", "2", "--workers", "1", "--json"]
    assert cells_bench.main(args) == 0
    whole = json.loads(capsys.readouterr().out)
    assert cells_bench.main(args + ["--stream"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["streamed"] and streamed["runs"][0]["streamed"]
    assert streamed["runs"][0]["merge_s"] == 0.0                 # aggregates, no records merged
    # the same requests and outcomes: attainment is an exact count either way
    assert streamed["runs"][0]["num_requests"] == whole["runs"][0]["num_requests"] == 120
    assert streamed["runs"][0]["slo_attainment"] == whole["runs"][0]["slo_attainment"]


def test_a_config_of_cells_is_refused_by_the_one_domain_simulate():
    # sweep, compare and plan call simulate(); a config of cells must not quietly run one cell.
    with pytest.raises(ConfigError, match=r"cells.count = 4: .*simulate_cells"):
        simulate(CELLS4, make_trace([0.0], [10], [5]))
