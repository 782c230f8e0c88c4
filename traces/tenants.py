"""Per-tenant metrics: every summary broken down by the customer that sent each request.

A records table with a ``tenant`` column (``traces.schema.OPTIONAL_COLUMNS``) is split by
tenant and each part measured with ``traces.metrics`` under the run's SLOs. Output throughput
of a tenant is its delivered tokens over the *whole run's* span (first arrival to last finish
of any ok request), so the tenants' throughputs add up to the run's.
"""

from __future__ import annotations

import math

import numpy as np

from traces import metrics

#: keys of each tenant's row, in print order
TENANT_KEYS = ("num_requests", "num_failed", "slo_attainment", "ttft_p50_s", "ttft_p90_s",
               "tpot_p90_s", "output_tokens_per_s")


def by_tenant(frame, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, dict] | None:
    """``{tenant: {key: value}}`` in tenant name order; None when there is no tenant column."""
    if "tenant" not in frame.columns:
        return None
    ok = metrics.ok_mask(frame)
    span = (float(np.nanmax(frame["finished_at"].to_numpy()[ok]) - frame["arrival_at"].min())
            if ok.any() else math.nan)
    tenants = frame["tenant"].astype(str).to_numpy()
    out = {}
    for tenant in sorted(set(tenants.tolist())):
        part = frame[tenants == tenant]
        s = metrics.summarize(part, ttft_slo_s, tpot_slo_s)
        row = {key: s[key] for key in TENANT_KEYS if key in s}
        part_ok = metrics.ok_mask(part)
        tokens = float(part["num_generated_tokens"].to_numpy()[part_ok].sum())
        row["output_tokens_per_s"] = tokens / span if span > 0 else math.nan
        out[tenant] = row
    return out


def format_tenants(rows: dict[str, dict]) -> str:
    """A small table: one line per tenant."""
    width = max(8, *(len(t) for t in rows))
    head = (f"  {'tenant':<{width}} {'requests':>8} {'failed':>6} {'attainment':>10} "
            f"{'P90 TTFT s':>10} {'P90 TPOT s':>10} {'tok/s':>8}")
    lines = [head]
    for tenant, r in rows.items():
        lines.append(f"  {tenant:<{width}} {r['num_requests']:>8} {r['num_failed']:>6} "
                     f"{100 * r['slo_attainment']:>9.1f}% {r['ttft_p90_s']:>10.3f} "
                     f"{r['tpot_p90_s']:>10.4f} {r['output_tokens_per_s']:>8.1f}")
    return "\n".join(lines)
