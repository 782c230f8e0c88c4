"""Trace files as an attacker (or a broken exporter) writes them: out-of-range numbers, bytes
that are not UTF-8, deep or repeated-key JSON, repeated columns, and files far longer than
the run needs. Each is refused naming file and line, or skipped and counted."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.commands.main import main
from traces.loaders import MAX_TOKENS, TraceFormatError, detect_format, load_trace
from traces.readers import MAX_JSON_DEPTH

HEADER = "arrival_at,num_prompt_tokens,num_output_tokens\n"


def write(tmp_path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("row,field,problem", [
    ("0.5,1000000000000000000000000000000,4", "num_prompt_tokens", f"must be <= {MAX_TOKENS}"),
    ("0.5,10,99999999999999999999", "num_output_tokens", f"must be <= {MAX_TOKENS}"),
    ("1e17,10,4", "arrival_at", "too large"),           # float64 spacing there is 16 s
    ("-2.5,10,4", "arrival_at", "must be >= 0"),
    ("inf,10,4", "arrival_at", "not a finite number"),
    ("nan,10,4", "arrival_at", "not a finite number"),
])
def test_out_of_range_values_are_bad_rows(tmp_path, row, field, problem):
    path = write(tmp_path, "t.csv", HEADER + "0,10,4\n" + row + "\n2,10,4\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert "line 3" in str(info.value) and info.value.field == field
    assert problem in str(info.value)
    trace, report = load_trace(path, skip_bad=True)
    assert len(trace) == 2 and report.num_skipped == 1


def test_request_ids_beyond_float64_exactness_are_refused(tmp_path):
    path = write(tmp_path, "t.csv", "arrival_at,num_prompt_tokens,num_output_tokens,rid\n"
                 "0,1,1,9007199254740993\n1,1,1,7\n")
    with pytest.raises(TraceFormatError, match=r"line 2: field 'rid': must be <= 9007199254740991"):
        load_trace(path, mapping={"request_id": "rid"})


def test_epoch_milliseconds_keep_their_resolution(tmp_path):
    # Today's epoch in ms (1.7e12) is well inside float64's exact range: accepted.
    path = write(tmp_path, "t.csv", "t,p,o\n1700000000000.5,3,2\n1700000000001.5,3,2\n")
    trace, _ = load_trace(path, mapping={"arrival_at": "t", "num_prompt_tokens": "p",
                                         "num_output_tokens": "o", "time_unit": "ms"})
    np.testing.assert_allclose(trace.arrival_at, [0.0, 1e-3], atol=1e-9)


@pytest.mark.parametrize("name,good,bad", [
    ("t.csv", HEADER.encode() + b"0,10,4\n", b"1,1\xff0,4\n"),
    ("t.jsonl", b'{"arrival_at": 0, "num_prompt_tokens": 10, "num_output_tokens": 4}\n',
     b'{"arrival_at": 1, "num_prompt_tokens": 10, "num_output_tokens": 4, "x": "\xff"}\n'),
], ids=["csv", "jsonl"])
def test_bytes_that_are_not_utf8_name_file_and_line_and_can_be_skipped(tmp_path, name, good, bad):
    path = write(tmp_path, name, good + bad + good.splitlines(keepends=True)[-1])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    line = 3 if name.endswith(".csv") else 2
    assert str(path) in str(info.value) and f"line {line}" in str(info.value)
    assert "not UTF-8" in str(info.value)
    trace, report = load_trace(path, skip_bad=True)
    assert report.num_skipped == 1 and report.skipped_reasons == {"text: not UTF-8": 1}
    assert len(trace) == 2


def test_a_header_that_is_not_utf8_is_refused(tmp_path):
    path = write(tmp_path, "t.csv", b"arrival_at,num_pr\xffompt_tokens,num_output_tokens\n0,1,1\n")
    with pytest.raises(TraceFormatError, match="line 1.*not UTF-8"):
        load_trace(path)


def test_binary_file_is_refused_not_a_traceback(tmp_path):
    path = write(tmp_path, "t.csv", bytes(range(128, 256)) * 4)
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        load_trace(path)


def test_deeply_nested_json_is_a_bad_row(tmp_path):
    good = '{"arrival_at": 0, "num_prompt_tokens": 10, "num_output_tokens": 4}\n'
    bomb = '{"arrival_at": 1, "x": ' + "[" * 200_000 + "]" * 200_000 + "}\n"
    deep = '{"arrival_at": 1, "x": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) \
        + "}\n"
    for nested in (bomb, deep):
        path = write(tmp_path, "t.jsonl", good + nested + good.replace("0,", "2,", 1))
        with pytest.raises(TraceFormatError, match="line 2: field 'json': nested deeper"):
            load_trace(path)
        trace, report = load_trace(path, skip_bad=True)
        assert len(trace) == 2 and report.num_skipped == 1
    path = write(tmp_path, "first.jsonl", bomb)
    with pytest.raises(TraceFormatError, match="line 1"):
        detect_format(path)


def test_repeated_json_keys_are_bad_rows(tmp_path):
    path = write(tmp_path, "t.jsonl",
                 '{"arrival_at": 0, "num_prompt_tokens": 10, "num_output_tokens": 4}\n'
                 '{"arrival_at": 1, "num_prompt_tokens": 10, "num_prompt_tokens": 99, '
                 '"num_output_tokens": 4}\n')
    with pytest.raises(TraceFormatError, match="line 2: field 'json': duplicate key"):
        load_trace(path)


def test_repeated_header_columns_are_refused(tmp_path):
    path = write(tmp_path, "t.csv", "arrival_at,num_prompt_tokens,num_output_tokens,"
                 "num_prompt_tokens\n0,10,4,99\n")
    with pytest.raises(TraceFormatError,
                       match="line 1: field 'num_prompt_tokens': duplicate column"):
        load_trace(path)


def test_repeated_parquet_columns_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array([0.0]), pa.array([10]), pa.array([4]),
                                  pa.array([99])],
                                 names=["arrival_at", "num_prompt_tokens",
                                        "num_output_tokens", "num_prompt_tokens"])
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(TraceFormatError, match="duplicate column"):
        load_trace(tmp_path / "t.parquet", "parquet")


def test_the_report_always_says_what_was_skipped_sorted_and_filtered(tmp_path):
    path = write(tmp_path, "t.csv", HEADER + "0,10,4\n1,10,4\n")
    _, report = load_trace(path, skip_bad=True)
    assert ("0 bad rows skipped, 0 rows out of arrival order sorted, 0 rows left out by "
            "filters") in report.describe()


def test_simulate_json_reports_skipped_sorted_and_filtered_rows(tmp_path, capsys):
    path = write(tmp_path, "t.csv", HEADER + "5,10,4\nx,10,4\n1,10,4\n")
    assert main(["simulate", "--trace", str(path), "--skip-bad", "--json"]) == 0
    load = json.loads(capsys.readouterr().out)["trace"]["load"]
    assert (load["num_skipped"], load["num_reordered"], load["num_filtered"]) == (1, 1, 0)
    assert load["skipped_reasons"] == {"arrival_at: not a finite number": 1}
    assert main(["simulate", "--trace", str(path), "--skip-bad"]) == 0
    assert "1 bad rows skipped, 1 rows out of arrival order sorted" in capsys.readouterr().err


# --- large traces stream -------------------------------------------------------------------

def poisoned(tmp_path, name: str, num_good: int, poison: bytes, fmt: str = "csv") -> Path:
    """``num_good`` good rows, then a row that fails the load if it is ever read."""
    if fmt == "csv":
        rows = "".join(f"{0.01 * i:.2f},{10 + i % 7},{2 + i % 3}\n" for i in range(num_good))
        return write(tmp_path, name, HEADER.encode() + rows.encode() + poison)
    rows = "".join(json.dumps({"arrival_at": 0.01 * i, "num_prompt_tokens": 10,
                               "num_output_tokens": 2}) + "\n" for i in range(num_good))
    return write(tmp_path, name, rows.encode() + poison)


@pytest.mark.parametrize("fmt,poison", [("csv", b"1,2\xff,3\n"), ("csv", b"1,2\n"),
                                        ("jsonl", b"[" * 100_000 + b"\n")],
                         ids=["not-utf8", "field-count", "deep-json"])
def test_max_requests_reads_only_what_it_needs(tmp_path, fmt, poison):
    path = poisoned(tmp_path, f"t.{fmt}", 1000, poison, fmt)
    with pytest.raises(TraceFormatError, match="line"):
        load_trace(path)                       # the poison row is there...
    trace, report = load_trace(path, max_requests=1000)
    assert len(trace) == 1000                  # ...and was never read
    assert report.num_rows == 1000 and not report.read_to_end


def test_max_requests_counts_kept_rows_not_bad_or_filtered_ones(tmp_path):
    rows = "".join(f"{i},{'x' if i % 4 == 0 else 10},3\n" for i in range(40))
    path = write(tmp_path, "t.csv", HEADER + rows + "1,2\n")
    trace, report = load_trace(path, skip_bad=True, max_requests=21)
    assert len(trace) == 21 and report.num_skipped == 7 and report.num_rows == 28
    np.testing.assert_array_equal(trace.request_id[:4], [1, 2, 3, 5])


def test_max_requests_streams_parquet_by_batch(tmp_path):
    frame = pd.DataFrame({"arrival_at": np.arange(5000) * 0.1, "num_prompt_tokens": 8,
                          "num_output_tokens": 2})
    frame.to_parquet(tmp_path / "t.parquet")
    trace, report = load_trace(tmp_path / "t.parquet", max_requests=1234)
    assert len(trace) == 1234 == report.num_rows and not report.read_to_end
    np.testing.assert_allclose(trace.arrival_at[-1], 123.3)


def test_simulate_num_requests_streams_a_long_trace(tmp_path, capsys):
    path = poisoned(tmp_path, "t.csv", 300, b"1,2\xff,3\n")
    assert main(["simulate", "--trace", str(path), "--num-requests", "300", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 300
    assert summary["trace"]["load"]["read_to_end"] is False


# --- --rate-scale and --window for simulate --trace ---------------------------------------

def test_rate_scale_and_window_shape_the_simulated_trace(tmp_path, capsys):
    path = write(tmp_path, "t.csv", HEADER + "".join(f"{2 * i},50,3\n" for i in range(20)))
    out = tmp_path / "run"
    assert main(["simulate", "--trace", str(path), "--window", "10:30", "--rate-scale", "4",
                 "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    records = pd.read_parquet(out / "records.parquet").sort_values("arrival_at")
    # rows at 10, 12, ..., 28 s -> re-based 0..18 s -> four times as fast: 0, 0.5, ..., 4.5 s
    np.testing.assert_allclose(records["arrival_at"], np.arange(10) * 0.5)
    np.testing.assert_array_equal(records["request_id"], np.arange(5, 15))
    shaping = summary["trace"]["shaping"]
    assert shaping["rate_scale"] == 4 and shaping["num_outside_window"] == 10


def test_rate_with_a_trace_is_refused_and_points_at_rate_scale(tmp_path, capsys):
    path = write(tmp_path, "t.csv", HEADER + "0,10,4\n")
    assert main(["simulate", "--trace", str(path), "--rate", "2"]) == 2
    err = capsys.readouterr().err
    assert "--rate" in err and "--rate-scale" in err


@pytest.mark.parametrize("flag,value", [("--rate-scale", "2"), ("--window", "0:10")])
def test_trace_shaping_flags_without_a_trace_are_refused(capsys, flag, value):
    assert main(["simulate", "--num-requests", "10", flag, value]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "10:5", "-1:3", "5"])
def test_bad_windows_name_the_flag(tmp_path, capsys, value):
    path = write(tmp_path, "t.csv", HEADER + "0,10,4\n")
    assert main(["simulate", "--trace", str(path), f"--window={value}"]) == 2
    assert "--window" in capsys.readouterr().err


def test_a_window_with_no_requests_is_refused(tmp_path, capsys):
    path = write(tmp_path, "t.csv", HEADER + "0,10,4\n1,10,4\n")
    assert main(["simulate", "--trace", str(path), "--window", "50:60"]) == 2
    assert "no requests left" in capsys.readouterr().err
