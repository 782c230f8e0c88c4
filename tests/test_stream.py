"""Streaming runs (sim.engine.stream): the records of the in-memory run, in bounded state.

Each streamed run uses tiny chunks and row groups, so a few thousand requests go through
hundreds of loads and write-outs."""

import math

import numpy as np
import pandas as pd
import pytest

from sim.engine.cluster import simulate
from sim.config import ConfigError
from sim.config.run_size import run_bytes
from sim.engine.stream import STREAM_MIN_REQUESTS, Stream, StreamLedger, use_streaming
from traces.aggregate import RecordsAggregate
from traces.chunks import trace_source, workload_source
from traces.record_stream import INCOMPLETE, RecordWriter
from traces.schema import read_records, write_records
from traces.synthetic import bursty_customers
from traces.workloads import make_workload
from tests.builders import assert_sketched_percentiles, make_config

SMALL = dict(rows_per_group=300, chunk_size=128)


def streamed(config, tmp_path, trace=None, name="records.parquet", **kw):
    """A streamed run and its records read back, sorted by request id."""
    path = tmp_path / name
    result = simulate(config, trace, stream=Stream(path, **SMALL), **kw)
    assert result.records is None
    records = read_records(path).sort_values("request_id").reset_index(drop=True)
    return result, records


def same_bytes(a, b, tmp_path) -> bool:
    write_records(a, tmp_path / "a.parquet")
    write_records(b, tmp_path / "b.parquet")
    return (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


@pytest.mark.parametrize("name, rate, num, duration, seed", [
    ("chatbot", 2.0, 10_000, None, 3), ("summarization", 0.7, None, 3000.0, 1),
    ("chatbot", 5.0, 5000, 600.0, 2), ("summarization", 5.0, 777, None, 0)])
def test_workload_chunks_are_make_workloads_numbers(name, rate, num, duration, seed):
    trace = make_workload(name, rate, num, duration, seed=seed)
    source = workload_source(name, rate, num, duration, seed, chunk_size=1000)
    chunks = list(source.chunks())
    assert source.n == len(trace) == sum(len(c) for c in chunks)
    for column in ("request_id", "arrival_at", "num_prompt_tokens", "num_output_tokens"):
        joined = np.concatenate([getattr(c, column) for c in chunks])
        assert np.array_equal(joined, getattr(trace, column)), column


SCENARIOS = {
    "default": {},
    "two prefill, two decode": {"cluster.prefill.num_instances": 2,
                                "cluster.decode.num_instances": 2},
    "faults": {"cluster.decode.num_instances": 2, "faults.transfer_failure_prob": 0.3,
               "faults.max_retries": 1, "faults.instance_loss": [[1, 300.0]],
               "faults.on_instance_loss": "reroute"},
    "preemption": {"cluster.decode.max_num_blocks": 400, "cluster.decode.admission":
                   "on-demand-recompute"},
    "chunked prefill": {"cluster.policies.prefill_batching": "chunked"},
    "arrivals for a duration": {"workload.num_requests": None, "workload.duration_s": 900.0,
                                "workload.name": "summarization", "workload.rate": 0.3},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_streamed_records_are_the_in_memory_records(scenario, tmp_path):
    config = make_config(**{"workload.num_requests": 1500, "workload.rate": 1.5,
                            **SCENARIOS[scenario]})
    expected = simulate(config).records
    _, records = streamed(config, tmp_path)
    assert len(records) == len(expected)
    assert same_bytes(records, expected, tmp_path)


def test_streamed_records_keep_tenants_and_rejections(tmp_path):
    trace = bursty_customers(rate=1.0, duration_s=900, seed=4)
    config = make_config(**{"cluster.prefill.max_batch_tokens": 1024,    # some rejected:
                            "cluster.policies.prefill_batching": "fcfs"})  # whole prompts
    expected = simulate(config, trace)
    result, records = streamed(config, tmp_path, trace)
    assert (expected.records["status"] == "rejected_prompt_too_long").any()
    assert same_bytes(records, expected.records, tmp_path)
    assert set(result.summary["tenants"]) == set(expected.summary["tenants"])
    for tenant, row in expected.summary["tenants"].items():
        assert result.summary["tenants"][tenant]["num_requests"] == row["num_requests"]
        assert result.summary["tenants"][tenant]["output_tokens_per_s"] == pytest.approx(
            row["output_tokens_per_s"], rel=1e-12)


def test_a_cut_run_streams_what_the_in_memory_run_shows_at_the_cut(tmp_path):
    config = make_config(**{"workload.num_requests": 1200, "workload.rate": 2.0})
    expected = simulate(config, until=300.0).records
    _, records = streamed(config, tmp_path, until=300.0)
    assert (expected["status"] == "unfinished").sum() > 500      # never arrived, or open
    assert same_bytes(records, expected, tmp_path)


def test_streamed_summary_counts_exact_and_percentiles_within_the_bound(tmp_path):
    config = make_config(**{"workload.num_requests": 3000, "workload.rate": 1.2,
                            "cluster.decode.max_num_blocks": 600})
    exact = simulate(config)
    result, _ = streamed(config, tmp_path)
    s, e = result.summary, exact.summary
    for key in ("num_requests", "num_finished", "num_failed", "num_unfinished", "statuses",
                "slo_attainment", "kv_bytes_total", "simulated_time_s"):
        assert s[key] == e[key], key
    for key in ("ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "output_tokens_per_s",
                "requests_per_s", "decode_occupancy", "energy_j", "usd_per_request",
                "ttft_queue_mean_s", "ttft_transfer_mean_s"):
        assert s[key] == pytest.approx(e[key], rel=1e-12), key
    sketched = assert_sketched_percentiles(s, exact.records)
    assert "ttft_p90_s" in sketched and "percentiles" not in e


def test_aggregates_of_parts_merge_into_the_aggregate_of_the_whole():
    records = simulate(make_config(**{"workload.num_requests": 800})).records
    whole, a, b = (RecordsAggregate(2.0, 0.2) for _ in range(3))
    whole.add(records)
    a.add(records.iloc[:300])
    b.add(records.iloc[300:])
    a.merge(b)
    merged, direct = a.summary(), whole.summary()
    for key, value in direct.items():
        if isinstance(value, float) and "mean" in key:
            assert merged[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert merged[key] == value or (math.isnan(value) and math.isnan(merged[key])), key


def test_state_is_bounded_by_chunks_and_requests_in_flight(tmp_path, monkeypatch):
    """The ledger holds the requests loaded and not yet written out: at most a chunk loaded
    ahead, two chunks' worth of arrivals ended and not yet written, and those in flight."""
    live = []
    load = StreamLedger._load
    monkeypatch.setattr(StreamLedger, "_load",
                        lambda self, i: (live.append(self.num_live), load(self, i))[1])
    config = make_config(**{"workload.num_requests": 12_000})
    streamed(config, tmp_path)
    records = simulate(config).records
    arrive, done = records["arrival_at"].to_numpy(), records["finished_at"].to_numpy()
    instants = np.concatenate([arrive, done])
    steps = np.concatenate([np.ones(len(arrive)), -np.ones(len(done))])
    in_flight = int(np.cumsum(steps[np.lexsort((steps, instants))]).max())
    chunk = SMALL["chunk_size"]
    assert len(live) >= 12_000 // chunk
    assert max(live) <= 3 * chunk + in_flight < 12_000 // 10


def test_an_interrupted_run_leaves_a_readable_dataset_marked_incomplete(tmp_path, monkeypatch):
    finish = StreamLedger.finish

    def finish_then_stop(self, i, now):
        finish(self, i, now)
        if self.num_ended == 700:
            raise KeyboardInterrupt

    monkeypatch.setattr(StreamLedger, "finish", finish_then_stop)
    path = tmp_path / "records.parquet"
    with pytest.raises(KeyboardInterrupt):
        simulate(make_config(**{"workload.num_requests": 2000}), stream=Stream(path, **SMALL))
    with pytest.raises(ValueError, match="incomplete.*KeyboardInterrupt"):
        read_records(path)
    import pyarrow.dataset as ds

    table = ds.dataset(path).to_table()
    assert 0 < table.num_rows <= 700
    assert len(set(table["request_id"].to_pylist())) == table.num_rows


def test_a_killed_writer_leaves_its_complete_files_readable(tmp_path):
    path = tmp_path / "records.parquet"
    records = simulate(make_config(**{"workload.num_requests": 500})).records
    columns = {c: records[c].to_numpy() for c in records.columns}
    writer = RecordWriter(path, rows_per_group=100, groups_per_file=2)
    writer.append(columns)                      # 2 files complete, the 3rd one half written
    assert (path / INCOMPLETE).exists() and (path / ".part-00002.parquet").exists()
    import pyarrow.dataset as ds

    assert ds.dataset(path).to_table().num_rows == 400
    with pytest.raises(ValueError, match="incomplete"):
        read_records(path)
    writer.close()
    assert pd.read_parquet(path).shape[0] == 500 and not (path / INCOMPLETE).exists()


def test_mode_is_chosen_by_size_unless_forced():
    assert not use_streaming(STREAM_MIN_REQUESTS, None)
    assert use_streaming(STREAM_MIN_REQUESTS + 1, None)
    assert use_streaming(10, True) and not use_streaming(10**8, False)


def test_run_size_estimate_of_a_streamed_run_does_not_grow_with_requests():
    assert run_bytes(1e8, streamed=True) == run_bytes(1e3, streamed=True) < 1e9
    assert run_bytes(1e8) > 50 * run_bytes(1e8, streamed=True)
    assert run_bytes(1e7, streamed=True, trace_held=True) > run_bytes(1e7, streamed=True)


def test_streaming_refuses_what_needs_the_whole_trace(tmp_path):
    trace = bursty_customers(rate=0.5, duration_s=100, seed=1)
    with pytest.raises(ConfigError, match="fairness"):
        simulate(make_config(**{"cluster.policies.fairness": "weighted_fair"}), trace,
                 stream=Stream(None))
    with pytest.raises(ConfigError, match="in-memory ledger"):
        simulate(make_config(), trace, stream=Stream(None), monitor_interval_s=10.0)


def test_trace_source_slices_cover_the_trace():
    trace = bursty_customers(rate=0.5, duration_s=300, seed=2)
    chunks = list(trace_source(trace, chunk_size=7).chunks())
    assert [c.start for c in chunks] == list(range(0, len(trace), 7))
    assert np.array_equal(np.concatenate([c.tenant for c in chunks]), trace.tenant)


def test_hawk_simulate_stream_writes_a_dataset_and_says_the_bound(tmp_path, capsys):
    import json

    from sim.commands.main import main

    args = ["simulate", "--num-requests", "400", "--seed", "2"]
    assert main(args + ["--out", str(tmp_path / "memory")]) == 0
    assert main(args + ["--stream", "--out", str(tmp_path / "streamed")]) == 0
    assert "sketched (ddsketch), within 1% relative error" in capsys.readouterr().out
    assert (tmp_path / "memory" / "records.parquet").is_file()
    assert (tmp_path / "streamed" / "records.parquet").is_dir()
    memory = read_records(tmp_path / "memory" / "records.parquet")
    records = read_records(tmp_path / "streamed" / "records.parquet")
    assert same_bytes(records.sort_values("request_id").reset_index(drop=True), memory, tmp_path)
    summary = json.loads((tmp_path / "streamed" / "summary.json").read_text())
    assert summary["percentiles"]["approximate"][0] == "ttft_p50_s"
    # a later in-memory run into the same directory replaces the dataset with a file
    assert main(args + ["--no-stream", "--out", str(tmp_path / "streamed")]) == 0
    assert (tmp_path / "streamed" / "records.parquet").is_file()


def test_a_request_read_after_its_write_out_is_an_error_not_a_reload():
    from traces.chunks import trace_source

    trace = bursty_customers(rate=0.5, duration_s=200, seed=3)
    ledger = StreamLedger(trace_source(trace, chunk_size=4), RecordWriter(None))
    ledger.judge(lambda prompt, output: np.zeros(len(prompt), dtype=np.int64))
    assert ledger.arrival_at[0] == trace.arrival_at[0] and ledger.num_loaded == 4
    ledger.finish(0, 1.0)
    ledger.arrival_at[4], ledger.arrival_at[8]        # two loads later request 0 is written
    assert 0 not in ledger.status and ledger.writer.num_rows == 0   # buffered in the writer
    with pytest.raises(RuntimeError, match="position 0 was read after its record"):
        ledger.arrival_at[0]
