"""The router's HTTP face and control port in one process, with scripted workers: deadlines,
hang-ups, statuses carried to the client and to ``hawk replay``, OpenAI shapes, bad bodies,
and the limits that keep strangers (no token) from holding the ports."""

import asyncio
import json
import socket
import struct

import pytest

aiohttp = pytest.importorskip("aiohttp")

from hardware.serve.openai_api import make_runner  # noqa: E402
from hardware.serve.router import Router, Worker, _expire_forever  # noqa: E402
from hardware.wire import encode  # noqa: E402
from tests.test_serve_router import FakeWriter  # noqa: E402

TOKEN = "t" * 32


def make_router(**kw):
    router = Router(TOKEN, vocab_size=1024, max_context=512, routing="round_robin", **kw)
    for role in ("prefill", "decode"):
        router.workers[role][0] = Worker(role, 0, FakeWriter(), {"pull_address": ["x", 1]})
    return router


async def serving(router, idle_s=15.0):
    runner = make_runner(router, idle_s=idle_s)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def next_request(router, seen=()):
    while True:
        for r in router.requests.values():
            if r.rid not in seen:
                return r
        await asyncio.sleep(0.01)


def finish(router, r, tokens):
    """The workers' events for ``r``: prefilled, transferred, ``tokens``, finished."""
    p, d = router.workers["prefill"][0], router.workers["decode"][0]
    router.on_event(p, {"ev": "prefilled", "rid": r.rid, "first_token": tokens[0],
                        "prefill_start_at": 1.0, "prefill_end_at": 2.0})
    router.on_event(d, {"ev": "transferred", "rid": r.rid, "transfer_start_at": 2.0,
                        "transfer_end_at": 3.0, "kv_bytes": 64})
    router.on_event(d, {"ev": "tokens", "at": 4.0, "items": [[r.rid, t] for t in tokens],
                        "finished": [r.rid]})


def run(coro_fn, router, **kw):
    async def main():
        runner, url = await serving(router, **kw)
        try:
            return await coro_fn(url)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_a_chat_reply_carries_a_message_and_completions_carry_text():
    router = make_router()

    async def go(url):
        replies, seen = [], set()
        async with aiohttp.ClientSession() as s:
            for path, body in (("/v1/chat/completions", {"messages": [
                    {"role": "user", "content": [1, 2]}], "max_tokens": 2}),
                    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})):
                post = asyncio.create_task(s.post(url + path, json=body))
                r = await next_request(router, seen)
                seen.add(r.rid)
                finish(router, r, [5, 8])
                replies.append(await (await post).json())
        return replies
    chat, completion = run(go, router)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " t5 t8"}
    assert "text" not in chat["choices"][0] and chat["object"] == "chat.completion"
    assert completion["choices"][0]["text"] == " t5 t8"


