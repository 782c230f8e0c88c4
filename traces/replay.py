"""Replay client: a trace sent open-loop to a live OpenAI-compatible streaming endpoint.

Protocol. Each request is one ``POST`` to ``/v1/completions`` (``api="completions"``) or
``/v1/chat/completions`` (``api="chat"``) with ``stream: true``, ``max_tokens`` = the trace's
output length and, unless ``ignore_eos=False``, ``ignore_eos: true`` and ``min_tokens`` (vLLM
and SGLang honour them, so the server generates exactly the asked length). The response is
read as server-sent events; each chunk with non-empty text is one token arrival. If the
server reports ``usage.completion_tokens`` (asked with ``stream_options.include_usage``),
that is the token count; otherwise the count of non-empty chunks is.

Prompts. ``N`` repetitions of ``prompt_word`` ("hello hello ..."): about ``N`` tokens for
common tokenizers, not exactly (a BOS token or chat template adds a few). With
``prompt_token_id`` the completions API is sent a list of ``N`` token ids instead, which vLLM
and SGLang accept, and the count is exact.

Schedule. One asyncio event loop. Request ``i`` is due at ``t0 + arrival_at[i]`` -- absolute
target instants, so lag does not accumulate -- and is sent whether or not earlier responses
have arrived (open loop). The send instant is when its HTTP headers were written; the lag
between due and sent instants is recorded per request and summarized (p50 / p99 / max).

Records (``traces.schema``). Instants are seconds since ``t0`` (the replay's start):
``arrival_at`` is the due instant (the trace's arrival), ``first_token_at`` and ``finished_at``
(the last token, or the failure) are measured on receipt; ``prefill_*`` / ``transfer_*``
are NaN, unknown to a client. Status ``ok``, ``failed_timeout`` (no completion within
``timeout_s`` of the send) or ``failed_error`` (HTTP error, broken stream, connection error,
no tokens). A request's failure is recorded, never raised. Inter-token latencies go to a
separate table (request_id, token_index, latency_s); per-request client facts (due and send
instants, lag, HTTP status, error text, server-reported prompt tokens) to another.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traces.schema import Status, records_frame
from traces.trace import Trace

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ReplayConfig:
    """Where and how to send. ``endpoint`` is a base URL or a full ``.../completions`` URL."""

    endpoint: str
    model: str = "default"
    api: str = "completions"
    timeout_s: float = 300.0
    prompt_word: str = "hello"
    prompt_token_id: int | None = None
    ignore_eos: bool = True
    api_key: str | None = None
    start_delay_s: float = 0.2

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api {self.api!r} is not one of {list(APIS)}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be finite and > 0, got {self.timeout_s}")
        if self.prompt_token_id is not None and self.api != "completions":
            raise ValueError("prompt_token_id needs api='completions' (chat takes text only)")
        if self.start_delay_s < 0:
            raise ValueError(f"start_delay_s must be >= 0, got {self.start_delay_s}")

    @property
    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        if base.endswith("/completions"):
            return base
        return base[:-3] + APIS[self.api] if base.endswith("/v1") else base + APIS[self.api]

    @property
    def chat(self) -> bool:
        return self.url.endswith("/chat/completions")


def synthetic_prompt(num_tokens: int, word: str = "hello") -> str:
    """About ``num_tokens`` tokens of text: the word repeated, space separated."""
    return " ".join([word] * num_tokens)


def request_body(config: ReplayConfig, num_prompt_tokens: int, num_output_tokens: int) -> dict:
    """The JSON body of one streaming request."""
    body = {"model": config.model, "max_tokens": num_output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if config.ignore_eos:
        body.update(ignore_eos=True, min_tokens=num_output_tokens)
    if config.chat:
        body["messages"] = [{"role": "user",
                             "content": synthetic_prompt(num_prompt_tokens, config.prompt_word)}]
    elif config.prompt_token_id is not None:
        body["prompt"] = [config.prompt_token_id] * num_prompt_tokens
    else:
        body["prompt"] = synthetic_prompt(num_prompt_tokens, config.prompt_word)
    return body


@dataclass
class _Progress:
    """What the client has seen of one request so far (mutable, one per request)."""

    due_at: float
    sent_at: float = math.nan
    token_at: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    status: Status | None = None
    finished_at: float = math.nan
    http_status: int = 0
    error: str = ""


@dataclass(frozen=True)
class ReplayResult:
    """Records, inter-token latencies and per-request client facts of one replay."""

    records: object   # records DataFrame (traces.schema)
    itl: object       # DataFrame: request_id, token_index, latency_s
    client: object    # DataFrame: request_id, due_at, sent_at, send_lag_s, http_status, ...
    endpoint: str

    def summary(self, ttft_slo_s: float, tpot_slo_s: float) -> dict:
        """``sim.metrics.summarize`` plus send lag, inter-token latency and short outputs."""
        from sim.metrics import percentiles, summarize

        out = summarize(self.records, ttft_slo_s, tpot_slo_s)
        lag = self.client["send_lag_s"].to_numpy(dtype=float)
        p = percentiles(lag, (50, 99))
        out.update(send_lag_p50_s=p[50], send_lag_p99_s=p[99],
                   send_lag_max_s=float(np.nanmax(lag)) if np.any(~np.isnan(lag)) else math.nan)
        p = percentiles(self.itl["latency_s"].to_numpy(dtype=float), (50, 99))
        out.update(itl_p50_s=p[50], itl_p99_s=p[99])
        ok = self.records["status"] == Status.OK.value
        short = ok & (self.records["num_generated_tokens"] < self.records["num_output_tokens"])
        out.update(num_short_outputs=int(short.sum()), endpoint=self.endpoint, mode="replay")
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}

    def write(self, out_dir, ttft_slo_s: float, tpot_slo_s: float) -> dict:
        """records.parquet, summary.json, itl.parquet and client.parquet under ``out_dir``."""
        from traces.schema import write_records

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_records(self.records, out_dir / "records.parquet")
        self.itl.to_parquet(out_dir / "itl.parquet", index=False)
        self.client.to_parquet(out_dir / "client.parquet", index=False)
        summary = self.summary(ttft_slo_s, tpot_slo_s)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Send every request of ``trace`` at its arrival instant; wait for all; return results."""
    return asyncio.run(replay_async(trace, config))


