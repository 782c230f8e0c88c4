"""A small OpenAI-compatible streaming server with set delays: a stand-in endpoint.

It serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` with ``stream: true``,
generating exactly ``max_tokens`` tokens (the word "tok"): the first ``ttft_s`` after the
request arrives, token ``k`` at ``ttft_s + k * tpot_s`` (absolute instants, so delays do not
drift), then a usage chunk and ``data: [DONE]``. Output lengths listed in ``fail_lengths``
get HTTP 500; those in ``hang_lengths`` never answer (to exercise client timeouts); those in
``garbage_lengths`` get one token, then an event whose data is JSON but not an object. It exists
to check the replay client against known delays, and as a smoke-test target for ``hawk
replay``::

    python -m traces.stub_server --port 8000 --ttft 0.05 --tpot 0.01

On start it prints one line, ``listening on http://HOST:PORT``, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StubConfig:
    ttft_s: float = 0.05
    tpot_s: float = 0.01
    fail_lengths: frozenset[int] = frozenset()
    hang_lengths: frozenset[int] = frozenset()
    garbage_lengths: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.tpot_s < 0:
            raise ValueError(f"delays must be >= 0, got ttft {self.ttft_s}, tpot {self.tpot_s}")


def make_app(config: StubConfig):
    from aiohttp import web

    async def complete(request: web.Request) -> web.StreamResponse:
        arrived = asyncio.get_running_loop().time()
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if n in config.fail_lengths:
            return web.json_response({"error": {"message": f"refusing {n} tokens"}}, status=500)
        if n in config.hang_lengths:
            await asyncio.sleep(3600)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if n in config.garbage_lengths:
            await response.write(_event(_chunk(chat, "tok")) + b"data: [1, 2]\n\n")
            await response.write_eof()
            return response
        for k in range(n):
            await _sleep_until(arrived + config.ttft_s + k * config.tpot_s)
            await response.write(_event(_chunk(chat, "tok" if k == 0 else " tok")))
        usage = {"prompt_tokens": _prompt_tokens(body, chat), "completion_tokens": n,
                 "total_tokens": _prompt_tokens(body, chat) + n}
        await response.write(_event({"object": "completion.chunk", "choices": [],
                                     "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def _chunk(chat: bool, text: str) -> dict:
    if chat:
        return {"object": "chat.completion.chunk", "created": int(time.time()),
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return {"object": "text_completion", "created": int(time.time()),
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _prompt_tokens(body: dict, chat: bool) -> int:
    """Words of a text prompt (the replay client's prompts are one token per word), or ids."""
    if chat:
        return sum(len(m.get("content", "").split()) for m in body.get("messages", []))
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds to the first token")
    parser.add_argument("--tpot", type=float, default=0.01, help="seconds between tokens")
    parser.add_argument("--fail-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--hang-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--garbage-lengths", type=int, nargs="*", default=[])
    args = parser.parse_args(argv)
    config = StubConfig(args.ttft, args.tpot, frozenset(args.fail_lengths),
                        frozenset(args.hang_lengths), frozenset(args.garbage_lengths))
    try:
        asyncio.run(serve(config, args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
