"""Cells that stream (sim.runs.cells.stream): each cell writes its own part of the records dataset,
the parent merges the cells' aggregates; the records are the in-memory cells run's, counts
exact and percentiles within the sketches' bound."""

import json

import pandas as pd
import pytest

import sim.runs.cells.run
from sim.runs.cells.run import CellError, cell_of, simulate_cells
from sim.runs.cells.stream import simulate_cells_streamed
from sim.commands.main import main
from sim.config import RunConfig
from sim.engine.stream import Stream
from tests.builders import assert_sketched_percentiles
from tests.test_cells import _lopsided_trace
from traces.jsonout import dumps
from traces.loaders import load_trace
from traces.schema import read_records
from traces.synthetic import bursty_customers
from traces.trace_stream import TraceStream, stream_source

SMALL = Stream(rows_per_group=150, chunk_size=64)
#: 3 cells of one prefill and one decode instance each, loaded past the knee (queues form)
CELLS3 = RunConfig().replace(**{"cells.count": 3, "cells.instances": "per-cell",
                                "workload.num_requests": 1500, "workload.rate": 3.0})


def run(config, tmp_path, name, requests=None, stream=SMALL, **kw):
    path = tmp_path / name / "records.parquet"
    path.parent.mkdir()
    if stream is None:
        result = simulate_cells(config, requests, records_path=path, **kw)
    else:
        result = simulate_cells_streamed(config, requests, stream, records_path=path, **kw)
    records = read_records(path)
    if stream is not None:
        records = records.sort_values("request_id").reset_index(drop=True)
    return result, records


def test_streamed_cells_write_the_in_memory_cells_records(tmp_path, monkeypatch):
    exact, expected = run(CELLS3, tmp_path, "memory", stream=None, workers=1)
    monkeypatch.setattr(sim.runs.cells.run, "merge_records", None)       # the parent merges no records
    streamed, records = run(CELLS3, tmp_path, "stream", workers=1)
    pd.testing.assert_frame_equal(records, expected)
    parts = sorted(p.name for p in (tmp_path / "stream" / "records.parquet").iterdir())
    assert parts == ["cell-0000.parquet", "cell-0001.parquet", "cell-0002.parquet"]
    assert streamed.summary["cells"] == exact.summary["cells"]


def test_merged_aggregates_count_exactly_and_bound_the_percentiles(tmp_path):
    exact, records = run(CELLS3, tmp_path, "memory", stream=None, workers=1)
    streamed, _ = run(CELLS3, tmp_path, "stream", workers=1)
    s, e = streamed.summary, exact.summary
    for key in ("num_requests", "num_finished", "num_failed", "num_unfinished", "statuses",
                "slo_attainment", "kv_bytes_total", "simulated_time_s", "prefill_utilization",
                "decode_utilization"):
        assert s[key] == e[key], key
    for key in ("ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "output_tokens_per_s",
                "decode_occupancy", "energy_j", "ttft_queue_mean_s"):
        assert s[key] == pytest.approx(e[key], rel=1e-9), key
    for key, lower in assert_sketched_percentiles(s, records).items():
        assert s[key] != e[key] or lower == e[key]        # sketched, not the exact value
    assert "percentiles" not in e


def test_serial_and_pool_give_the_same_records_and_summary_bytes(tmp_path):
    serial, a = run(CELLS3, tmp_path, "serial", workers=1)
    pooled, b = run(CELLS3, tmp_path, "pooled", workers=2)
    assert dumps(serial.summary) == dumps(pooled.summary)
    pd.testing.assert_frame_equal(a, b)
    assert pooled.timing["streamed"]


def test_tenants_merge_per_tenant(tmp_path):
    trace = bursty_customers(rate=3.0, duration_s=300.0, seed=2)
    exact, records = run(CELLS3, tmp_path, "memory", trace, stream=None, workers=1)
    streamed, got = run(CELLS3, tmp_path, "stream", trace, workers=1)
    pd.testing.assert_frame_equal(got, records)
    s, e = streamed.summary["tenants"], exact.summary["tenants"]
    assert sorted(s) == sorted(e)
    for tenant in e:
        for key in ("num_requests", "num_failed", "slo_attainment"):
            assert s[tenant][key] == e[tenant][key], (tenant, key)


def test_cells_read_a_streamed_trace_file_each_for_itself(tmp_path):
    trace = bursty_customers(num_quiet=1, rate=3.0, duration_s=200.0, seed=4)
    path = tmp_path / "trace.csv"
    trace.to_frame().to_csv(path, index=False)
    mapping = {"request_id": "request_id"}
    source = stream_source(TraceStream(path, mapping=mapping, block_rows=50), chunk_size=64)
    loaded, _ = load_trace(path, mapping=mapping)          # re-based to its first arrival
    _, expected = run(CELLS3, tmp_path, "memory", loaded, stream=None, workers=1)
    _, records = run(CELLS3, tmp_path, "file", source, workers=2)
    pd.testing.assert_frame_equal(records, expected)


def test_a_failing_streamed_cell_is_named_and_marks_the_dataset_incomplete(tmp_path):
    config = RunConfig().replace(**{"cells.count": 4, "cells.instances": "per-cell",
                                    "cluster.prefill.num_instances": 2,
                                    "cluster.routing": "tests.test_cells:explode_after_20"})
    path = tmp_path / "records.parquet"
    with pytest.raises(CellError, match=r"cell 2 of 4 \(30 requests, seed \d+\) failed: "
                                        r"RuntimeError: routing table corrupt"):
        simulate_cells_streamed(config, _lopsided_trace(), SMALL, workers=1, records_path=path)
    with pytest.raises(ValueError, match="records are incomplete .*cell 2 of 4"):
        read_records(path)


def test_hawk_simulate_cells_stream_writes_parts_and_a_sketched_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--cells", "2", "--cell-instances", "per-cell", "--workers", "2",
                 "--num-requests", "300", "--rate", "2", "--stream", "--out", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 300 and "relative_accuracy" in summary["percentiles"]
    records = read_records(out / "records.parquet")
    assert len(records) == 300 and set(records["cell"]) == {0, 1}
    assert (records["cell"].to_numpy() == cell_of(records["request_id"].to_numpy(), 2)).all()
    assert json.loads((out / "cells.json").read_text())["streamed"]


def test_on_ray_the_records_and_summary_are_the_pools(tmp_path):
    ray = pytest.importorskip("ray")
    pooled, a = run(CELLS3, tmp_path, "pooled", workers=2)
    try:
        on_ray, b = run(CELLS3, tmp_path, "ray", workers=2, ray_address="local")
    finally:
        ray.shutdown()
    assert dumps(on_ray.summary) == dumps(pooled.summary)
    pd.testing.assert_frame_equal(a, b)
    assert on_ray.timing["backend"] == "ray"
