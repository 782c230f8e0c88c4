"""Metrics: pure functions of per-request records. The one place they are defined.

For request r: a_r arrival, f_r first token delivered to the client, c_r completion, n_r
tokens delivered.

- TTFT = f_r - a_r (queueing + prefill + KV transfer, in the disaggregated system).
- TPOT = (c_r - f_r) / (n_r - 1); undefined for n_r = 1, which meets any TPOT SLO.
- E2E  = c_r - a_r.
- SLO attainment = share of *all* arrived requests with status ``ok`` meeting both the TTFT
  and the TPOT SLO (failed, rejected and unfinished requests count as misses).
- Output throughput = tokens delivered by ok requests / (last completion - first arrival).
- Steady-state output throughput = tokens delivered by ok requests inside the window between
  the arrivals' ``trim`` and 1 - ``trim`` quantiles, / the window's length: the start's ramp
  and the end's drain left out, so it does not move with the run's length. A request delivers
  its first token at f_r and the other n_r - 1 evenly over (f_r, c_r].
- Goodput = the highest rate with attainment >= target (``knee``, over a sweep's points;
  searched by simulation in ``sim.runs.knee``).
- TTFT by stage, for ok requests: queueing (prefill_start - a), prefill (prefill_end -
  prefill_start), transfer wait (transfer_start - prefill_end: the KV cache waits for the
  decode side to pull it), transfer (transfer_end - transfer_start) and first decode step
  (f - transfer_end). The stages add up to TTFT, so their means add up to the mean TTFT.
- Utilisation of a resource = its busy time / the simulated time, averaged over instances.
- Decode occupancy = the time-averaged number of requests in decode (Little's law: the sum of
  f_r..c_r spans over the run) / the decode batch slots (instances x max batch size). A decode
  instance iterates whenever one request is in its batch, so occupancy, not busy time, says
  how close it is to full; it is the decode side's load when naming the most loaded stage.

Every function takes the records DataFrame of ``traces.schema`` and touches nothing else.
A streamed run (``sim.engine.stream``) never holds all its records: ``traces.aggregate`` computes
``summarize``'s keys from these same functions a row group at a time, with sketched
percentiles (within a stated relative error, named in the summary's ``percentiles`` entry).
"""

from __future__ import annotations

import math

import numpy as np

from traces.schema import Status

PERCENTILES = (50, 90, 99)
#: (stage, from instant, to instant): consecutive spans that add up to TTFT
TTFT_STAGES = (("queue", "arrival_at", "prefill_start_at"),
               ("prefill", "prefill_start_at", "prefill_end_at"),
               ("transfer_wait", "prefill_end_at", "transfer_start_at"),
               ("transfer", "transfer_start_at", "transfer_end_at"),
               ("first_decode", "transfer_end_at", "first_token_at"))
#: what each failed status means, for text output (``traces.schema.Status``)
FAILURE_REASONS = {
    "rejected_decode_capacity": "prompt + output KV never fits a decode instance",
    "rejected_prefill_capacity": "prompt KV never fits a prefill send buffer",
    "rejected_prompt_too_long": "prompt over the batch token budget or the model's context",
    "failed_out_of_memory": "decode side could not allocate the receive buffer",
    "failed_transfer": "KV transfer failed",
    "failed_instance_lost": "the instance holding it was lost",
    "failed_timeout": "did not finish within its deadline",
    "failed_error": "backend or endpoint error",
    "failed_truncated": "stream ended early",
    "failed_client": "the client ran out of a resource",
    "unfinished": "still running when the run ended",
}


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


def steady_output_tokens_per_s(frame, trim: float = 0.1) -> float:
    """Tokens delivered by ok requests per second inside the steady window (the arrivals'
    ``trim`` to 1 - ``trim`` quantiles); NaN when the window is empty."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim = {trim} must be in [0, 0.5)")
    if len(frame) == 0:
        return math.nan
    lo, hi = np.quantile(frame["arrival_at"].to_numpy(), [trim, 1.0 - trim])
    if not hi > lo:
        return math.nan
    ok = ok_mask(frame)
    first = frame["first_token_at"].to_numpy()[ok]
    done = frame["finished_at"].to_numpy()[ok]
    n = frame["num_generated_tokens"].to_numpy()[ok].astype(float)
    tokens = ((first >= lo) & (first <= hi)).astype(float)
    span = done - first
    inside = np.clip(np.minimum(done, hi) - np.maximum(first, lo), 0.0, None)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(span > 0, inside / span, ((done > lo) & (done <= hi)).astype(float))
    tokens += np.where(n > 1, (n - 1) * share, 0.0)
    return float(tokens.sum() / (hi - lo))


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
    out.update(ttft_breakdown(frame))
    return out


def ttft_breakdown(frame) -> dict[str, float]:
    """Mean and P90 of each TTFT stage over ok requests (``TTFT_STAGES``); NaN where no ok
    request recorded the stage's instants (e.g. a replay, which sees only the first token)."""
    ok = ok_mask(frame)
    out = {}
    for stage, start, end in TTFT_STAGES:
        span = (frame[end] - frame[start]).to_numpy(dtype=float)[ok]
        span = span[~np.isnan(span)]
        out[f"ttft_{stage}_mean_s"] = float(span.mean()) if len(span) else math.nan
        out[f"ttft_{stage}_p90_s"] = float(np.percentile(span, 90)) if len(span) else math.nan
    return out


