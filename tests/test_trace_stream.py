"""A trace file streamed (traces.trace_stream): the requests, reports and errors of the
whole-file loader, in blocks, with a bounded reorder window."""

import json

import numpy as np
import pandas as pd
import pytest

from sim.commands.main import main
from sim.engine.cluster import simulate
from sim.engine.stream import Stream
from traces.loaders import TraceFormatError, load_trace
from traces.schema import read_records
from traces.shaping import ShapeSpec, shape
from traces.trace_stream import TraceStream, scan, stream_source
from tests.builders import make_config

COLUMNS = ("request_id", "arrival_at", "num_prompt_tokens", "num_output_tokens", "tenant")
TINY = dict(reorder_rows=40, block_rows=97)


def write_trace(path, n=3000, seed=0, late_every=10, tenants=True):
    """A generic CSV trace whose rows are shuffled within runs of ``late_every``: no row is
    later than ``late_every`` rows before it (a reorder window of that size puts it back)."""
    rng = np.random.default_rng(seed)
    at = np.cumsum(rng.exponential(0.2, n)) + 500.0
    order = np.arange(n)
    for lo in range(0, n, late_every):
        order[lo:lo + late_every] = rng.permutation(order[lo:lo + late_every])
    frame = pd.DataFrame({"arrival_at": np.round(at[order], 6),
                          "num_prompt_tokens": rng.integers(1, 3000, n),
                          "num_output_tokens": rng.integers(1, 400, n)})
    if tenants:
        frame["tenant"] = [f"t{k % 3}" for k in range(n)]
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_csv(path, index=False)
    return path


def loaded(path, num=None, duration=None, spec=ShapeSpec(), whole_file=False, **kw):
    """The whole-file path of ``hawk simulate --trace``: load, shape, cut."""
    trace, report = load_trace(path, max_requests=None if whole_file else num, **kw)
    trace, shaped = shape(trace, spec)
    if num is not None:
        trace = trace.head(num)
    if duration is not None:
        trace = trace.until(duration)
    return trace, report, shaped


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
@pytest.mark.parametrize("cut", [{}, {"num": 333}, {"duration": 150.0},
                                 {"spec": ShapeSpec(start_s=60, end_s=400, rate_scale=2.5),
                                  "whole_file": True, "num": 500}])
def test_streamed_requests_and_reports_are_the_whole_file_loaders(tmp_path, suffix, cut):
    path = write_trace(tmp_path / f"t{suffix}")
    trace, report, shaped = loaded(path, **cut)
    spec = TraceStream(path, num_requests=cut.get("num"), duration_s=cut.get("duration"),
                       shape=cut.get("spec", ShapeSpec()),
                       whole_file=cut.get("whole_file", False), **TINY)
    found = scan(spec)
    assert (found.report, found.shaped, found.n) == (report, shaped, len(trace))
    assert report.num_reordered > 0                  # the file is out of order
    chunks = list(stream_source(spec, chunk_size=64, found=found).chunks())
    assert [c.start for c in chunks] == list(range(0, len(trace), 64))
    for column in COLUMNS:
        joined = np.concatenate([getattr(c, column) for c in chunks])
        assert np.array_equal(joined, getattr(trace, column)), column


def test_a_streamed_trace_run_gives_the_in_memory_runs_records(tmp_path):
    path = write_trace(tmp_path / "t.csv", n=1500, tenants=False)
    config = make_config(**{"workload.trace": str(path), "workload.num_requests": 1200})
    memory = simulate(config).records
    result = simulate(config, stream=Stream(tmp_path / "r.parquet", rows_per_group=100,
                                            chunk_size=64))
    streamed = read_records(tmp_path / "r.parquet").sort_values("request_id")
    assert result.summary["num_requests"] == 1200
    pd.testing.assert_frame_equal(streamed.reset_index(drop=True),
                                  memory.sort_values("request_id").reset_index(drop=True))


@pytest.mark.parametrize("skip_bad", [False, True])
def test_a_bad_row_is_named_as_the_whole_file_loader_names_it(tmp_path, skip_bad):
    path = write_trace(tmp_path / "t.csv", n=500, tenants=False)
    lines = path.read_text().splitlines()
    lines[321] = "12.5,0,40"                         # a zero-token prompt on line 322
    lines[401] = "13.0,x,40"
    path.write_text("\n".join(lines) + "\n")
    spec = TraceStream(path, skip_bad=skip_bad, **TINY)
    if not skip_bad:
        with pytest.raises(TraceFormatError) as whole:
            load_trace(path)
        with pytest.raises(TraceFormatError) as streamed:
            scan(spec)
        assert str(streamed.value) == str(whole.value)
        assert (streamed.value.where, streamed.value.field) == ("line 322", "num_prompt_tokens")
        return
    found, (_, report) = scan(spec), load_trace(path, skip_bad=True)
    assert found.report == report and report.num_skipped == 2


