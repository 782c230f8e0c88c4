"""The router's HTTP face: OpenAI-compatible completions and chat (streaming or not) and the
run's own read-outs (``/hawk/requests``, ``/hawk/workers``), over a ``router.Router``.

A streamed request is one server-sent event per token (``text`` or ``delta.content`` is
`` t<id>``, ``token_ids`` the id), then one with ``finish_reason: "length"`` and the usage, then
``data: [DONE]``. A non-streamed reply holds the whole text in ``choices[0].text``
(completions) or ``choices[0].message`` (chat: ``{"role": "assistant", "content"}``). A failed
request is one ``{"error": {"message", "type", "hawk_status"}}`` event, or that body with HTTP
504 (``failed_timeout``) or 500; ``hawk_status`` is its ``traces.schema.Status`` value, which
``hawk replay`` records as the request's status. A bad body (not JSON, nested too deeply, a
field of the wrong type or value) is answered 400 naming the field, no live workers 503.

A client that hangs up cancels its request (the workers drop what they hold for it), a body
must arrive within ``BODY_S``, and an idle or half-sent HTTP connection is closed after
``HTTP_IDLE_S``.
"""

from __future__ import annotations

import asyncio
import json

from traces.schema import Status

MAX_BODY = 64 << 20          # bytes of one request body
BODY_S = 30.0                # seconds a request body may take to arrive
HTTP_IDLE_S = 15.0           # seconds an HTTP connection may stay idle or half-sent


def load_body(text: str) -> dict:
    """A request body as a JSON object; ``ValueError`` for anything else (deep nesting too)."""
    try:
        body = json.loads(text)
    except RecursionError:
        raise ValueError("the body is nested too deeply to be a request") from None
    except ValueError as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def error_body(r) -> dict:
    """The error object of a failed request (a ``router.Tracked``)."""
    return {"error": {"message": f"{r.status}: {r.error}", "type": r.status,
                      "hawk_status": r.status}}


def make_runner(router, idle_s: float = HTTP_IDLE_S):
    """An ``aiohttp.web.AppRunner`` of ``make_app(router)``: a client that hangs up cancels its
    handler (``handler_cancellation``), an idle or half-sent connection closes after
    ``idle_s`` (aiohttp's keep-alive timer runs from the connection's start)."""
    from aiohttp import web
    return web.AppRunner(make_app(router), access_log=None, handler_cancellation=True,
                         keepalive_timeout=idle_s)


def make_app(router):            # a hardware.serve.router.Router
    from aiohttp import web

    async def completions(request, chat: bool):
        try:
            body = load_body(await asyncio.wait_for(request.text(), BODY_S))
            prompt, n = router.parse(body, chat)
        except asyncio.TimeoutError:
            return web.json_response({"error": {"message": f"the body did not arrive within "
                                                           f"{BODY_S:g} s",
                                                "type": "invalid_request"}}, status=408)
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
        try:
            if not body.get("stream", False):
                return await whole(r, chat, kind.removesuffix(".chunk"), usage)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            while True:
                kind_, value = await r.events.get()
                if kind_ == "token":
                    data = chunk(f" t{value}")
                    data["choices"][0]["token_ids"] = [value]
                elif kind_ == "error":
                    data = error_body(r)
                else:
                    data = chunk("", "length", usage())
                await resp.write(f"data: {json.dumps(data)}\n\n".encode())
                if kind_ != "token":
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            router.cancel(r, "client went away")
            raise
        return resp

    async def whole(r, chat: bool, kind: str, usage):
        """The non-streamed reply, once every token is in (or the request failed)."""
        tokens = []
        while True:
            kind_, value = await r.events.get()
            if kind_ == "token":
                tokens.append(value)
            elif kind_ == "error":
                timed_out = r.status == Status.FAILED_TIMEOUT.value
                return web.json_response(error_body(r), status=504 if timed_out else 500)
            else:
                break
        text = "".join(f" t{t}" for t in tokens)
        choice = {"index": 0, "token_ids": tokens, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat
                      else {"text": text})
        return web.json_response({"id": r.rid, "object": kind, "model": "hawk",
                                  "choices": [choice], "usage": usage()})

    async def requests_log(request):
        return web.json_response([router.record(r) for r in router.requests.values()])

    async def workers(request):
        return web.json_response(await router.worker_stats())

    async def warmup(request):
        return web.json_response(await router.warm_up())

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", lambda req: completions(req, False))
    app.router.add_post("/v1/chat/completions", lambda req: completions(req, True))
    app.router.add_get("/v1/models", lambda req: web.json_response(
        {"object": "list", "data": [{"id": "hawk", "object": "model"}]}))
    app.router.add_get("/health", lambda req: web.json_response(
        {**{role: len(router.alive(role)) for role in router.workers},
         "requests": len(router.requests),
         "done": sum(r.status != Status.UNFINISHED.value for r in router.requests.values())}))
    app.router.add_get("/hawk/requests", requests_log)
    app.router.add_get("/hawk/workers", workers)
    app.router.add_post("/hawk/warmup", warmup)
    return app
