"""The router's HTTP face: OpenAI-compatible completions and chat (streaming or not) and the
run's own read-outs (``/hawk/requests``, ``/hawk/workers``), over a ``router.Router``.

A streamed request is one server-sent event per token (``text`` or ``delta.content`` is
`` t<id>``, ``token_ids`` the id), then one with ``finish_reason: "length"`` and the usage, then
``data: [DONE]``; a failure is one ``{"error": {"message", "type": status}}`` event. A bad body
is answered 400 naming the field, no live workers 503.
"""

from __future__ import annotations

import asyncio
import json

from traces.schema import Status

MAX_BODY = 64 << 20          # bytes of one request body

def make_app(router):            # a hardware.serve.router.Router
    from aiohttp import web

    async def completions(request, chat: bool):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            prompt, n = router.parse(body, chat)
        except ValueError as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request"}},
                                     status=400)
        try:
            r = router.submit(prompt, n)
        except LookupError as e:
            return web.json_response({"error": {"message": str(e), "type": "unavailable"}},
                                     status=503)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish=None, usage=None) -> dict:
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            out = {"id": r.rid, "object": kind, "model": "hawk", "choices": [choice]}
            if usage:
                out["usage"] = usage
            return out

        def usage() -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": r.num_generated,
                    "total_tokens": len(prompt) + r.num_generated}
        if not body.get("stream"):
            tokens = []
            while True:
                kind_, value = await r.events.get()
                if kind_ == "token":
                    tokens.append(value)
                elif kind_ == "error":
                    return web.json_response({"error": {"message": value, "type": r.status}},
                                             status=500)
                else:
                    break
            text = "".join(f" t{t}" for t in tokens)
            return web.json_response({"id": r.rid, "object": kind.removesuffix(".chunk"),
                                      "choices": [{"index": 0, "text": text, "token_ids": tokens,
                                                   "finish_reason": "length"}],
                                      "usage": usage()})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                kind_, value = await r.events.get()
                if kind_ == "token":
                    data = chunk(f" t{value}")
                    data["choices"][0]["token_ids"] = [value]
                elif kind_ == "error":
                    data = {"error": {"message": value, "type": r.status}}
                else:
                    data = chunk("", "length", usage())
                await resp.write(f"data: {json.dumps(data)}\n\n".encode())
                if kind_ != "token":
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            if r.status == Status.UNFINISHED.value:
                router._fail(r, Status.FAILED_ERROR.value, "client went away")
            raise
        return resp

    async def requests_log(request):
        return web.json_response([router.record(r) for r in router.requests.values()])

    async def workers(request):
        return web.json_response(await router.worker_stats())

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", lambda req: completions(req, False))
    app.router.add_post("/v1/chat/completions", lambda req: completions(req, True))
    app.router.add_get("/v1/models", lambda req: web.json_response(
        {"object": "list", "data": [{"id": "hawk", "object": "model"}]}))
    app.router.add_get("/health", lambda req: web.json_response(
        {"prefill": len(router.alive("prefill")), "decode": len(router.alive("decode")),
         "requests": len(router.requests),
         "done": sum(r.status != Status.UNFINISHED.value for r in router.requests.values())}))
    app.router.add_get("/hawk/requests", requests_log)
    app.router.add_get("/hawk/workers", workers)
    return app
