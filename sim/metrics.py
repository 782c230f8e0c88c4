"""Metrics: pure functions of per-request records. The one place they are defined.

For request r: a_r arrival, f_r first token delivered to the client, c_r completion, n_r
tokens delivered.

- TTFT = f_r - a_r (queueing + prefill + KV transfer, in the disaggregated system).
- TPOT = (c_r - f_r) / (n_r - 1); undefined for n_r = 1, which meets any TPOT SLO.
- E2E  = c_r - a_r.
- SLO attainment = share of *all* arrived requests with status ``ok`` meeting both the TTFT
  and the TPOT SLO (failed, rejected and unfinished requests count as misses).
- Output throughput = tokens delivered by ok requests / (last completion - first arrival).
- Goodput = the highest rate with attainment >= target (``knee``, over a sweep).

Every function takes the records DataFrame of ``traces.schema`` and touches nothing else.
"""

from __future__ import annotations

import math

import numpy as np

from traces.schema import Status

PERCENTILES = (50, 90, 99)


def ttft(frame) -> np.ndarray:
    """TTFT in seconds per request; NaN where no first token was delivered."""
    return (frame["first_token_at"] - frame["arrival_at"]).to_numpy(dtype=float)


def tpot(frame) -> np.ndarray:
    """TPOT in seconds per request; NaN where undefined (n_r <= 1 or never finished)."""
    n = frame["num_generated_tokens"].to_numpy(dtype=float)
    span = (frame["finished_at"] - frame["first_token_at"]).to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 1, span / (n - 1), np.nan)


def e2e(frame) -> np.ndarray:
    return (frame["finished_at"] - frame["arrival_at"]).to_numpy(dtype=float)


def ok_mask(frame) -> np.ndarray:
    return (frame["status"] == Status.OK.value).to_numpy()


def slo_met(frame, ttft_slo_s: float, tpot_slo_s: float) -> np.ndarray:
    """Per request: ok, TTFT <= SLO and (TPOT <= SLO or undefined)."""
    t1, t2 = ttft(frame), tpot(frame)
    with np.errstate(invalid="ignore"):
        return ok_mask(frame) & (t1 <= ttft_slo_s) & (np.isnan(t2) | (t2 <= tpot_slo_s))


def slo_attainment(frame, ttft_slo_s: float, tpot_slo_s: float) -> float:
    if len(frame) == 0:
        return math.nan
    return float(slo_met(frame, ttft_slo_s, tpot_slo_s).mean())


def output_tokens_per_s(frame) -> float:
    """Tokens delivered by ok requests per second of the run (first arrival to last finish)."""
    ok = ok_mask(frame)
    if not ok.any():
        return 0.0
    span = float(np.nanmax(frame["finished_at"].to_numpy()[ok]) - frame["arrival_at"].min())
    tokens = float(frame["num_generated_tokens"].to_numpy()[ok].sum())
    return tokens / span if span > 0 else math.nan


def percentiles(values: np.ndarray, qs=PERCENTILES) -> dict[int, float]:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return {q: math.nan for q in qs}
    return dict(zip(qs, (float(v) for v in np.percentile(values, qs))))


def status_counts(frame) -> dict[str, int]:
    counts = frame["status"].value_counts()
    return {s.value: int(counts.get(s.value, 0)) for s in Status if counts.get(s.value, 0)}


def summarize(frame, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """The summary every mode prints: counts, attainment, latency percentiles, throughput."""
    ok = ok_mask(frame)
    finished = frame["status"] != Status.UNFINISHED.value
    out = {
        "num_requests": int(len(frame)),
        "num_finished": int(ok.sum()),
        "num_failed": int((~ok & finished.to_numpy()).sum()),
        "num_unfinished": int((~finished).sum()),
        "statuses": status_counts(frame),
        "ttft_slo_s": ttft_slo_s,
        "tpot_slo_s": tpot_slo_s,
        "slo_attainment": slo_attainment(frame, ttft_slo_s, tpot_slo_s),
    }
    for name, values in (("ttft", ttft(frame)[ok]), ("tpot", tpot(frame)[ok]),
                         ("e2e", e2e(frame)[ok])):
        for q, v in percentiles(values).items():
            out[f"{name}_p{q}_s"] = v
        out[f"{name}_mean_s"] = float(np.nanmean(values)) if np.any(~np.isnan(values)) else math.nan
    out["output_tokens_per_s"] = output_tokens_per_s(frame)
    out["requests_per_s"] = (float(ok.sum()) / _span(frame)) if ok.any() else 0.0
    out["kv_bytes_total"] = int(frame["kv_bytes"].sum())
    return out


def knee(rates, attainments, target: float = 0.9) -> float:
    """Highest swept rate whose attainment >= ``target``; NaN when none reaches it."""
    best = math.nan
    for rate, value in sorted(zip(rates, attainments)):
        if value >= target:
            best = rate
    return best


def _span(frame) -> float:
    ok = ok_mask(frame)
    return float(np.nanmax(frame["finished_at"].to_numpy()[ok]) - frame["arrival_at"].min())