async def replay_async(trace: Trace, config: ReplayConfig) -> ReplayResult:
    import aiohttp

    loop = asyncio.get_running_loop()
    t0 = loop.time() + config.start_delay_s
    progress = [_Progress(float(a)) for a in trace.arrival_at]
    trace_config = aiohttp.TraceConfig()

    async def on_headers_sent(client, ctx, params) -> None:
        ctx.trace_request_ctx.sent_at = loop.time() - t0

    trace_config.on_request_headers_sent.append(on_headers_sent)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None),
                                     trace_configs=[trace_config]) as http:
        tasks = []
        for i, state in enumerate(progress):
            delay = t0 + state.due_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(config, int(trace.num_prompt_tokens[i]),
                                int(trace.num_output_tokens[i]))
            tasks.append(loop.create_task(_send(http, config, body, state, t0)))
        await asyncio.gather(*tasks)
    return _result(trace, progress, config.url)


async def _send(http, config: ReplayConfig, body: dict, state: _Progress, t0: float) -> None:
    """Run one request to completion, timeout or error; never raises."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(_stream(http, config, body, state, t0), config.timeout_s)
    except asyncio.TimeoutError:
        state.status, state.error = Status.FAILED_TIMEOUT, f"no completion in {config.timeout_s} s"
    except Exception as exc:  # noqa: BLE001  (a request's failure is recorded, never raised:
        # HTTP and connection errors, broken or malformed streams alike)
        state.status, state.error = Status.FAILED_ERROR, f"{type(exc).__name__}: {exc}"[:300]
    if state.status is None:
        state.status = Status.OK if state.token_at else Status.FAILED_ERROR
        state.error = "" if state.token_at else "stream ended without tokens"
    if state.status is Status.OK:
        state.finished_at = state.token_at[-1]
    else:
        state.finished_at = loop.time() - t0


async def _stream(http, config: ReplayConfig, body: dict, state: _Progress, t0: float):
    loop = asyncio.get_running_loop()
    async with http.post(config.url, json=body, trace_request_ctx=state) as response:
        state.http_status = response.status
        if response.status != 200:
            text = (await response.text())[:200]
            state.status, state.error = Status.FAILED_ERROR, f"HTTP {response.status}: {text}"
            return
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            chunk = json.loads(payload)
            if not isinstance(chunk, dict):
                raise ValueError(f"stream event is not a JSON object: {payload[:80]!r}")
            if "error" in chunk:
                state.status, state.error = Status.FAILED_ERROR, str(chunk["error"])[:300]
                return
            if _chunk_text(chunk):
                state.token_at.append(loop.time() - t0)
            usage = chunk.get("usage") or {}
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                state.usage_tokens = int(usage["completion_tokens"])
                state.prompt_tokens = usage.get("prompt_tokens")


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _result(trace: Trace, progress: list[_Progress], endpoint: str) -> ReplayResult:
    import pandas as pd

    n = len(trace)
    nan = np.full(n, math.nan)
    generated = [p.usage_tokens if p.usage_tokens is not None else len(p.token_at)
                 for p in progress]
    records = records_frame({
        "request_id": trace.request_id, "arrival_at": trace.arrival_at,
        "num_prompt_tokens": trace.num_prompt_tokens,
        "num_output_tokens": trace.num_output_tokens,
        "status": [p.status.value for p in progress],
        "prefill_instance": np.full(n, -1), "decode_instance": np.full(n, -1),
        "prefill_start_at": nan, "prefill_end_at": nan,
        "transfer_start_at": nan, "transfer_end_at": nan,
        "first_token_at": [p.token_at[0] if p.token_at else math.nan for p in progress],
        "finished_at": [p.finished_at for p in progress],
        "num_generated_tokens": generated, "kv_bytes": np.zeros(n, dtype=np.int64),
    })
    ids, index, latency = [], [], []
    for rid, p in zip(trace.request_id, progress):
        gaps = np.diff(p.token_at)
        ids += [int(rid)] * len(gaps)
        index += range(1, len(gaps) + 1)
        latency += gaps.tolist()
    itl = pd.DataFrame({"request_id": np.array(ids, np.int64),
                        "token_index": np.array(index, np.int64),
                        "latency_s": np.array(latency, float)})
    client = pd.DataFrame({
        "request_id": trace.request_id, "due_at": trace.arrival_at,
        "sent_at": [p.sent_at for p in progress],
        "send_lag_s": [p.sent_at - p.due_at for p in progress],
        "http_status": np.array([p.http_status for p in progress], np.int64),
        "error": [p.error for p in progress],
        "server_prompt_tokens": pd.array([p.prompt_tokens for p in progress], dtype="Int64"),
    })
    return ReplayResult(records, itl, client, endpoint)
