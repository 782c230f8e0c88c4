"""compare-runs: two record sets (or traces) side by side under the same SLOs."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from traces.bundled import data_dir
from traces.compare import compare_runs, format_table, load_run, workload_stats
from traces.schema import RequestRecord, Status, records_from_list, write_records

DATA = data_dir()                   # traces/data/, shipped with the package


def make_records(ttft: float, tpot: float, n: int = 10, failed: int = 0, gap: float = 1.0):
    """``n`` requests, ``gap`` s apart, 5 output tokens, fixed TTFT/TPOT; the last few failed."""
    out = []
    for i in range(n):
        arrival = i * gap
        if i >= n - failed:
            out.append(RequestRecord(i, arrival, 100, 5, Status.FAILED_ERROR,
                                     finished_at=arrival + 0.1))
            continue
        first = arrival + ttft
        out.append(RequestRecord(i, arrival, 100, 5, Status.OK, first_token_at=first,
                                 finished_at=first + 4 * tpot, num_generated_tokens=5))
    return records_from_list(out)


def write_run(path: Path, frame, summary: dict | None = None) -> Path:
    path.mkdir(parents=True)
    write_records(frame, path / "records.parquet")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def rows(comparison) -> dict:
    return {name: (a, b) for name, a, b in comparison["rows"]}


def test_side_by_side_metrics_under_the_same_slos(tmp_path):
    sim = load_run(write_run(tmp_path / "sim", make_records(0.5, 0.05)))
    real = load_run(write_run(tmp_path / "real", make_records(1.5, 0.1, failed=2),
                              {"send_lag_p99_s": 0.003, "ttft_slo_s": 1.0}))
    table = rows(compare_runs(sim, real, ttft_slo_s=1.0, tpot_slo_s=0.2))
    assert table["ttft_p50_s"] == pytest.approx((0.5, 1.5))
    assert table["tpot_p50_s"] == pytest.approx((0.05, 0.1))
    assert table["slo_attainment"] == (1.0, 0.0)
    assert table["num_failed"] == (0, 2) and table["num_requests"] == (10, 10)
    assert table["send_lag_p99_s"] == (None, 0.003)
    assert table["offered_rate_per_s"] == pytest.approx((1.0, 1.0))


def test_client_and_server_ttft_side_by_side_where_the_server_reports_timings(tmp_path):
    sim = load_run(write_run(tmp_path / "sim", make_records(0.5, 0.05)))
    real = load_run(write_run(tmp_path / "real", make_records(0.8, 0.05),
                              {"server_ttft_p50_s": 0.6, "server_ttft_p99_s": 0.7,
                               "ttft_client_minus_server_p50_s": 0.2,
                               "server_cached_tokens": 0}))
    comparison = compare_runs(sim, real, ttft_slo_s=1.0, tpot_slo_s=0.2)
    table = rows(comparison)
    assert table["ttft_p50_s"] == pytest.approx((0.5, 0.8))
    assert table["server_ttft_p50_s"] == (None, 0.6)
    assert table["ttft_client_minus_server_p50_s"] == (None, 0.2)
    assert table["server_cached_tokens"] == (None, 0)
    assert "server_ttft_p50_s" in format_table(comparison)


def test_table_text_has_both_columns_difference_and_ratio(tmp_path):
    a = load_run(write_run(tmp_path / "a", make_records(0.5, 0.05)))
    b = load_run(write_run(tmp_path / "b", make_records(1.0, 0.05)))
    text = format_table(compare_runs(a, b, 2.0, 0.2))
    line = next(l for l in text.splitlines() if l.startswith("ttft_p50_s"))
    assert line.split()[1:] == ["0.5", "1", "0.5", "2"]
    assert "SLOs: TTFT 2 s, TPOT 0.2 s" in text


def test_records_file_and_trace_files_are_runs_too(tmp_path):
    write_records(make_records(0.5, 0.05), tmp_path / "records.csv")
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n0,10,5\n2,30,7\n4,20,6\n")
    comparison = compare_runs(load_run(tmp_path / "records.csv"), load_run(trace), 2.0, 0.2)
    table = rows(comparison)
    assert table["num_requests"] == (10, 3)
    assert table["prompt_tokens_p50"] == (100.0, 20.0)
    assert table["ttft_p50_s"] == (pytest.approx(0.5), None)     # a trace has no outcomes
    assert "-" in format_table(comparison)


def test_trace_vs_trace_on_the_real_azure_traces():
    conv = load_run(DATA / "azure-llm-2023-conv.csv")
    code = load_run(DATA / "azure-llm-2023-code.csv")
    table = rows(compare_runs(conv, code, 2.0, 0.2))
    assert table["num_requests"] == (19366, 8819)
    conv_rate, code_rate = table["offered_rate_per_s"]
    assert conv_rate == pytest.approx(5.5, rel=0.1) and code_rate == pytest.approx(2.6, rel=0.1)


def test_workload_stats_of_a_regular_trace():
    stats = workload_stats(np.arange(11.0), np.full(11, 7), np.arange(1, 12))
    assert stats["offered_rate_per_s"] == 1.0 and stats["gap_cv"] == 0.0
    assert stats["output_tokens_p50"] == 6.0


def test_missing_run_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no records.parquet"):
        load_run(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_run(tmp_path / "nowhere")


def run_cli(argv) -> int:
    from traces import commands

    parser = argparse.ArgumentParser(prog="hawk")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_json_uses_slos_from_the_first_summary_unless_given(tmp_path, capsys):
    a = write_run(tmp_path / "a", make_records(0.5, 0.05), {"ttft_slo_s": 0.4, "tpot_slo_s": 0.2})
    b = write_run(tmp_path / "b", make_records(0.3, 0.05))
    assert run_cli(["compare-runs", str(a), str(b), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_slo_s"] == 0.4 and rows(out)["slo_attainment"] == (0.0, 1.0)
    assert run_cli(["compare-runs", str(a), str(b), "--workload", "summarization", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_slo_s"] == 15.0 and rows(out)["slo_attainment"] == (1.0, 1.0)
    assert run_cli(["compare-runs", str(a), str(b)]) == 0
    assert "ttft_p50_s" in capsys.readouterr().out