def mean_in_decode(frame, span_s: float) -> float:
    """Time-averaged number of requests being decoded (Little's law): the summed decode spans,
    first token to finish, of every request that had both, over ``span_s`` seconds."""
    first = frame["first_token_at"].to_numpy(dtype=float)
    done = frame["finished_at"].to_numpy(dtype=float)
    spans = done - first
    return float(np.nansum(spans)) / span_s if span_s > 0 else math.nan


def utilization(stats: dict, span_s: float, decode_occupancy: float | None = None) -> dict:
    """Busy share of prefill, link and decode over ``span_s`` seconds (mean over instances),
    and which of them is most loaded: the one that limits capacity as the load grows.

    A decode instance iterates whenever one request is in its batch, so its busy share nears
    1 long before it runs out of room. ``decode_occupancy`` (the mean share of its batch slots
    in use, ``mean_in_decode`` over the slots) is its load when given, and is reported too."""
    if not span_s > 0:
        return {"prefill_utilization": math.nan, "link_utilization": math.nan,
                "decode_utilization": math.nan, "decode_occupancy": math.nan,
                "bottleneck": None}
    shares = {"prefill": float(np.mean(stats["prefill_busy_s"])) / span_s,
              "link": float(stats["link_busy_s"]) / span_s,
              "decode": float(np.mean(stats["decode_busy_s"])) / span_s}
    out = {f"{name}_utilization": share for name, share in shares.items()}
    if decode_occupancy is not None:
        out["decode_occupancy"] = shares["decode"] = decode_occupancy
    out["bottleneck"] = max(shares, key=shares.get)
    return out


def failure_reasons(statuses: dict[str, int]) -> list[str]:
    """``"name: count (what it means)"`` for each failed status of a ``status_counts``."""
    return [f"{name}: {n} ({FAILURE_REASONS.get(name, 'see traces.schema.Status')})"
            for name, n in statuses.items() if name != Status.OK.value and n]


def knee(rates, attainments, target: float = 0.9, interpolate: bool = False) -> float:
    """The knee of a sweep: the highest rate whose attainment is >= ``target`` (goodput).

    The points are taken in rate order. Attainment need not fall monotonically: a noisy dip
    below the target followed by a pass at a higher rate keeps the higher rate (the highest
    passing rate, not the first crossing). A NaN attainment is a miss.

    - ``interpolate=False``: that swept rate itself (``hawk sweep``, ``hawk paper``).
    - ``interpolate=True``: linear between it and the next swept rate (which misses), where
      attainment crosses ``target``, so the knee moves smoothly with attainment (the paper
      fit's objective, ``sim.paper.calibrate``). It lies in [that rate, the next rate).
    - No rate passes: NaN. Every rate passes: the highest swept rate (the knee lies beyond the
      range; the caller says so, e.g. ``knee_beyond_range`` in ``sim.runs.sweep``).

    A search for the knee by simulating at chosen rates is ``sim.runs.knee``."""
    points = sorted(zip(rates, attainments), key=lambda point: point[0])
    passing = [k for k, (_, value) in enumerate(points) if value >= target]
    if not passing:
        return math.nan
    k = passing[-1]
    rate, value = points[k]
    if not interpolate or k == len(points) - 1:
        return rate
    next_rate, next_value = points[k + 1]
    if not math.isfinite(next_value):
        return rate
    return rate + (value - target) / (value - next_value) * (next_rate - rate)


def _span(frame) -> float:
    ok = ok_mask(frame)
    return float(np.nanmax(frame["finished_at"].to_numpy()[ok]) - frame["arrival_at"].min())
