"""The real side of ``hawk validate --endpoint``: a replay of the trace against a live engine
(``traces.replay``), what the engine says of its own timing over it (vLLM's ``/metrics``,
``traces.engine_metrics``), the instants the client really sent each request, and the means
of where the time goes on both sides (``views``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from traces import engine_metrics
from traces.trace import Trace

#: requests a fresh engine or cluster serves before the measured ones (the profile excludes
#: warm-up too)
WARMUP_REQUESTS = 4


def endpoint_records(trace: Trace, endpoint: str, ttft_slo_s: float, tpot_slo_s: float,
                     out: Path, token_ids: tuple[int, int] = (3, 1000)):
    """Records of ``hawk replay`` of ``trace`` against a live engine (token-id prompts,
    forced lengths; written to ``out`` too), after ``WARMUP_REQUESTS`` lone requests."""
    from traces.prompts import PromptSpec
    from traces.replay import ReplayConfig, replay

    spec = PromptSpec(kind="token_ids", token_id_low=token_ids[0], token_id_high=token_ids[1],
                      seed=len(trace))
    warm = Trace.from_columns(np.arange(WARMUP_REQUESTS) * 0.1, [8] * WARMUP_REQUESTS,
                              [4] * WARMUP_REQUESTS, name="warm-up")
    replay(warm, ReplayConfig(endpoint, prompt=dataclasses.replace(spec, seed=1 + len(trace))))
    before = engine_metrics.scrape_sync(endpoint_base(endpoint))
    result = replay(trace, ReplayConfig(endpoint, prompt=spec))
    engine = engine_metrics.means(before, engine_metrics.scrape_sync(endpoint_base(endpoint)))
    result.write(out, ttft_slo_s, tpot_slo_s)
    lag = result.client["send_lag_s"].to_numpy(dtype=float)
    result.records.attrs["views"] = {"engine": engine, "client_send_lag_s": float(
        np.nanmean(lag)) if np.isfinite(lag).any() else None}
    result.records.attrs["sent_at"] = result.client["sent_at"].to_numpy(dtype=float)
    return result.records


def as_sent(real, trace: Trace):
    """The real records and the trace with each request arriving when the client sent it
    (``real.attrs["sent_at"]``, the replay's instant its headers left; its due instant where
    unknown; never before the one before it): a replay client that falls behind its schedule
    delays the engine's arrivals, and neither side should be judged for the client's lag.
    Unchanged without ``sent_at``."""
    sent = real.attrs.get("sent_at")
    if sent is None or len(sent) != len(trace):
        return real, trace
    due = np.asarray(trace.arrival_at, dtype=float)
    at = np.maximum.accumulate(np.where(np.isfinite(sent), np.maximum(sent, due), due))
    real = real.copy()
    real["arrival_at"] = at
    return real, dataclasses.replace(trace, arrival_at=at)


def endpoint_base(endpoint: str) -> str:
    from traces.replay import ReplayConfig

    return ReplayConfig(endpoint).models_url.removesuffix("/v1/models")


def views(real, sim) -> dict:
    """Means of where the time goes, three ways: the client's records, the engine's own
    (vLLM's ``/metrics`` over the replay, ``traces.engine_metrics``; empty without them) and
    the simulator's, in seconds."""
    from traces import metrics

    def side(frame) -> dict:
        ok = metrics.ok_mask(frame)
        return {f"{name}_s": float(np.nanmean(fn(frame)[ok])) if ok.any() else None
                for name, fn in (("ttft", metrics.ttft), ("tpot", metrics.tpot))}
    out = {"client": {**side(real), "send_lag_s": None}, "sim": side(sim), "engine": {}}
    ok = metrics.ok_mask(sim)
    if ok.any():      # the simulator's first step: from its start to the first token
        first = (sim["first_token_at"] - sim["prefill_start_at"]).to_numpy(dtype=float)
        out["sim"]["prefill_s"] = float(np.nanmean(first[ok]))
    seen = real.attrs.get("views") or {}
    out["client"]["send_lag_s"] = seen.get("client_send_lag_s")
    out["engine"] = seen.get("engine") or {}
    return out
