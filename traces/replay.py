"""Replay client: a trace sent open-loop to a live OpenAI-compatible streaming endpoint.

Protocol. Each request is one ``POST`` to ``/v1/completions`` (``api="completions"``) or
``/v1/chat/completions`` (``api="chat"``) with ``stream: true``, ``stream_options.include_usage``,
``max_tokens`` = the trace's output length and, unless ``ignore_eos=False``, ``ignore_eos: true``
and ``min_tokens`` (vLLM and SGLang honour them, so the server generates exactly the asked
length: the length is *forced*). ``logprobs=True`` also asks for one logprob entry per token;
``cache_prompt=False`` sends llama-server's per-request switch that turns its prompt cache off.
The response is read as server-sent events; each chunk with non-empty text is one arrival.

Prompts (``traces.prompts``): seeded random words or token ids, distinct from their first
token unless a shared-prefix ratio is asked for, so an engine's prefix cache does not skip the
prefill being measured; a trace with prefix block hashes (``Trace.hash_ids``, a Mooncake
trace's) gets prompts that share exactly the blocks its hashes share.

Token counts, exact wherever the engine offers a way, first that applies (the source is
recorded per request as ``token_count_source``):

1. ``usage``: the stream's ``usage.completion_tokens``, if it agrees with what was streamed:
   an int, at least the number of text chunks (and logprob entries), at most ``max_tokens``,
   equal to the logprob entries where those came. A count that disagrees is not used; the
   request is flagged (``usage_mismatch``) and counted from the stream instead.
2. ``timings``: llama-server's ``timings.predicted_n``, under the same checks.
3. ``logprobs``: the number of per-token logprob entries.
4. ``length``: ``max_tokens``, when the server's finish reason is ``length`` (it stopped
   because it produced all of them).
5. ``chunks``: the number of non-empty text chunks; short by one for every chunk that carries
   two tokens (an engine holding back half a UTF-8 character merges it into the next chunk).

Schedule. One asyncio event loop. Request ``i`` is due at ``t0 + arrival_at[i]`` -- absolute
target instants, so lag does not accumulate -- and is sent whether or not earlier responses
have arrived (open loop). A trace whose last arrival lies past ``max_duration_s`` is refused
before anything is sent. The send instant is when its HTTP headers were written; the lag
between due and sent instants is recorded per request and summarized (p50 / p99 / max).

Records (``traces.schema``). Instants are seconds since ``t0`` (the replay's start):
``arrival_at`` is the due instant, ``first_token_at`` and ``finished_at`` (the last token, or
the failure) are measured on receipt; ``prefill_*`` / ``transfer_*`` are NaN, unknown to a
client. Statuses:

* ``ok``: a finish reason came, and a forced length was met;
* ``failed_truncated``: the stream ended without a finish reason (e.g. ``data: [DONE]`` alone,
  as llama-cpp-python sends when it interrupts a stream for a waiting request), ended short of
  a forced length, or the transfer broke mid-stream; the tokens that came are counted;
* ``failed_timeout``: no completion within ``timeout_s`` of the send;
* ``failed_client``: the client ran out of a resource (too many open files, no free port,
  no memory): the server never saw the request, so it is not the server's failure;
* ``failed_error``: HTTP error, error event, malformed stream, connection refused, no tokens;
* a server's own status: an error (HTTP body or stream event) whose ``error`` object carries
  ``hawk_status``, a failed status of ``traces.schema.Status`` (``hawk real serve``'s router
  sends one, e.g. ``failed_instance_lost``), is recorded with that status, not as
  ``failed_error``.

The model sent in each request is ``ReplayConfig.model``; left unset, it is the endpoint's
only model on ``GET /v1/models`` (vLLM, llama-server and ``hawk real serve`` list theirs), or
``"default"`` where the endpoint lists none. A model the endpoint does not list, or an unset
model where it lists several, is refused before anything is sent, naming the served models.

A request's failure is recorded, never raised. Inter-token latencies go to a separate table
(request_id, token_index, latency_s); per-request client facts (due and send instants, lag,
HTTP status, error text, finish reason, count source and the counts behind it, and the
server's own numbers where it reports them: prompt tokens, cached prompt tokens, llama-server's
``timings`` prompt and predicted milliseconds) to another, ``client.parquet``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traces.jsonout import dumps
from traces.prompts import PromptMaker, PromptSpec
from traces.schema import Status, records_frame
from traces.trace import Trace

APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: OS errors that mean the client ran out of something, not that the server failed
CLIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                           errno.EADDRNOTAVAIL})
DEFAULT_MAX_DURATION_S = 86_400.0


@dataclass(frozen=True)
class ReplayConfig:
    """Where and how to send. ``endpoint`` is a base URL or a full ``.../completions`` URL."""

    endpoint: str
    model: str | None = None          # None: the endpoint's only model (``resolve_model``)
    api: str = "completions"
    timeout_s: float = 300.0
    prompt: PromptSpec = PromptSpec()
    ignore_eos: bool = True
    logprobs: bool = False
    cache_prompt: bool | None = None
    api_key: str | None = None
    start_delay_s: float = 0.2
    max_duration_s: float = DEFAULT_MAX_DURATION_S

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api {self.api!r} is not one of {list(APIS)}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be finite and > 0, got {self.timeout_s}")
        if self.prompt.kind == "token_ids" and self.chat:
            raise ValueError("token-id prompts need api='completions' (chat takes text only)")
        if not (math.isfinite(self.start_delay_s) and self.start_delay_s >= 0):
            raise ValueError(f"start_delay_s must be finite and >= 0, got {self.start_delay_s}")
        if not (math.isfinite(self.max_duration_s) and self.max_duration_s > 0):
            raise ValueError(f"max_duration_s must be finite and > 0, got {self.max_duration_s}")

    @property
    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        if base.endswith("/completions"):
            return base
        return base[:-3] + APIS[self.api] if base.endswith("/v1") else base + APIS[self.api]

    @property
    def chat(self) -> bool:
        return self.url.endswith("/chat/completions")

    @property
    def models_url(self) -> str:
        """``GET`` here lists the served models (OpenAI's ``/v1/models``)."""
        base = self.url.removesuffix("/completions").removesuffix("/chat").removesuffix("/v1")
        return base + "/v1/models"


class ReplayError(ValueError):
    """A replay that cannot start: raised before any request is sent."""


#: the model name sent where the endpoint lists none
FALLBACK_MODEL = "default"


def choose_model(asked: str | None, served: list[str] | None) -> str:
    """The model to send: ``asked`` if the endpoint serves it (or lists nothing), else the
    endpoint's only model; ``ReplayError`` naming the served models otherwise."""
    if served is None or not served:
        return asked or FALLBACK_MODEL
    if asked is None:
        if len(served) == 1:
            return served[0]
        raise ReplayError(f"the endpoint serves {len(served)} models ({', '.join(served)}): "
                          f"name one with --model")
    if asked not in served:
        raise ReplayError(f"the endpoint does not serve model {asked!r}; it serves "
                          f"{', '.join(served)} (--model)")
    return asked


async def served_models(http, config: ReplayConfig) -> list[str] | None:
    """The ids ``GET /v1/models`` lists, or None where the endpoint answers no such list."""
    try:
        async with http.get(config.models_url) as response:
            if response.status != 200:
                return None
            listing = await response.json(content_type=None)
    except Exception:  # noqa: BLE001  (no listing is an answer too: the request decides)
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def server_status(error) -> Status | None:
    """The failed status a server names in its error object (``hawk_status``), if any."""
    if not isinstance(error, dict):
        return None
    try:
        status = Status(error.get("hawk_status"))
    except ValueError:
        return None
    return None if status is Status.OK else status


def request_body(config: ReplayConfig, prompt: str | list[int], num_output_tokens: int) -> dict:
    """The JSON body of one streaming request (``config.model`` already chosen)."""
    body = {"model": config.model or FALLBACK_MODEL, "max_tokens": num_output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if config.ignore_eos:
        body.update(ignore_eos=True, min_tokens=num_output_tokens)
    if config.logprobs:
        body["logprobs"] = True if config.chat else 1
    if config.cache_prompt is not None:
        body["cache_prompt"] = config.cache_prompt
    if config.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def check_schedule(trace: Trace, config: ReplayConfig) -> None:
    """Refuse a trace the replay would sleep on for longer than ``max_duration_s``."""
    arrivals = np.asarray(trace.arrival_at, dtype=float)
    bad = ~np.isfinite(arrivals) | (arrivals > config.max_duration_s)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"request {int(trace.request_id[i])} arrives at {arrivals[i]:g} s, past "
                         f"the replay's limit of {config.max_duration_s:g} s (--max-duration); "
                         f"refusing to wait that long")


@dataclass
class _Progress:
    """What the client has seen of one request so far (mutable, one per request)."""

    due_at: float
    num_asked: int = 0
    sent_at: float = math.nan
    token_at: list[float] = field(default_factory=list)
    num_logprob_tokens: int | None = None
    usage_tokens: object = None          # as the server sent it: checked before use
    timings: dict = field(default_factory=dict)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    status: Status | None = None
    finished_at: float = math.nan
    http_status: int = 0
    error: str = ""
    count: int = 0
    count_source: str = "chunks"
    usage_mismatch: bool = False


@dataclass(frozen=True)
class ReplayResult:
    """Records, inter-token latencies and per-request client facts of one replay."""

    records: object   # records DataFrame (traces.schema)
    itl: object       # DataFrame: request_id, token_index, latency_s
    client: object    # DataFrame: request_id, due_at, sent_at, send_lag_s, http_status, ...
    endpoint: str
    model: str = FALLBACK_MODEL

    def summary(self, ttft_slo_s: float, tpot_slo_s: float) -> dict:
        """``traces.metrics.summarize`` plus send lag, ITL, count sources and server timings."""
        from traces.replay_summary import replay_summary

        return replay_summary(self, ttft_slo_s, tpot_slo_s)

    def write(self, out_dir, ttft_slo_s: float, tpot_slo_s: float) -> dict:
        """records.parquet, summary.json, itl.parquet and client.parquet under ``out_dir``."""
        from traces.schema import write_records

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_records(self.records, out_dir / "records.parquet")
        self.itl.to_parquet(out_dir / "itl.parquet", index=False)
        self.client.to_parquet(out_dir / "client.parquet", index=False)
        summary = self.summary(ttft_slo_s, tpot_slo_s)
        (out_dir / "summary.json").write_text(dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Send every request of ``trace`` at its arrival instant; wait for all; return results."""
    check_schedule(trace, config)
    return asyncio.run(replay_async(trace, config))


async def replay_async(trace: Trace, config: ReplayConfig) -> ReplayResult:
    import aiohttp

    check_schedule(trace, config)
    loop = asyncio.get_running_loop()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=10)) as http:
        served = await served_models(http, config)
    config = dataclasses.replace(config, model=choose_model(config.model, served))
    t0 = loop.time() + config.start_delay_s
    progress = [_Progress(float(a), int(n))
                for a, n in zip(trace.arrival_at, trace.num_output_tokens)]
    prompts = PromptMaker(config.prompt, int(max(trace.num_prompt_tokens, default=1)))
    trace_config = aiohttp.TraceConfig()

    async def on_headers_sent(client, ctx, params) -> None:
        ctx.trace_request_ctx.sent_at = loop.time() - t0

    trace_config.on_request_headers_sent.append(on_headers_sent)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None),
                                     trace_configs=[trace_config]) as http:
        tasks = []
        for i, state in enumerate(progress):
            delay = t0 + state.due_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            hashes = None if trace.hash_ids is None else trace.hash_ids[i]
            body = request_body(config, prompts.prompt(i, int(trace.num_prompt_tokens[i]),
                                                       hashes, trace.hash_block_size),
                                state.num_asked)
            tasks.append(loop.create_task(_send(http, config, body, state, t0)))
        await asyncio.gather(*tasks)
    return _result(trace, progress, config.url, config.model)


async def _send(http, config: ReplayConfig, body: dict, state: _Progress, t0: float) -> None:
    """Run one request to completion, timeout or error; never raises."""
    import aiohttp

    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(_stream(http, config, body, state, t0), config.timeout_s)
    except asyncio.TimeoutError:
        state.status, state.error = Status.FAILED_TIMEOUT, f"no completion in {config.timeout_s} s"
    except Exception as exc:  # noqa: BLE001  (a request's failure is recorded, never raised:
        # HTTP and connection errors, broken or malformed streams alike)
        text = f"{type(exc).__name__}: {exc}"[:300]
        exhausted = client_exhaustion(exc)
        if exhausted is not None:
            state.status, state.error = Status.FAILED_CLIENT, f"client: {exhausted} ({text})"
        elif state.http_status == 200 and isinstance(
                exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                      ConnectionError)):
            state.status = Status.FAILED_TRUNCATED
            state.error = f"transfer broke after {len(state.token_at)} chunks: {text}"[:300]
        else:
            state.status, state.error = Status.FAILED_ERROR, text
    judge(state, forced=config.ignore_eos)
    if state.status is Status.OK:
        state.finished_at = state.token_at[-1]
    else:
        state.finished_at = loop.time() - t0


def client_exhaustion(exc: BaseException) -> str | None:
    """The OS's words when ``exc`` (or an error behind it) says the client ran out of a resource."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in CLIENT_ERRNOS:
            return e.strerror or errno.errorcode.get(e.errno, str(e.errno))
        todo += [getattr(e, "os_error", None), e.__cause__, e.__context__]
    return None


def judge(state: _Progress, forced: bool) -> None:
    """Settle one request's token count, its source and its status (unless already failed)."""
    streamed = len(state.token_at)
    floor = max(streamed, state.num_logprob_tokens or 0)
    state.count, state.count_source = streamed, "chunks"
    if state.num_logprob_tokens is not None:
        state.count, state.count_source = state.num_logprob_tokens, "logprobs"
    elif state.finish_reason == "length":
        state.count, state.count_source = state.num_asked, "length"
    for source, value in (("timings", state.timings.get("predicted_n")),
                          ("usage", state.usage_tokens)):
        if value is None:
            continue
        if (isinstance(value, int) and not isinstance(value, bool)
                and floor <= value <= state.num_asked
                and state.num_logprob_tokens in (None, value)):
            state.count, state.count_source = value, source
        elif source == "usage":
            state.usage_mismatch = True
    if state.status is not None:
        return
    if state.count == 0:
        state.status, state.error = Status.FAILED_ERROR, "stream ended without tokens"
    elif state.finish_reason is None:
        end = "data: [DONE]" if state.done else "the end of the response"
        state.status = Status.FAILED_TRUNCATED
        state.error = (f"no finish reason before {end}, after {state.count} of "
                       f"{state.num_asked} tokens")
    elif forced and state.count < state.num_asked:
        state.status = Status.FAILED_TRUNCATED
        state.error = (f"finish reason {state.finish_reason!r} after {state.count} of "
                       f"{state.num_asked} forced tokens")
    else:
        state.status = Status.OK


async def _stream(http, config: ReplayConfig, body: dict, state: _Progress, t0: float):
    loop = asyncio.get_running_loop()
    async with http.post(config.url, json=body, trace_request_ctx=state) as response:
        state.http_status = response.status
        if response.status != 200:
            full = await response.text()
            text = full[:200]
            state.status = _named_status(full) or Status.FAILED_ERROR
            state.error = f"HTTP {response.status}: {text}"
            if isinstance(body.get("prompt"), list) and 400 <= response.status < 500:
                state.error = ("the server refused a token-id prompt; it may accept only "
                               "string prompts (replay with word prompts instead): "
                               + state.error)[:300]
            return
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                state.done = True
                return
            chunk = json.loads(payload)
            if not isinstance(chunk, dict):
                raise ValueError(f"stream event is not a JSON object: {payload[:80]!r}")
            if "error" in chunk:
                state.status = server_status(chunk["error"]) or Status.FAILED_ERROR
                state.error = str(chunk["error"])[:300]
                return
            read_chunk(chunk, state, loop.time() - t0)


def _named_status(text: str) -> Status | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return server_status(body.get("error")) if isinstance(body, dict) else None


def read_chunk(chunk: dict, state: _Progress, now: float) -> None:
    """Take one stream event's token, finish reason, logprobs, usage and timings."""
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    # a token whose text is empty (a special token) streams no text; when it is the only
    # one, the finishing chunk is when it came
    if isinstance(text, str) and (text or (not state.token_at and choice.get("finish_reason"))):
        state.token_at.append(now)
    if choice.get("finish_reason"):
        state.finish_reason = str(choice["finish_reason"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("content") if "content" in logprobs else logprobs.get("tokens")
        if isinstance(entries, list):
            state.num_logprob_tokens = (state.num_logprob_tokens or 0) + len(entries)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            state.usage_tokens = usage["completion_tokens"]
        state.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and _int_or_none(details.get("cached_tokens")) is not None:
            state.cached_tokens = _int_or_none(details.get("cached_tokens"))
    timings = chunk.get("timings")
    if isinstance(timings, dict):
        state.timings = {k: v for k, v in timings.items() if isinstance(v, (int, float))}
        if _int_or_none(timings.get("cache_n")) is not None:
            state.cached_tokens = _int_or_none(timings.get("cache_n"))


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _result(trace: Trace, progress: list[_Progress], endpoint: str,
            model: str) -> ReplayResult:
    import pandas as pd

    n = len(trace)
    nan = np.full(n, math.nan)
    records = records_frame({
        "request_id": trace.request_id, "arrival_at": trace.arrival_at, "tenant": trace.tenant,
        "num_prompt_tokens": trace.num_prompt_tokens,
        "num_output_tokens": trace.num_output_tokens,
        "status": [p.status.value for p in progress],
        "prefill_instance": np.full(n, -1), "decode_instance": np.full(n, -1),
        "prefill_start_at": nan, "prefill_end_at": nan,
        "transfer_start_at": nan, "transfer_end_at": nan,
        "first_token_at": [p.token_at[0] if p.token_at else math.nan for p in progress],
        "finished_at": [p.finished_at for p in progress],
        "num_generated_tokens": [p.count for p in progress],
        "kv_bytes": np.zeros(n, dtype=np.int64),
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
    timing = {key: [float(p.timings.get(key, math.nan)) for p in progress]
              for key in ("prompt_ms", "predicted_ms")}
    client = pd.DataFrame({
        "request_id": trace.request_id, "due_at": trace.arrival_at,
        "sent_at": [p.sent_at for p in progress],
        "send_lag_s": [p.sent_at - p.due_at for p in progress],
        "http_status": np.array([p.http_status for p in progress], np.int64),
        "error": [p.error for p in progress],
        "finish_reason": [p.finish_reason or "" for p in progress],
        "token_count_source": [p.count_source for p in progress],
        "num_chunk_tokens": np.array([len(p.token_at) for p in progress], np.int64),
        "num_logprob_tokens": pd.array([p.num_logprob_tokens for p in progress], dtype="Int64"),
        "usage_completion_tokens": pd.array([_int_or_none(p.usage_tokens) for p in progress],
                                            dtype="Int64"),
        "usage_mismatch": np.array([p.usage_mismatch for p in progress], bool),
        "server_prompt_tokens": pd.array([p.prompt_tokens for p in progress], dtype="Int64"),
        "server_prompt_tokens_evaluated": pd.array(
            [_int_or_none(p.timings.get("prompt_n")) for p in progress], dtype="Int64"),
        "server_cached_tokens": pd.array([p.cached_tokens for p in progress], dtype="Int64"),
        "server_prompt_ms": timing["prompt_ms"], "server_predicted_ms": timing["predicted_ms"],
    })
    return ReplayResult(records, itl, client, endpoint, model)
