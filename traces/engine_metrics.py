"""What a vLLM engine says of its own timing: the histograms on its Prometheus ``/metrics``,
read before and after a stretch of work, and their means over that stretch.

vLLM V1 (``vllm/v1/metrics/stats.py``) times each request in two places. The API server's
output processor: ``time_to_first_token_seconds`` and ``e2e_request_latency_seconds`` from
the request's arrival at the API server (after its HTTP request was read) to when that
process handled the token. The engine core, by its own clock: ``request_queue_time_seconds``
(queued to first scheduled), ``request_prefill_time_seconds`` (first scheduled to the step
that gave the first token), ``request_decode_time_seconds`` (first to last token),
``request_time_per_output_token_seconds`` (that over the tokens after the first) and
``inter_token_latency_seconds`` (between a request's steps); ``iteration_tokens_total``
counts the tokens of each engine step. So the client's TTFT less the engine's queue and
prefill is the API server's and the client's share, and the client's TPOT less the engine's
is the stream's delivery.

An endpoint without ``/metrics`` (or not vLLM) gives ``{}``: every caller treats the
engine's view as unknown, never as zero.
"""

from __future__ import annotations

import re

#: histogram (name after ``vllm:``) -> the key its mean is reported under
HISTOGRAMS = {
    "time_to_first_token_seconds": "api_ttft_s",
    "e2e_request_latency_seconds": "api_e2e_s",
    "request_queue_time_seconds": "queue_s",
    "request_prefill_time_seconds": "prefill_s",
    "request_decode_time_seconds": "decode_s",
    "request_time_per_output_token_seconds": "tpot_s",
    "inter_token_latency_seconds": "itl_s",
    "iteration_tokens_total": "tokens_per_step",
}
_LINE = re.compile(r"^vllm:(\w+?)_(sum|count)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN|[+-]Inf)$")
_BUCKET = re.compile(r'^vllm:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} '
                     r'([-+0-9.eE]+)$')


def parse(text: str) -> dict[str, float]:
    """``{"<histogram>_sum": s, "<histogram>_count": n}`` for the histograms named in
    ``HISTOGRAMS`` (summed over label sets: one engine, one model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in HISTOGRAMS:
            key = f"{m.group(1)}_{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
        if line.startswith("process_cpu_seconds_total "):   # the API server's process
            out["process_cpu_seconds_total"] = float(line.split()[1])
        b = _BUCKET.match(line)
        if b:                   # the API server's TTFT histogram: its cumulative buckets
            key = f"ttft_le_{b.group(1)}"
            out[key] = out.get(key, 0.0) + float(b.group(2))
    return out


def ttft_percentile(before: dict, after: dict, q: float) -> float | None:
    """The API server's TTFT at quantile ``q`` (0..1) over what it observed between the two
    scrapes, interpolated linearly inside its histogram's bucket (vLLM's TTFT buckets: 1, 5,
    10, 20, 40, 60, 80, 100, 250 ms, ...); None when it observed nothing."""
    edges = sorted((float(k[len("ttft_le_"):]), after[k] - before.get(k, 0.0))
                   for k in after if k.startswith("ttft_le_"))
    if not edges or edges[-1][1] <= 0:
        return None
    target, low, below = q * edges[-1][1], 0.0, 0.0
    for edge, count in edges:
        if count >= target and count > below:
            if edge == float("inf"):
                return low
            return low + (edge - low) * (target - below) / (count - below)
        low, below = edge, count
    return low


async def scrape(http, base_url: str) -> dict[str, float]:
    """The histograms at ``base_url/metrics`` (``{}`` when there is no such page)."""
    try:
        async with http.get(base_url.rstrip("/") + "/metrics") as response:
            return parse(await response.text()) if response.status == 200 else {}
    except Exception:  # noqa: BLE001  (no metrics is an answer: the engine's view is unknown)
        return {}


def scrape_sync(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``scrape`` without an event loop (between replays)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return parse(r.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError, ValueError):
        return {}


def means(before: dict, after: dict) -> dict[str, float]:
    """Per histogram of ``HISTOGRAMS``, its mean over what was observed between the two
    scrapes (key ``HISTOGRAMS[name]``), and ``num_requests`` / ``num_steps`` (the TTFT and
    step-token counts), and ``api_cpu_s``, the CPU seconds the API server's process used
    between them (its ``process_cpu_seconds_total``; a total, not a mean). Histograms that saw
    nothing are left out; ``{}`` if a scrape is."""
    if not before or not after:
        return {}
    out: dict[str, float] = {}
    if "process_cpu_seconds_total" in before and "process_cpu_seconds_total" in after:
        out["api_cpu_s"] = (after["process_cpu_seconds_total"]
                            - before["process_cpu_seconds_total"])
    for name, key in HISTOGRAMS.items():
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if n > 0:
            out[key] = (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / n
            if name == "time_to_first_token_seconds":
                out["num_requests"] = n
                for q in (50, 90):
                    out[f"api_ttft_p{q}_s"] = ttft_percentile(before, after, q / 100)
            elif name == "iteration_tokens_total":
                out["num_steps"] = n
    return out
