"""The ``hawk`` command line, run in-process through ``sim.commands.main.main``."""

import json
import platform

import pandas as pd
import pytest

from sim.bench import speed as bench
from sim.commands.main import main

SUMMARY_KEYS = {"num_requests", "num_finished", "num_failed", "slo_attainment", "ttft_p50_s",
                "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s",
                "output_tokens_per_s", "sim_wall_time_s"}


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_has_the_summary_keys(capsys):
    summary = run_json(capsys, "simulate", "--num-requests", "200", "--json")
    assert SUMMARY_KEYS <= set(summary)
    assert summary["num_requests"] == 200
    assert 0.0 <= summary["slo_attainment"] <= 1.0
    assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]


def test_simulate_default_prints_a_table(capsys):
    assert main(["simulate", "--num-requests", "100"]) == 0
    out = capsys.readouterr().out
    assert "SLO attainment" in out and "p150a" in out and "a100-pcie" in out


def test_simulate_writes_records_and_summary(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "150", "--seed", "3", "--out", str(tmp_path)]) == 0
    records = pd.read_parquet(tmp_path / "records.parquet")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(records) == 150 == summary["num_requests"]
    assert (records["status"] == "ok").sum() == summary["num_finished"]


def test_summarization_uses_its_own_slos(capsys):
    summary = run_json(capsys, "simulate", "--workload", "summarization", "--num-requests", "50",
                       "--json")
    assert summary["ttft_slo_s"] == 15.0 and summary["tpot_slo_s"] == 0.2


def test_duration_bounds_the_arrivals(capsys):
    summary = run_json(capsys, "simulate", "--duration", "120", "--rate", "1.0", "--json")
    assert 80 <= summary["num_requests"] <= 170      # Poisson(120), 4 sigma


def test_bad_values_exit_2_naming_the_field(capsys):
    assert main(["simulate", "--rate", "-1"]) == 2
    assert "workload.rate must be" in capsys.readouterr().err


def test_sweep_reports_a_knee(capsys):
    result = run_json(capsys, "sweep", "--rates", "0.5,4,8", "--num-requests", "300",
                      "--workers", "1", "--json")
    rates = [row["rate"] for row in result["rows"]]
    assert rates == [0.5, 4.0, 8.0]
    attainment = [row["slo_attainment"] for row in result["rows"]]
    assert attainment[0] >= 0.9 > attainment[-1]
    assert result["knee_rate"] in (0.5, 4.0)


@pytest.mark.parametrize("text,expected", [("0.1:0.3:0.1", [0.1, 0.2, 0.3]),
                                           ("1,2", [1.0, 2.0])])
def test_rate_grids(text, expected):
    from sim.runs.sweep import parse_rates

    assert parse_rates(text) == pytest.approx(expected)


def test_rate_grid_errors_name_the_flag():
    from sim.config import ConfigError
    from sim.runs.sweep import parse_rates

    with pytest.raises(ConfigError, match="--rates"):
        parse_rates("1:0:0.1")


def test_simulate_replays_a_real_trace(capsys):
    from traces.bundled import data_path

    azure = data_path("azure-llm-2023-conv.csv")        # shipped in traces/data/
    summary = run_json(capsys, "simulate", "--trace", str(azure), "--num-requests", "400",
                       "--json")
    assert summary["num_requests"] == 400
    assert summary["num_finished"] + summary["num_failed"] == 400


def test_simulate_names_the_bad_trace_row(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:47.0000000,abc,10\n"
                    "2023-11-16 18:15:48.0000000,200,12\n")
    assert main(["simulate", "--trace", str(path), "--json"]) == 2
    err = capsys.readouterr().err
    assert "t.csv" in err and "line 3" in err and "ContextTokens" in err
    summary = run_json(capsys, "simulate", "--trace", str(path), "--skip-bad", "--json")
    assert summary["num_requests"] == 2


def test_mechanism_flag_selects_the_transfer_path(capsys):
    hawk = run_json(capsys, "simulate", "--num-requests", "200", "--json")
    host = run_json(capsys, "simulate", "--num-requests", "200", "--mechanism", "GN-Host",
                    "--json")
    assert host["ttft_p50_s"] > hawk["ttft_p50_s"]        # host staging costs time


def test_bench_reports_rates_and_ratios(capsys):
    report = run_json(capsys, "bench", "--num-requests", "2000", "--rate", "0.5",
                      "--repeats", "2", "--memory-requests", "2000", "--json")
    assert report["num_requests"] == 2000 and report["repeats"] == 2
    assert report["python"] == platform.python_version()      # the ratios depend on it
    spread = report["per_repeat"]                    # each repeat's own ratios
    assert all(len(v) == 2 and min(v) > 0 for v in spread.values())
    assert min(spread["requests_per_bare_event"]) <= report[
        "requests_per_bare_event_paired_median"] <= max(spread["requests_per_bare_event"])
    assert "each repeat on its own" in bench.format_report(report)
    assert report["requests_per_bare_event"] == pytest.approx(
        report["simulated_requests_per_s"] / report["bare_simpy_events_per_s"])
    assert report["long_output_wall_ratio"] == pytest.approx(
        report["long_output_wall_s"] / report["wall_s"])
    assert report["long_output_same_rate_wall_ratio"] == pytest.approx(
        report["long_output_same_rate_wall_s"] / report["wall_s"])
    assert report["long_output_rate"] == pytest.approx(0.05)
    assert 0 < report["slo_attainment"] <= 1
    assert 0 < report["decode_wakeups_per_request"] <= 1     # one per finish at most here
    assert report["peak_rss_mb"] > 10 and report["peak_rss_mb_streamed"] > 10


def test_bench_refuses_zero_repeats(capsys):
    assert main(["bench", "--repeats", "0"]) != 0
    assert "--repeats" in capsys.readouterr().err
