"""A small OpenAI-compatible streaming server with set delays and set misbehaviours.

It serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` with ``stream: true``,
generating exactly ``max_tokens`` tokens (the word "tok"): the first ``ttft_s`` after the
request arrives, token ``k`` at ``ttft_s + k * tpot_s`` (absolute instants, so delays do not
drift). The last token's chunk carries ``finish_reason: "length"``; then, when the request
asked for ``stream_options.include_usage``, a usage chunk; then ``data: [DONE]``. With
``logprobs`` asked, every chunk carries one logprob entry per token in it.

Each behaviour a real engine shows can be switched on, by output length (so one server can mix
them) or for every request:

==========================  ==================================================================
``fail_lengths``            HTTP 500
``hang_lengths``            never answer (client timeouts)
``garbage_lengths``         one token, then an event whose data is JSON but not an object
``cut_lengths``             half the tokens, then ``data: [DONE]`` with no finish chunk and the
                            connection dropped mid chunked transfer (llama-cpp-python cutting a
                            stream when another request waits)
``drop_lengths``            half the tokens, then the connection dropped, no ``[DONE]``
``bad_usage_lengths``       ``usage.completion_tokens`` ten times the tokens sent
``merge_utf8``              tokens 1 and 2 are the two halves of a UTF-8 character, sent as one
                            chunk (as an engine holding back half a character does)
``usage=False``             no usage chunk, even when asked (llama-cpp-python)
``string_prompts_only``     HTTP 422 for a prompt that is a list of token ids
``timings``                 llama-server's ``timings`` in the last chunk: prompt and predicted
                            ms and counts, and ``cache_n``, the prompt tokens shared with the
                            previous request's prompt (one slot's prefix cache)
``lost_lengths``            HTTP 503 whose error names a status (``hawk_status``:
                            ``failed_instance_lost``), as ``hawk real serve``'s router does
``models``                  ``GET /v1/models`` lists these, and a request naming another model
                            gets HTTP 404 ("The model `x` does not exist.", as vLLM answers);
                            unset, there is no listing and any model name is served
``max_model_len``           the listing gives each model this context (vLLM's field)
``request_cost_s``          a front end that takes this long per request, one at a time,
                            before its delays start (an API server on a busy core)
``churn_cost_s``            each arriving request delays the tokens still to come of every
                            request in flight by this much (an engine whose steps pay for
                            each request that joins them)
==========================  ==================================================================

It exists to check the replay client against known delays and behaviours, and as a
smoke-test target for ``hawk replay``::

    python -m traces.stub_server --port 8000 --ttft 0.05 --tpot 0.01 --timings

On start it prints one line, ``listening on http://HOST:PORT``, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

LENGTH_SETS = ("fail", "hang", "garbage", "cut", "drop", "bad_usage", "lost")
MERGED = (" \u00e9",)   # one chunk, two tokens: the bytes c3 and a9 of one character


@dataclass(frozen=True)
class StubConfig:
    ttft_s: float = 0.05
    tpot_s: float = 0.01
    fail_lengths: frozenset[int] = frozenset()
    hang_lengths: frozenset[int] = frozenset()
    garbage_lengths: frozenset[int] = frozenset()
    cut_lengths: frozenset[int] = frozenset()
    drop_lengths: frozenset[int] = frozenset()
    bad_usage_lengths: frozenset[int] = frozenset()
    lost_lengths: frozenset[int] = frozenset()
    models: tuple[str, ...] | None = None
    max_model_len: int | None = None
    merge_utf8: bool = False
    usage: bool = True
    string_prompts_only: bool = False
    timings: bool = False
    request_cost_s: float = 0.0
    churn_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.ttft_s, self.tpot_s, self.request_cost_s, self.churn_cost_s) < 0:
            raise ValueError(f"delays must be >= 0, got ttft {self.ttft_s}, tpot {self.tpot_s}")


def make_app(config: StubConfig):
    from aiohttp import web

    last_prompt: list = []      # the one slot's cached prompt (for ``timings.cache_n``)
    front = asyncio.Lock()      # the front end: one request at a time
    churned = [0.0]             # the delay every request so far has added to those in flight

    async def complete(request: web.Request) -> web.StreamResponse:
        if config.request_cost_s:
            async with front:
                await asyncio.sleep(config.request_cost_s)
        arrived = asyncio.get_running_loop().time()
        churned[0] += config.churn_cost_s
        seen = churned[0]           # what this one's own arrival and earlier ones added
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        chat = request.path.endswith("/chat/completions")
        if config.models is not None and body.get("model") not in config.models:
            return web.json_response({"error": {
                "message": f"The model `{body.get('model')}` does not exist.",
                "type": "NotFoundError", "code": 404}}, status=404)
        if n in config.fail_lengths:
            return web.json_response({"error": {"message": f"refusing {n} tokens"}}, status=500)
        if n in config.lost_lengths:
            return web.json_response({"error": {"message": "decode instance lost",
                                                "hawk_status": "failed_instance_lost"}},
                                     status=503)
        if config.string_prompts_only and isinstance(body.get("prompt"), list):
            return web.json_response({"detail": [{"loc": ["body", "prompt"],
                                                  "msg": "str type expected"}]}, status=422)
        if n in config.hang_lengths:
            await asyncio.sleep(3600)
        prompt = _prompt_units(body, chat)
        cached = _common_prefix(prompt, last_prompt)
        last_prompt[:] = prompt
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if n in config.garbage_lengths:
            await response.write(_event(_chunk(chat, "tok")) + b"data: [1, 2]\n\n")
            await response.write_eof()
            return response
        pieces = _pieces(n, config.merge_utf8)
        stop = len(pieces) // 2 if n in config.cut_lengths | config.drop_lengths else len(pieces)
        logprobs = bool(body.get("logprobs"))
        sent = 0
        for k, (text, tokens) in enumerate(pieces[:stop]):
            sent += tokens
            await _sleep_until(arrived + config.ttft_s + (sent - 1) * config.tpot_s
                               + churned[0] - seen)
            last = k == len(pieces) - 1
            chunk = _chunk(chat, text, tokens if logprobs else 0, "length" if last else None)
            if last and config.timings:
                chunk["timings"] = {"prompt_n": len(prompt) - cached, "cache_n": cached,
                                    "prompt_ms": 1e3 * config.ttft_s, "predicted_n": n,
                                    "predicted_ms": 1e3 * config.tpot_s * (n - 1)}
            await response.write(_event(chunk))
        if n in config.cut_lengths:
            await response.write(b"data: [DONE]\n\n")
        if stop < len(pieces):
            request.transport.close()    # no terminating chunk: the transfer is cut
            return response
        stream_options = body.get("stream_options") or {}
        if config.usage and stream_options.get("include_usage"):
            done = 10 * n if n in config.bad_usage_lengths else n
            usage = {"prompt_tokens": len(prompt), "completion_tokens": done,
                     "total_tokens": len(prompt) + done}
            await response.write(_event({"object": "completion.chunk", "choices": [],
                                         "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        extra = {} if config.max_model_len is None else {"max_model_len": config.max_model_len}
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", **extra} for name in config.models]})

    app = web.Application()
    if config.models is not None:
        app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def _pieces(n: int, merge_utf8: bool) -> list[tuple[str, int]]:
    """(text, tokens) per chunk: one token each, or tokens 1 and 2 merged into one chunk."""
    pieces = [("tok" if k == 0 else " tok", 1) for k in range(n)]
    if merge_utf8 and n >= 3:
        pieces[1:3] = [(MERGED[0], 2)]
    return pieces


def _chunk(chat: bool, text: str, num_logprobs: int = 0, finish: str | None = None) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        if num_logprobs:
            choice["logprobs"] = {"content": [{"token": "tok", "logprob": -0.5}] * num_logprobs}
        return {"object": "chat.completion.chunk", "created": int(time.time()),
                "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if num_logprobs:
        choice["logprobs"] = {"tokens": ["tok"] * num_logprobs,
                              "token_logprobs": [-0.5] * num_logprobs}
    return {"object": "text_completion", "created": int(time.time()), "choices": [choice]}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _prompt_units(body: dict, chat: bool) -> list:
    """Words of a text prompt (the replay client's prompts are one token per word), or ids."""
    if chat:
        return [w for m in body.get("messages", []) for w in str(m.get("content", "")).split()]
    prompt = body.get("prompt", "")
    return list(prompt) if isinstance(prompt, list) else str(prompt).split()


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def _sleep_until(instant: float) -> None:
    delay = instant - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


async def serve(config: StubConfig, host: str = "127.0.0.1", port: int = 0) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    print(f"listening on http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds to the first token")
    parser.add_argument("--tpot", type=float, default=0.01, help="seconds between tokens")
    for name in LENGTH_SETS:
        parser.add_argument(f"--{name.replace('_', '-')}-lengths", type=int, nargs="*",
                            default=[])
    parser.add_argument("--merge-utf8", action="store_true", help="tokens 1 and 2 in one chunk")
    parser.add_argument("--no-usage", action="store_true", help="never send a usage chunk")
    parser.add_argument("--string-prompts-only", action="store_true",
                        help="HTTP 422 for token-id prompts")
    parser.add_argument("--timings", action="store_true", help="llama-server-style timings")
    parser.add_argument("--models", nargs="+", help="served model names (GET /v1/models)")
    parser.add_argument("--max-model-len", type=int, help="the context /v1/models lists")
    parser.add_argument("--request-cost", type=float, default=0.0,
                        help="seconds per request at a one-at-a-time front end")
    parser.add_argument("--churn-cost", type=float, default=0.0,
                        help="seconds each arrival delays every request in flight")
    args = parser.parse_args(argv)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        sys.exit("traces.stub_server needs aiohttp: pip install -e .[replay]")
    config = StubConfig(args.ttft, args.tpot,
                        **{f"{n}_lengths": frozenset(getattr(args, f"{n}_lengths"))
                           for n in LENGTH_SETS},
                        merge_utf8=args.merge_utf8, usage=not args.no_usage,
                        string_prompts_only=args.string_prompts_only, timings=args.timings,
                        models=tuple(args.models) if args.models else None,
                        max_model_len=args.max_model_len,
                        request_cost_s=args.request_cost, churn_cost_s=args.churn_cost)
    try:
        asyncio.run(serve(config, args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
