"""Trace shaping: cut a time window, replay faster or slower, cap lengths, sample.

Every function takes a ``Trace`` and returns a new one; none changes a value without counting
it. ``shape(trace, spec)`` applies a ``ShapeSpec`` in a fixed order -- window, sample, rate
scale, length caps -- and returns a ``ShapeReport`` that says what each step did.

- ``window(trace, start_s, end_s)``: requests with ``start_s <= arrival_at < end_s``, re-based
  so that ``start_s`` becomes 0.0 (the gap before the first request is kept).
- ``scale_rate(trace, factor)``: arrival instants divided by ``factor``; 2.0 replays the same
  requests twice as fast (twice the request rate). Lengths are untouched.
- ``cap_lengths``: prompt / output lengths above a cap are truncated to it (``mode="truncate"``)
  or the request is dropped (``mode="drop"``); both are counted.
- ``sample``: independent thinning with probability ``fraction`` (a thinned Poisson process
  stays Poisson, at ``fraction`` x the rate) or exactly ``num_requests`` chosen uniformly;
  arrival order and request ids are kept. Driven by an explicit ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from traces.trace import Trace

CAP_MODES = ("truncate", "drop")


@dataclass(frozen=True)
class ShapeSpec:
    """What to do to a trace; the defaults change nothing."""

    start_s: float = 0.0
    end_s: float | None = None
    sample_fraction: float | None = None
    sample_requests: int | None = None
    rate_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    cap_mode: str = "truncate"
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s must be finite and >= 0, got {self.start_s}")
        if self.end_s is not None and not self.end_s > self.start_s:
            raise ValueError(f"end_s must be > start_s ({self.start_s}), got {self.end_s}")
        if self.sample_fraction is not None and self.sample_requests is not None:
            raise ValueError("give sample_fraction or sample_requests, not both")
        _check_fraction(self.sample_fraction)
        if self.sample_requests is not None and self.sample_requests < 1:
            raise ValueError(f"sample_requests must be >= 1, got {self.sample_requests}")
        _check_factor(self.rate_scale)
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cap_mode not in CAP_MODES:
            raise ValueError(f"cap_mode {self.cap_mode!r} is not one of {list(CAP_MODES)}")


@dataclass(frozen=True)
class ShapeReport:
    """Counts of what ``shape`` removed or changed."""

    num_in: int
    num_out: int
    num_outside_window: int = 0
    num_sampled_out: int = 0
    num_prompt_capped: int = 0
    num_output_capped: int = 0
    num_dropped_by_caps: int = 0
    rate_scale: float = 1.0

    def describe(self) -> str:
        parts = [f"{self.num_out} of {self.num_in} requests kept"]
        for label, n in (("outside the window", self.num_outside_window),
                         ("sampled out", self.num_sampled_out),
                         ("dropped by length caps", self.num_dropped_by_caps),
                         ("prompts truncated to the cap", self.num_prompt_capped),
                         ("outputs truncated to the cap", self.num_output_capped)):
            if n:
                parts.append(f"{n} {label}")
        if self.rate_scale != 1.0:
            parts.append(f"arrivals {self.rate_scale:g}x faster")
        return "; ".join(parts)


def offered_load(num_requests: int, span_s: float) -> dict:
    """What a trace offers: its requests, the span of their arrivals (first to last) and the
    rate over that span (NaN for a single request or a span of 0)."""
    return {"num_requests": int(num_requests), "span_s": float(span_s),
            "rate": (num_requests - 1) / span_s if span_s > 0 else math.nan}


def parse_window(text: str | None, flag: str = "--window") -> tuple[float, float | None]:
    """``"START:END"`` seconds (either may be empty: ``"60:"``, ``":120"``) -> (start, end)."""
    if text is None:
        return 0.0, None
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start_s, end_s = float(start or 0.0), (float(end) if end else None)
    except ValueError:
        raise ValueError(f"{flag} takes START:END in seconds, got {text!r}") from None
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"{flag} {text!r}: START must be finite and >= 0 seconds")
    if end_s is not None and not (math.isfinite(end_s) and end_s > start_s):
        raise ValueError(f"{flag} {text!r}: END must be finite and > START")
    return start_s, end_s


def window(trace: Trace, start_s: float = 0.0, end_s: float | None = None) -> Trace:
    """Requests arriving in [start_s, end_s), shifted so that start_s is 0.0."""
    keep = trace.arrival_at >= start_s
    if end_s is not None:
        keep &= trace.arrival_at < end_s
    return Trace(trace.arrival_at[keep] - start_s, trace.num_prompt_tokens[keep],
                 trace.num_output_tokens[keep], trace.request_id[keep], name=trace.name,
                 tenant=None if trace.tenant is None else trace.tenant[keep],
                 **trace.hashes_at(keep))


def scale_rate(trace: Trace, factor: float) -> Trace:
    """The same requests with arrivals ``factor`` times as dense (2.0: twice as fast)."""
    _check_factor(factor)
    return Trace(trace.arrival_at / factor, trace.num_prompt_tokens, trace.num_output_tokens,
                 trace.request_id, name=trace.name, tenant=trace.tenant,
                 **trace.hashes_at(slice(None)))


def cap_lengths(trace: Trace, max_prompt_tokens: int | None = None,
                max_output_tokens: int | None = None,
                mode: str = "truncate") -> tuple[Trace, dict[str, int]]:
    """Apply length caps; return the trace and counts of truncated prompts/outputs or drops."""
    if mode not in CAP_MODES:
        raise ValueError(f"cap mode {mode!r} is not one of {list(CAP_MODES)}")
    prompt_over = _over(trace.num_prompt_tokens, max_prompt_tokens)
    output_over = _over(trace.num_output_tokens, max_output_tokens)
    if mode == "drop":
        keep = ~(prompt_over | output_over)
        counts = {"num_dropped_by_caps": int((~keep).sum())}
        return trace.select(keep), counts
    prompt = np.minimum(trace.num_prompt_tokens, max_prompt_tokens or np.iinfo(np.int64).max)
    output = np.minimum(trace.num_output_tokens, max_output_tokens or np.iinfo(np.int64).max)
    counts = {"num_prompt_capped": int(prompt_over.sum()),
              "num_output_capped": int(output_over.sum())}
    hashes = trace.hashes_at(slice(None))
    if hashes:                  # a truncated prompt keeps the hashes of its blocks left
        blocks = (-(-prompt // trace.hash_block_size)).tolist()
        hashes["hash_ids"] = [ids[:b] for ids, b in zip(trace.hash_ids, blocks)]
    return Trace(trace.arrival_at, prompt, output, trace.request_id, name=trace.name,
                 tenant=trace.tenant, **hashes), counts


def sample(trace: Trace, rng: np.random.Generator, fraction: float | None = None,
           num_requests: int | None = None) -> Trace:
    """Thin each request with probability ``fraction``, or pick exactly ``num_requests``."""
    if (fraction is None) == (num_requests is None):
        raise ValueError("give exactly one of fraction or num_requests")
    if fraction is not None:
        _check_fraction(fraction)
        return trace.select(rng.random(len(trace)) < fraction)
    if not 1 <= num_requests <= len(trace):
        raise ValueError(f"num_requests must be in 1..{len(trace)}, got {num_requests}")
    chosen = np.sort(rng.choice(len(trace), size=num_requests, replace=False))
    return trace.select(chosen)


def shape(trace: Trace, spec: ShapeSpec) -> tuple[Trace, ShapeReport]:
    """Window, sample, rate scale and caps, in that order, with a report of each step."""
    num_in = len(trace)
    out = window(trace, spec.start_s, spec.end_s)
    num_outside = num_in - len(out)
    before = len(out)
    rng = np.random.default_rng(spec.seed)
    if spec.sample_fraction is not None or spec.sample_requests is not None:
        num = min(spec.sample_requests, len(out)) if spec.sample_requests else None
        out = sample(out, rng, spec.sample_fraction, num) if len(out) else out
    num_sampled_out = before - len(out)
    if spec.rate_scale != 1.0:
        out = scale_rate(out, spec.rate_scale)
    out, counts = cap_lengths(out, spec.max_prompt_tokens, spec.max_output_tokens, spec.cap_mode)
    report = ShapeReport(num_in, len(out), num_outside, num_sampled_out,
                         rate_scale=spec.rate_scale, **counts)
    return out, report


def _over(values: np.ndarray, cap: int | None) -> np.ndarray:
    if cap is None:
        return np.zeros(len(values), dtype=bool)
    if cap < 1:
        raise ValueError(f"length cap must be >= 1, got {cap}")
    return values > cap


def _check_factor(factor: float) -> None:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"rate scale must be finite and > 0, got {factor}")


def _check_fraction(fraction: float | None) -> None:
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
