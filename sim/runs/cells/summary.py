"""The merged summary of a cells run, computed from its merged records file by streaming.

``summarize_file(path, ...)`` gives what ``traces.metrics.summarize`` gives for the whole
records table, without loading it: counts, SLO attainment and throughput are summed over
batches (exact: integer counts, a max and a min), and each latency metric is gathered one at a
time as one array of per-request values, then measured by the same numpy calls over the same
values in the same order (request id). So memory holds one metric's column (8 bytes a
request), never the records, and the numbers equal ``metrics.summarize`` on the whole table
(tested). Per-tenant rows (``traces.tenants``) take one such summary per tenant.

``merged_summary`` adds what ``sim.engine.cluster.simulate`` adds, over all cells: the simulated time
(the longest cell's), utilisation over every instance of every cell, decode occupancy, power
and cost of the whole cluster and the config (``sim.runs.cells.run`` adds its ``cells`` section).
Wall-clock times are left out, so the summary is the same bytes however the cells ran.

``aggregate_summary`` gives the same keys for cells that streamed (``sim.runs.cells.stream``) from
their merged ``traces.aggregate.RecordsAggregate``: counts exact, percentiles sketched.
"""

from __future__ import annotations

import math

import numpy as np

from traces import metrics
from traces.schema import Status

#: rows per batch read from the merged records
READ_BATCH_ROWS = 65_536
_COUNT_COLUMNS = ("status", "arrival_at", "first_token_at", "finished_at",
                  "num_generated_tokens", "kv_bytes")