def test_a_row_later_than_the_reorder_window_is_refused_naming_it(tmp_path):
    path = write_trace(tmp_path / "t.csv", n=400, late_every=1, tenants=False)
    lines = path.read_text().splitlines()
    lines.insert(301, "500.0,10,10")                 # earlier than the 299 rows before it
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as refused:
        scan(TraceStream(path, **TINY))
    assert (refused.value.where, refused.value.field) == ("line 302", "arrival_at")
    assert "within 40 rows" in str(refused.value) and "--no-stream" in str(refused.value)
    trace, _ = load_trace(path)                     # the whole-file loader sorts it
    found = scan(TraceStream(path, reorder_rows=400, block_rows=97))
    chunks = list(stream_source(TraceStream(path, reorder_rows=400, block_rows=97),
                                found=found).chunks())
    assert np.array_equal(np.concatenate([c.request_id for c in chunks]), trace.request_id)
    assert trace.request_id[0] == 300


def test_duplicate_mapped_ids_are_refused_as_the_loader_refuses_them(tmp_path):
    path = tmp_path / "ids.csv"
    path.write_text("t,p,o,id\n0,5,5,7\n1,5,5,8\n2,5,5,7\n")
    mapping = {"arrival_at": "t", "num_prompt_tokens": "p", "num_output_tokens": "o",
               "request_id": "id"}
    with pytest.raises(TraceFormatError) as whole:
        load_trace(path, mapping=mapping)
    with pytest.raises(TraceFormatError) as streamed:
        scan(TraceStream(path, mapping=mapping))
    assert str(streamed.value) == str(whole.value) and streamed.value.where == "line 4"


def test_sampling_or_caps_are_refused_for_a_stream(tmp_path):
    with pytest.raises(ValueError, match="sampling and length caps"):
        TraceStream(tmp_path / "t.csv", shape=ShapeSpec(sample_fraction=0.5))


def test_hawk_simulate_trace_stream_reports_the_load_and_writes_a_dataset(tmp_path, capsys):
    path = write_trace(tmp_path / "t.csv", n=800)
    out = tmp_path / "out"
    assert main(["simulate", "--trace", str(path), "--stream", "--rate-scale", "2",
                 "--num-requests", "600", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["trace"]["streamed"] and summary["num_requests"] == 600
    assert summary["trace"]["load"]["num_reordered"] > 0
    assert "relative_accuracy" in summary["percentiles"]
    assert len(read_records(out / "records.parquet")) == 600


@pytest.mark.parametrize("name", ["azure-llm-2023-conv.csv", "azure-llm-2023-code.csv"])
def test_the_bundled_azure_traces_stream_as_they_load(name):
    trace, report = load_trace(name)                # ISO 8601 date-times, in file order
    spec = TraceStream(name, reorder_rows=8, block_rows=1000)
    found = scan(spec)
    assert found.report == report and found.n == len(trace)
    chunks = list(stream_source(spec, chunk_size=4096, found=found).chunks())
    for column in COLUMNS[:4]:
        assert np.array_equal(np.concatenate([getattr(c, column) for c in chunks]),
                              getattr(trace, column)), column


def test_hawk_simulate_stream_names_a_bad_row_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n0,5,5\n1,0,5\n")
    assert main(["simulate", "--trace", str(path), "--stream"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 3: field 'num_prompt_tokens': must be >= 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("threshold, streams", [(500, True), (5000, False)])
def test_without_a_flag_the_scan_streams_a_trace_longer_than_the_threshold(
        tmp_path, capsys, monkeypatch, threshold, streams):
    monkeypatch.setattr("sim.config.run_size.STREAM_MIN_REQUESTS", threshold)
    monkeypatch.setattr("sim.engine.stream.STREAM_MIN_REQUESTS", threshold)
    path = write_trace(tmp_path / "t.csv", n=800)
    assert main(["simulate", "--trace", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 800
    assert summary["trace"].get("streamed", False) is streams
    assert ("percentiles" in summary) is streams


def test_a_trace_out_of_order_beyond_the_window_is_loaded_whole_unless_streaming_is_forced(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sim.config.run_size.STREAM_MIN_REQUESTS", 10)   # only sim.commands.main's choice
    n = 100_000                                      # one row 99,000 rows late: past 65,536
    at = np.arange(n, dtype=float)
    at[99_000] = 0.5
    path = tmp_path / "late.csv"
    pd.DataFrame({"arrival_at": at, "num_prompt_tokens": 100,
                  "num_output_tokens": 10}).to_csv(path, index=False)
    args = ["simulate", "--trace", str(path), "--duration", "20", "--json"]
    assert main(args) == 0                           # the whole-file loader sorts it
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 21 and "streamed" not in summary["trace"]
    assert main(args + ["--stream"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 99002: field 'arrival_at': arrives before a request" in err