@pytest.mark.parametrize("body, field", [
    ({"prompt": "", "max_tokens": 2}, "prompt ''"),
    ({"prompt": "   ", "max_tokens": 2}, "prompt '   '"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[-1].content ''"),
    ({"prompt": [1, 2], "stream": "no"}, "stream 'no': true or false"),
    ({"prompt": [1, 2], "stream": 1}, "stream 1: true or false"),
])
def test_empty_prompts_and_non_boolean_streams_are_refused_by_name(body, field):
    router = make_router()

    async def go(url):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as resp:
            return resp.status, await resp.json()
    status, reply = run(go, router)
    assert status == 400 and field in reply["error"]["message"], reply
    assert router.requests == {}


def test_deeply_nested_json_is_a_400_not_a_recursion_error():
    router = make_router()

    async def go(url):
        async with aiohttp.ClientSession() as s, s.post(
                url + "/v1/completions", data=b"[" * 100_000,
                headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json()
    status, reply = run(go, router)
    assert status == 400 and "nested too deeply" in reply["error"]["message"]


def test_a_request_past_its_deadline_fails_as_failed_timeout_and_frees_its_workers():
    router = make_router(request_timeout_s=0.5)

    async def go(url):
        reaper = asyncio.create_task(_expire_forever(router, 0.1))
        try:
            async with aiohttp.ClientSession() as s, s.post(
                    url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}) as resp:
                return resp.status, await resp.json()
        finally:
            reaper.cancel()
    status, reply = run(go, router)          # the workers never answer: a frozen worker
    assert status == 504 and reply["error"]["hawk_status"] == "failed_timeout"
    assert "not finished within 0.5 s (in prefill, prefill worker 0)" in reply["error"]["message"]
    (r,) = router.requests.values()
    assert r.status == "failed_timeout"
    for role in ("prefill", "decode"):
        assert ("drop", r.rid) in router.workers[role][0].writer.ops()
        assert router.workers[role][0].load == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_cancels_its_request(stream):
    router = make_router()

    async def go(url):
        async with aiohttp.ClientSession() as s:
            post = asyncio.create_task(s.post(url + "/v1/completions", json={
                "prompt": [1, 2], "max_tokens": 4, "stream": stream}))
            r = await next_request(router)
            if stream:
                await post
            post.cancel()
        while r.status == "unfinished":                       # the router sees the hang-up
            await asyncio.sleep(0.05)
        finish(router, r, [5, 8, 9, 3])                        # late tokens change nothing
        return r
    r = run(go, router)
    assert (r.status, r.error) == ("failed_error", "client went away")
    assert ("drop", r.rid) in router.workers["prefill"][0].writer.ops()


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_status_reaches_the_client_as_hawk_status(stream):
    router = make_router()

    async def go(url):
        async with aiohttp.ClientSession() as s:
            post = asyncio.create_task(s.post(url + "/v1/completions", json={
                "prompt": [1, 2], "max_tokens": 4, "stream": stream}))
            await next_request(router)
            router._lost(router.workers["prefill"][0])
            resp = await post
            return resp.status, await resp.text()
    status, text = run(go, router)
    if stream:
        events = [json.loads(line[5:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        error = events[-1]["error"]
    else:
        assert status == 500
        error = json.loads(text)["error"]
    assert error["hawk_status"] == "failed_instance_lost"
    assert "prefill worker 0 lost" in error["message"]


def test_hawk_replay_records_the_routers_status():
    from traces.replay import ReplayConfig, replay_async
    from traces.trace import Trace

    router = make_router()

    async def go(url):
        async def lose_prefill():
            await next_request(router)
            router._lost(router.workers["prefill"][0])
        task = asyncio.create_task(lose_prefill())
        result = await replay_async(Trace.from_columns([0.0], [4], [3]),
                                    ReplayConfig(url, timeout_s=120))
        await task
        return result
    result = run(go, router)
    assert list(result.records["status"]) == ["failed_instance_lost"]


def test_worker_read_outs_never_wait_on_a_silent_worker():
    router = make_router()

    async def go():
        ask = asyncio.create_task(router.worker_stats(timeout_s=1.0))
        await asyncio.sleep(0.2)
        router.on_event(router.workers["prefill"][0], {"ev": "stats", "busy_s": 1.5,
                                                       "held_blocks": []})
        return await ask                     # the decode worker never answers (frozen)
    out = {w["role"]: w for w in asyncio.run(go())}
    assert out["prefill"]["answered"] is True and out["prefill"]["busy_s"] == 1.5
    assert out["decode"]["answered"] is False and "busy_s" not in out["decode"]


def test_half_open_http_connections_are_closed_after_the_idle_timeout():
    router = make_router()

    async def go(url):
        port = int(url.rsplit(":", 1)[1])
        conns = []
        for i in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # then silence
            conns.append((reader, writer))
        got = [await asyncio.wait_for(reader.read(), 60) for reader, _ in conns]
        for _, writer in conns:
            writer.close()
        return got
    assert run(go, router, idle_s=1.0) == [b""] * 20


# -- the control port: what a peer without the token can do ----------------------------------
def control_port(router):
    async def start():
        server = await asyncio.start_server(router.on_worker, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]
    return start


def test_idle_strangers_cannot_lock_a_worker_out_of_the_control_port():
    router = make_router(preauth_slots=8, preauth_s=120.0)
    router.workers = {"prefill": {}, "decode": {}}

    async def go():
        server, port = await control_port(router)()
        strangers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        while router.preauth.num_evicted < 12:
            await asyncio.sleep(0.05)
        closed = [await _closed(reader) for reader, _ in strangers]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode({"op": "hello", "token": TOKEN, "role": "decode", "pid": 1}))
        n = struct.unpack("!I", await asyncio.wait_for(reader.readexactly(4), 60))[0]
        reply = json.loads(await reader.readexactly(n))
        waiting = len(router.preauth)
        for _, w in strangers + [(reader, writer)]:
            w.close()
        server.close()
        return closed, reply, waiting
    closed, reply, waiting = asyncio.run(go())
    assert closed == [True] * 12 + [False] * 8          # the oldest made way for the newest
    assert reply["ok"] is True and list(router.workers["decode"]) == [0]
    assert waiting == 7                                 # one more stranger made way for it


def test_a_stranger_that_stays_silent_or_sends_a_huge_frame_is_hung_up_on():
    router = make_router(preauth_s=0.5)

    async def go():
        server, port = await control_port(router)()
        silent = await asyncio.open_connection("127.0.0.1", port)
        huge = await asyncio.open_connection("127.0.0.1", port)
        huge[1].write(struct.pack("!I", 60 << 20) + b"{" * 1024)   # announces 60 MiB
        got = [await asyncio.wait_for(r.read(), 60) for r, _ in (silent, huge)]
        server.close()
        return got, len(router.preauth)
    got, waiting = asyncio.run(go())
    assert got == [b"", b""] and waiting == 0


async def _closed(reader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.5) == b""
    except asyncio.TimeoutError:
        return False
