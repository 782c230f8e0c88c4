"""Side-by-side metrics of two runs: simulator vs real, trace vs trace.

A *run* is a records file (``.parquet``/``.csv`` written by ``traces.schema.write_records``) or
a directory holding ``records.parquet`` (or ``records.csv``) and optionally ``summary.json``.
A plain trace file (any format ``traces.loaders`` reads) can stand in for a run: it has no
outcomes, so only its workload rows are filled.

Both sides are judged under the same SLOs. Workload rows describe what was offered (from
arrival instants and lengths); outcome rows are ``traces.metrics.summarize`` of the records.
Numbers a run's ``summary.json`` adds beyond that are shown too: a replay's send lag, and,
where the server reported its own timings (llama-server's ``timings``), the server's TTFT
beside the client's (``server_ttft_*``, ``ttft_client_minus_server_p50_s``: queueing, HTTP and
streaming on top of the server's prompt time) and the prompt tokens it evaluated or took from
its cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.schema import read_records

OUTCOME_ROWS = ("num_finished", "num_failed", "num_unfinished", "slo_attainment",
                "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
                "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "tpot_mean_s",
                "e2e_p50_s", "e2e_p99_s", "output_tokens_per_s", "requests_per_s")
EXTRA_ROWS = ("send_lag_p50_s", "send_lag_p99_s", "send_lag_max_s", "itl_p50_s", "itl_p99_s",
              "server_ttft_p50_s", "server_ttft_p99_s", "ttft_client_minus_server_p50_s",
              "server_prompt_tokens_evaluated", "server_cached_tokens", "num_usage_mismatch")


@dataclass(frozen=True)
class Run:
    """One side of a comparison: a records frame (None for a bare trace) and its workload."""

    path: str
    workload: dict
    frame: object = None            # records DataFrame, or None for a trace
    summary_file: dict | None = None


def load_run(path, trace_format: str | None = None, skip_bad: bool = False) -> Run:
    """A run directory, a records file, or a trace file (then without outcomes)."""
    path = Path(path)
    if path.is_dir():
        records = next((path / n for n in ("records.parquet", "records.csv")
                        if (path / n).is_file()), None)
        if records is None:
            raise FileNotFoundError(f"{path}: no records.parquet or records.csv in this directory")
        summary_path = path / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        frame = read_records(records)
        return Run(str(path), workload_stats(*_columns(frame)), frame, summary)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such run directory, records file or trace")
    if _is_records_file(path):
        frame = read_records(path)
        return Run(str(path), workload_stats(*_columns(frame)), frame)
    from traces.loaders import load_trace

    trace, _ = load_trace(path, trace_format, skip_bad=skip_bad)
    return Run(str(path), workload_stats(trace.arrival_at, trace.num_prompt_tokens,
                                         trace.num_output_tokens))


def workload_stats(arrival_at, num_prompt_tokens, num_output_tokens) -> dict:
    """What a trace offers: size, rate, burstiness (gap CV) and length percentiles."""
    arrivals = np.sort(np.asarray(arrival_at, dtype=float))
    span = float(arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    gaps = np.diff(arrivals)
    out = {"num_requests": int(len(arrivals)), "duration_s": span,
           "offered_rate_per_s": (len(arrivals) - 1) / span if span > 0 else math.nan,
           "gap_cv": float(np.std(gaps) / np.mean(gaps)) if len(gaps) and np.mean(gaps) > 0
           else math.nan}
    for name, values in (("prompt", num_prompt_tokens), ("output", num_output_tokens)):
        values = np.asarray(values, dtype=float)
        out[f"{name}_tokens_mean"] = float(np.mean(values)) if len(values) else math.nan
        for q in (50, 99):
            out[f"{name}_tokens_p{q}"] = float(np.percentile(values, q)) if len(values) \
                else math.nan
    return out


def compare_runs(a: Run, b: Run, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """Metrics of both runs under the same SLOs, as ``{"rows": [[name, a, b], ...]}``."""
    from traces.metrics import summarize

    sides = []
    for run in (a, b):
        metrics = dict(run.workload)
        if run.frame is not None:
            summary = summarize(run.frame, ttft_slo_s, tpot_slo_s)
            metrics.update({k: summary[k] for k in OUTCOME_ROWS})
        for key in EXTRA_ROWS:
            if run.summary_file and key in run.summary_file:
                metrics[key] = run.summary_file[key]
        sides.append(metrics)
    names = list(a.workload) + [k for k in OUTCOME_ROWS + EXTRA_ROWS
                                if k in sides[0] or k in sides[1]]
    rows = [[k, _clean(sides[0].get(k)), _clean(sides[1].get(k))] for k in names]
    return {"a": a.path, "b": b.path, "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s,
            "rows": rows}


def format_table(comparison: dict) -> str:
    """A fixed-width table: metric, A, B, B - A, B / A."""
    header = ["metric", "A", "B", "B - A", "B / A"]
    lines = [[name, _fmt(x), _fmt(y), _fmt(_diff(x, y)), _fmt(_ratio(x, y))]
             for name, x, y in comparison["rows"]]
    widths = [max(len(row[i]) for row in [header] + lines) for i in range(len(header))]
    out = [f"A: {comparison['a']}", f"B: {comparison['b']}",
           f"SLOs: TTFT {comparison['ttft_slo_s']:g} s, TPOT {comparison['tpot_slo_s']:g} s", ""]
    for row in [header] + lines:
        out.append("  ".join([row[0].ljust(widths[0])] +
                             [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]))
    return "\n".join(out)


def _is_records_file(path: Path) -> bool:
    from traces.schema import RECORD_COLUMNS

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
    elif path.suffix == ".csv":
        with open(path, encoding="utf-8") as f:
            names = f.readline().strip().split(",")
    else:
        return False
    return set(RECORD_COLUMNS) <= set(names)


def _columns(frame):
    return (frame["arrival_at"].to_numpy(), frame["num_prompt_tokens"].to_numpy(),
            frame["num_output_tokens"].to_numpy())


def _clean(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _diff(x, y):
    return None if x is None or y is None else y - x


def _ratio(x, y):
    return None if x is None or y is None or x == 0 else y / x


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return f"{value:.4g}"