def _frames(path, columns, tenant: str | None = None):
    """The records of ``path`` as small DataFrames of ``columns`` (only ``tenant``'s rows)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names = list(columns) + (["tenant"] if tenant is not None else [])
    file = pq.ParquetFile(path, pre_buffer=False)      # not the whole file at once
    for batch in file.iter_batches(batch_size=READ_BATCH_ROWS, columns=names):
        if tenant is not None:
            batch = batch.filter(pc.equal(batch.column("tenant"), tenant))
        yield batch.to_pandas()


def _gather(path, columns, values, tenant: str | None = None) -> np.ndarray:
    """``values(frame)`` of every batch, concatenated: one metric over all records."""
    parts = [values(frame) for frame in _frames(path, columns, tenant)]
    return np.concatenate(parts) if parts else np.empty(0)


def _counts(path, ttft_slo_s: float, tpot_slo_s: float, tenant: str | None) -> dict:
    """Everything of ``metrics.summarize`` that sums over batches."""
    n = ok_n = failed = unfinished = met = tokens = kv = 0
    statuses: dict[str, int] = {}
    first_arrival, last_finish = math.inf, -math.inf
    for f in _frames(path, _COUNT_COLUMNS, tenant):
        ok = metrics.ok_mask(f)
        finished = (f["status"] != Status.UNFINISHED.value).to_numpy(dtype=bool)
        n, ok_n = n + len(f), ok_n + int(ok.sum())
        failed += int((~ok & finished).sum())
        unfinished += int((~finished).sum())
        met += int(metrics.slo_met(f, ttft_slo_s, tpot_slo_s).sum())
        tokens += int(f["num_generated_tokens"].to_numpy()[ok].sum())
        kv += int(f["kv_bytes"].sum())
        for status, count in metrics.status_counts(f).items():
            statuses[status] = statuses.get(status, 0) + count
        if len(f):
            first_arrival = min(first_arrival, float(f["arrival_at"].min()))
        if ok.any():
            last_finish = max(last_finish, float(np.nanmax(f["finished_at"].to_numpy()[ok])))
    span = last_finish - first_arrival
    return {"num_requests": n, "num_finished": ok_n, "num_failed": failed,
            "num_unfinished": unfinished,
            "statuses": {s.value: statuses[s.value] for s in Status if statuses.get(s.value)},
            "slo_attainment": met / n if n else math.nan,
            "output_tokens_per_s": (tokens / span if span > 0 else math.nan) if ok_n else 0.0,
            "requests_per_s": ok_n / span if ok_n else 0.0,
            "kv_bytes_total": kv, "span_s": span, "tokens": tokens}


def summarize_file(path, ttft_slo_s: float, tpot_slo_s: float,
                   tenant: str | None = None) -> dict:
    """``metrics.summarize`` of the records in ``path`` (of ``tenant``'s rows only, if given),
    streamed as the module docstring says."""
    counts = _counts(path, ttft_slo_s, tpot_slo_s, tenant)
    out = {k: counts[k] for k in ("num_requests", "num_finished", "num_failed",
                                  "num_unfinished", "statuses")}
    out.update({"ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s,
                "slo_attainment": counts["slo_attainment"]})
    latency = {"ttft": (("arrival_at", "first_token_at"), metrics.ttft),
               "tpot": (("first_token_at", "finished_at", "num_generated_tokens"), metrics.tpot),
               "e2e": (("arrival_at", "finished_at"), metrics.e2e)}
    for name, (columns, measure) in latency.items():
        values = _gather(path, ("status", *columns),
                         lambda f, m=measure: m(f)[metrics.ok_mask(f)], tenant)
        for q, v in metrics.percentiles(values).items():
            out[f"{name}_p{q}_s"] = v
        out[f"{name}_mean_s"] = (float(np.nanmean(values)) if np.any(~np.isnan(values))
                                 else math.nan)
    for key in ("output_tokens_per_s", "requests_per_s", "kv_bytes_total"):
        out[key] = counts[key]
    for stage, start, end in metrics.TTFT_STAGES:
        span = _gather(path, ("status", start, end), lambda f, a=start, b=end: (
            f[b] - f[a]).to_numpy(dtype=float)[metrics.ok_mask(f)], tenant)
        span = span[~np.isnan(span)]
        out[f"ttft_{stage}_mean_s"] = float(span.mean()) if len(span) else math.nan
        out[f"ttft_{stage}_p90_s"] = float(np.percentile(span, 90)) if len(span) else math.nan
    return out


def tenants_of_file(path, ttft_slo_s: float, tpot_slo_s: float) -> dict | None:
    """``traces.tenants.by_tenant`` of the records in ``path``; None without a tenant column."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from traces.tenants import TENANT_KEYS

    file = pq.ParquetFile(path, pre_buffer=False)
    if "tenant" not in file.schema_arrow.names:
        return None
    names: set[str] = set()
    for batch in file.iter_batches(batch_size=READ_BATCH_ROWS, columns=["tenant"]):
        names.update(pc.unique(batch.column("tenant")).to_pylist())
    span = _counts(path, ttft_slo_s, tpot_slo_s, None)["span_s"]
    out = {}
    for tenant in sorted(names):
        s = summarize_file(path, ttft_slo_s, tpot_slo_s, tenant)
        row = {key: s[key] for key in TENANT_KEYS if key in s}
        tokens = _counts(path, ttft_slo_s, tpot_slo_s, tenant)["tokens"]
        row["output_tokens_per_s"] = float(tokens) / span if span > 0 else math.nan
        out[tenant] = row
    return out


def merged_summary(path, config, cluster, stats: dict, span_s: float) -> dict:
    """The summary of a cells run (module docstring) from its merged records at ``path``:
    ``config`` the run's, ``cluster`` the whole cluster's (every cell's instances), ``stats``
    every instance's (``sim.runs.cells.run.pooled_stats``), ``span_s`` the longest cell's time."""
    slo = config.slo
    summary = summarize_file(path, slo.ttft_s, slo.tpot_s)
    tenants = tenants_of_file(path, slo.ttft_s, slo.tpot_s)
    if tenants is not None:
        summary["tenants"] = tenants
    decode_spans = _gather(path, ("first_token_at", "finished_at"),
                           lambda f: (f["finished_at"] - f["first_token_at"]).to_numpy(float))
    return _whole_cluster(summary, config, cluster, stats, span_s, float(np.nansum(decode_spans)))


def aggregate_summary(aggregate, config, cluster, stats: dict, span_s: float) -> dict:
    """The summary of a streamed cells run from the merge of its cells'
    ``traces.aggregate.RecordsAggregate``: exact counts, sketched percentiles (its
    ``percentiles`` entry states the bound), the rest as ``merged_summary``."""
    summary = aggregate.summary()
    tenants = aggregate.tenant_rows()
    if tenants is not None:
        summary["tenants"] = tenants
    return _whole_cluster(summary, config, cluster, stats, span_s, aggregate.decode_span_s)


def _whole_cluster(summary: dict, config, cluster, stats: dict, span_s: float,
                   decode_span_s: float) -> dict:
    """What ``sim.engine.cluster.simulate`` adds to a summary, over every cell: simulated time,
    utilisation and decode occupancy, power and cost, the config."""
    from sim.engine.cluster import _power_and_cost
    from sim.config import provenance

    summary["simulated_time_s"] = span_s
    slots = len(stats["decode_busy_s"]) * config.cluster.decode.max_batch_size
    occupancy = decode_span_s / span_s / slots if span_s > 0 else math.nan
    summary.update(metrics.utilization(stats, span_s, occupancy))
    summary.update(_power_and_cost(stats, summary, cluster))   # both shapes (sim.models.power)
    from sim.engine.prefix_cache import summary_of

    for side in ("", "decode_"):
        if f"{side}prefix_cache" in stats:
            summary.update(summary_of(stats[f"{side}prefix_cache"], side))
    summary["config"] = provenance(config)
    return summary
