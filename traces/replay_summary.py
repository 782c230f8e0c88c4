"""The summary of one replay: the simulator's metrics plus what only a client against a live
server knows (send lag, inter-token latency, where token counts came from, finish reasons,
disagreeing usage counts, and the server's own timings where it reports them).

Server TTFT is llama-server's ``timings.prompt_ms``: the server's time to evaluate the prompt,
from the moment a slot took the request (so without the server's queueing and the network).
``ttft_client_minus_server_p50_s`` is the median over ok requests of the client's TTFT minus
that: queueing, HTTP and streaming overhead together.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def replay_summary(result, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """A flat dict, JSON-ready (NaN becomes None)."""
    from traces.metrics import percentiles, summarize
    from traces.schema import Status
    from traces.tenants import by_tenant

    records, client = result.records, result.client
    out = summarize(records, ttft_slo_s, tpot_slo_s)
    lag = client["send_lag_s"].to_numpy(dtype=float)
    p = percentiles(lag, (50, 99))
    out.update(send_lag_p50_s=p[50], send_lag_p99_s=p[99],
               send_lag_max_s=float(np.nanmax(lag)) if np.any(~np.isnan(lag)) else math.nan)
    p = percentiles(result.itl["latency_s"].to_numpy(dtype=float), (50, 99))
    out.update(itl_p50_s=p[50], itl_p99_s=p[99])
    ok = (records["status"] == Status.OK.value).to_numpy()
    short = ok & (records["num_generated_tokens"] < records["num_output_tokens"]).to_numpy()
    out.update(num_short_outputs=int(short.sum()), endpoint=result.endpoint, mode="replay",
               model=result.model, top_errors=top_errors(records, client))
    out["token_count_sources"] = dict(sorted(Counter(client["token_count_source"]).items()))
    out["finish_reasons"] = dict(sorted(Counter(r or "none" for r in client["finish_reason"])
                                        .items()))
    out["num_usage_mismatch"] = int(client["usage_mismatch"].sum())
    out.update(_server_numbers(records, client, ok))
    tenants = by_tenant(records, ttft_slo_s, tpot_slo_s)
    if tenants is not None:
        out["tenants"] = tenants
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def top_errors(records, client, limit: int = 5) -> list[dict]:
    """The most common error texts of failed requests, most frequent first (ties by text):
    ``[{"error": text, "status": status, "count": n}, ...]``, at most ``limit``."""
    from traces.schema import Status

    failed = (records["status"] != Status.OK.value).to_numpy()
    counts = Counter(zip(client["error"].to_numpy()[failed], records["status"].to_numpy()[failed]))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return [{"error": text or "(no error text)", "status": status, "count": n}
            for (text, status), n in ranked]


def _server_numbers(records, client, ok: np.ndarray) -> dict:
    from traces.metrics import percentiles

    out = {}
    for key in ("server_prompt_tokens_evaluated", "server_cached_tokens"):
        values = client[key].dropna()
        out[key] = int(values.sum()) if len(values) else None
    server = client["server_prompt_ms"].to_numpy(dtype=float) / 1e3
    has = ok & ~np.isnan(server)
    if not has.any():
        return out
    ttft = (records["first_token_at"] - records["arrival_at"]).to_numpy(dtype=float)
    p = percentiles(server[has], (50, 99))
    out.update(server_ttft_p50_s=p[50], server_ttft_p99_s=p[99],
               ttft_client_minus_server_p50_s=float(np.median(ttft[has] - server[has])))
    return out
