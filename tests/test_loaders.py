"""Trace loaders: every format, detection, bad rows named by file/line/field, skip reports."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from traces.bundled import data_dir
from traces.loaders import FORMATS, ColumnMapping, TraceFormatError, detect_format, load_trace

DATA = data_dir()                   # traces/data/, shipped with the package

BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def write(tmp_path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def write_jsonl(tmp_path, name: str, records) -> Path:
    return write(tmp_path, name, "".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("name", ["conv", "code"])
def test_azure_2023_real_trace_loads_whole(name):
    path = DATA / f"azure-llm-2023-{name}.csv"
    trace, report = load_trace(path)
    frame = pd.read_csv(path)
    assert report.format == "azure"
    assert report.num_rows == report.num_loaded == len(trace) == len(frame)
    assert report.num_skipped == 0 and report.num_reordered == 0
    assert trace.arrival_at[0] == 0.0
    np.testing.assert_array_equal(trace.num_prompt_tokens, frame["ContextTokens"])
    np.testing.assert_array_equal(trace.num_output_tokens, frame["GeneratedTokens"])
    stamps = pd.to_datetime(frame["TIMESTAMP"])
    expected = (stamps - stamps.iloc[0]).dt.total_seconds().to_numpy()
    np.testing.assert_allclose(trace.arrival_at, expected, atol=1e-6)
    assert 3000 < trace.duration_s < 3700          # about one hour
    assert report.origin.startswith("2023-11-16T18:1")


def test_azure_2024_timestamps_with_offset(tmp_path):
    path = write(tmp_path, "azure2024.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:00.0091350+00:00,100,10\n"
                 "2024-05-10 00:00:01.5091350+00:00,200,20\n")
    trace, report = load_trace(path)
    assert report.format == "azure"
    np.testing.assert_allclose(trace.arrival_at, [0.0, 1.5])
    assert report.origin == "2024-05-10T00:00:00.009135000Z"


def test_header_with_byte_order_mark_is_detected(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n"
                     b"2023-11-16 18:15:46.0,3,4\n")
    assert detect_format(path) == "azure" and len(load_trace(path)[0]) == 1


def test_bad_row_names_file_line_and_field(tmp_path):
    path = write(tmp_path, "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:47.0000000,12x,44\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(path) in str(info.value)
    assert "line 3" in str(info.value) and "'ContextTokens'" in str(info.value)
    assert "12x" in str(info.value)
    assert isinstance(info.value, ValueError) and info.value.field == "ContextTokens"


def test_skip_bad_counts_reasons_and_keeps_good_rows(tmp_path):
    path = write(tmp_path, "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0,374,44\n"
                 "yesterday,10,10\n"
                 "2023-11-16 18:15:47.0,0,44\n"
                 "2023-11-16 18:15:48.0,5,2.5\n"
                 "2023-11-16 18:15:49.0,5\n"
                 "2023-11-16 18:15:50.0,-3,0\n"
                 "2023-11-16 18:15:51.0,7,9\n")
    trace, report = load_trace(path, skip_bad=True)
    assert report.num_rows == 7 and report.num_loaded == 2 and report.num_skipped == 5
    assert report.skipped_reasons == {
        "TIMESTAMP: not an ISO 8601 date-time": 1,
        "ContextTokens: must be >= 1": 2,        # a row bad in two fields counts once
        "GeneratedTokens: not an integer": 1,
        "row: wrong number of fields": 1,
    }
    np.testing.assert_array_equal(trace.request_id, [0, 6])     # ids lead back to rows
    np.testing.assert_allclose(trace.arrival_at, [0.0, 5.0])
    assert "5 bad rows skipped" in report.describe()


def test_wrong_field_count_is_an_error_without_skip(tmp_path):
    path = write(tmp_path, "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0,374,44\n\n2023-11-16 18:15:47.0,374,44,9\n")
    with pytest.raises(TraceFormatError, match=r"line 4: field 'row': wrong number of fields"):
        load_trace(path)


def test_burstgpt_filters_on_model_and_log_type(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT_HEADER +
                 "5,ChatGPT,100,20,120,Conversation log\n"
                 "6,GPT-4,200,0,200,Conversation log\n"
                 "8,ChatGPT,300,30,330,API log\n"
                 "9,ChatGPT,400,40,440,Conversation log\n")
    assert detect_format(path) == "burstgpt"
    with pytest.raises(TraceFormatError, match=r"line 3: field 'Response tokens': must be >= 1"):
        load_trace(path)
    trace, report = load_trace(path, filters={"Model": "ChatGPT", "log_type": "Conversation log"})
    assert report.num_filtered == 2 and report.num_loaded == 2 and report.num_skipped == 0
    np.testing.assert_array_equal(trace.num_prompt_tokens, [100, 400])
    np.testing.assert_allclose(trace.arrival_at, [0.0, 4.0])
    trace, _ = load_trace(path, filters={"Model": ["ChatGPT", "GPT-4"]}, skip_bad=True)
    assert len(trace) == 3
    with pytest.raises(ValueError, match="filter column 'tenant'"):
        load_trace(path, filters={"tenant": "x"})


def test_mooncake_jsonl_milliseconds_and_hash_ids(tmp_path):
    path = write_jsonl(tmp_path, "mooncake.jsonl", [
        {"timestamp": 1000, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2, 3]},
        {"timestamp": 1250, "input_length": 30, "output_length": 7, "hash_ids": [1, 4]},
        {"timestamp": 4000, "input_length": 10, "output_length": 1, "hash_ids": []},
    ])
    trace, report = load_trace(path)
    assert report.format == "mooncake"
    np.testing.assert_allclose(trace.arrival_at, [0.0, 0.25, 3.0])
    np.testing.assert_array_equal(trace.num_output_tokens, [52, 7, 1])
    assert any("hash_ids" in note for note in report.notes)


def test_mooncake_bad_records(tmp_path):
    path = write(tmp_path, "mooncake.jsonl",
                 '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": "x"}\n'
                 'not json\n'
                 '{"timestamp": 2, "input_length": true, "output_length": 2}\n'
                 '{"timestamp": 3, "output_length": 2}\n')
    with pytest.raises(TraceFormatError, match=r"line 2: field 'hash_ids'"):
        load_trace(path)
    trace, report = load_trace(path, skip_bad=True)
    assert len(trace) == 1 and report.num_rows == 5
    assert report.skipped_reasons == {"hash_ids: not a list of integers": 1,
                                      "json: not a JSON object": 1,
                                      "input_length: not a number": 2}


@pytest.mark.parametrize("header,row", [
    ("request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size",
     "{i},2,0,{t},1,{p},{o}"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens", "{t},{p},{o}"),
])
def test_splitwise_and_vidur_processed_csv(tmp_path, header, row):
    rows = [row.format(i=i, t=10 + 0.5 * i, p=100 + i, o=5 + i) for i in range(4)]
    path = write(tmp_path, "split.csv", header + "\n" + "\n".join(rows) + "\n")
    trace, report = load_trace(path)
    assert report.format == "splitwise"
    np.testing.assert_allclose(trace.arrival_at, [0, 0.5, 1.0, 1.5])
    np.testing.assert_array_equal(trace.num_prompt_tokens, [100, 101, 102, 103])


def test_generic_csv_needs_mapping_and_uses_it(tmp_path):
    path = write(tmp_path, "mine.csv", "t_ms,in,out,id\n500,10,3,70\n100,20,4,71\n")
    assert detect_format(path) == "csv"
    with pytest.raises(TraceFormatError, match="--columns arrival_at=COL.*or mapping= in Python"):
        load_trace(path)
    mapping = {"arrival_at": "t_ms", "num_prompt_tokens": "in", "num_output_tokens": "out",
               "request_id": "id", "time_unit": "ms"}
    trace, report = load_trace(path, mapping=mapping)
    assert report.num_reordered == 1                       # sorted, and said so
    np.testing.assert_allclose(trace.arrival_at, [0.0, 0.4])
    np.testing.assert_array_equal(trace.request_id, [71, 70])
    with pytest.raises(ValueError, match="mapping applies"):
        load_trace(path, "azure", mapping=mapping)


def test_generic_csv_duplicate_ids_rejected(tmp_path):
    path = write(tmp_path, "mine.csv", "arrival_at,num_prompt_tokens,num_output_tokens,rid\n"
                 "0,1,1,5\n1,1,1,5\n")
    with pytest.raises(TraceFormatError, match=r"line 3: field 'rid': duplicate request id 5"):
        load_trace(path, mapping=ColumnMapping(request_id="rid"))


def test_generic_jsonl_and_parquet(tmp_path):
    records = [{"arrival_at": 2.0 + i, "num_prompt_tokens": 8 * (i + 1), "num_output_tokens": 3}
               for i in range(3)]
    trace, report = load_trace(write_jsonl(tmp_path, "t.jsonl", records))
    assert report.format == "jsonl"
    np.testing.assert_allclose(trace.arrival_at, [0, 1, 2])
    frame = pd.DataFrame(records)
    frame.loc[2, "num_output_tokens"] = 0
    frame.to_parquet(tmp_path / "t.parquet")
    assert detect_format(tmp_path / "t.parquet") == "parquet"
    with pytest.raises(TraceFormatError, match=r"row 3: field 'num_output_tokens'"):
        load_trace(tmp_path / "t.parquet")
    trace, report = load_trace(tmp_path / "t.parquet", skip_bad=True)
    assert len(trace) == 2 and report.skipped_reasons == {"num_output_tokens: must be >= 1": 1}


def test_explicit_format_and_unknown_format(tmp_path):
    path = write(tmp_path, "x.txt", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.0,3,4\n")
    assert load_trace(path, "azure")[1].format == "azure"
    with pytest.raises(ValueError, match="not one of"):
        load_trace(path, "vidur")
    assert set(FORMATS) == {"azure", "burstgpt", "mooncake", "splitwise", "csv", "jsonl",
                            "parquet"}


def test_no_silent_clipping_of_large_values(tmp_path):
    path = write(tmp_path, "big.csv", "arrival_at,num_prompt_tokens,num_output_tokens\n"
                 "0,1000000,500000\n")
    trace, _ = load_trace(path)
    assert trace.num_prompt_tokens[0] == 1_000_000 and trace.num_output_tokens[0] == 500_000


def test_everything_filtered_is_an_error(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT_HEADER + "5,ChatGPT,100,20,120,API log\n")
    with pytest.raises(ValueError, match="no requests left"):
        load_trace(path, filters={"Log Type": "Conversation log"})


rows = st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(1, 10**6),
                          st.integers(1, 10**5)), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None)
@given(rows=rows)
def test_csv_round_trip_preserves_every_value(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("rt") / "t.csv"
    pd.DataFrame(rows, columns=["arrival_at", "num_prompt_tokens", "num_output_tokens"]) \
        .to_csv(path, index=False, float_format="%.17g")
    trace, report = load_trace(path)
    arrivals = np.array([r[0] for r in rows])
    order = np.argsort(arrivals, kind="stable")
    assert report.num_loaded == len(rows) and trace.arrival_at[0] == 0.0
    np.testing.assert_allclose(trace.arrival_at, arrivals[order] - arrivals.min(), atol=1e-9)
    np.testing.assert_array_equal(trace.num_prompt_tokens, np.array([r[1] for r in rows])[order])
    np.testing.assert_array_equal(trace.request_id, order)
