"""The router: an OpenAI-compatible streaming endpoint in front of prefill and decode workers.

``python -m hardware.serve.router`` (``hawk real router``) listens for HTTP on ``--port`` and
for workers on ``--control-port`` (both on ``--host``, loopback by default), and prints one JSON
line ``{"http": URL, "control": [host, port]}`` when ready.

Endpoints: ``POST /v1/completions`` (``prompt``: a list of token ids, or text, mapped to ids
word by word) and ``POST /v1/chat/completions`` (the last message's ``content``, ids or text),
streaming (``stream: true``, server-sent events with one token per chunk, the usage at the end)
or not; greedy decoding of exactly ``max_tokens`` tokens. ``GET /v1/models``, ``GET /health``;
``GET /hawk/requests`` (every request's worker-side instants, for ``hawk real run``) and
``GET /hawk/workers`` (each live worker's leak counters and busy time).

A request goes to a prefill worker and a decode worker chosen by ``policies.routing`` over their
outstanding tokens; the prefill worker's ``prefilled`` event sends it to the decode worker,
which pulls the KV cache and streams the tokens back here. A worker whose control connection
drops is dead: its in-flight requests fail (``failed_instance_lost``, "... worker N lost"),
KV held for them elsewhere is dropped, and the others keep being served. A worker that starts again joins
under a new index.

Nothing waits forever: a request not finished ``--request-timeout-s`` after it arrived fails
as ``failed_timeout`` (a frozen worker), one whose client hangs up fails and is dropped by its
workers, and ``/hawk/workers`` asks every worker at once and lists one that does not answer
within ``STATS_TIMEOUT_S`` with its last counters and ``"answered": false``. A failed
request's HTTP error or stream event carries its status as ``hawk_status``. ``POST
/hawk/warmup`` sends one short request through every (prefill, decode) pair (unlogged).

The control port admits a peer without the token into a small pool of pre-authentication
slots (``hardware.preauth``; the longest waiting makes way for a new one), reads at most
``wire.MAX_HELLO`` bytes of its hello and hangs up unless the token comes within ``preauth_s``.
SIGTERM and SIGINT stop the router (its workers are told to stop); started with
``HAWK_PARENT_PID`` (``hardware.lifecycle``) it also stops once that parent is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import itertools
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field

from hardware.transport.base import TransportError
from hardware.preauth import PREAUTH_S, PREAUTH_SLOTS, PreAuthSlots
from hardware.wire import MAX_HELLO, read_frame, token_from_env, write_frame
from policies import resolve
from policies.routing import ROUTING
from traces.schema import Status



def prompt_key(prompt: list[int]) -> str:
    """A short digest of a prompt's token ids (how ``hawk real run`` finds its requests)."""
    return hashlib.sha1(json.dumps(list(prompt)).encode()).hexdigest()[:16]


def text_to_ids(text: str, vocab_size: int) -> list[int]:
    """Word-level ids for a text prompt (no tokenizer: a stable hash of each word)."""
    return [int(hashlib.md5(w.encode()).hexdigest()[:8], 16) % vocab_size
            for w in text.split()] or [0]


@dataclass
class Worker:
    role: str
    index: int
    writer: asyncio.StreamWriter
    info: dict
    load: int = 0                     # outstanding tokens
    free_blocks: int = 0              # free KV blocks, as the worker last reported
    alive: bool = True
    stats: asyncio.Future | None = None   # the answer to the stats request in flight
    last_stats: dict = field(default_factory=dict)
    stats_at: float | None = None         # when it last answered one (wall clock)


@dataclass
class Tracked:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival_at: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    status: str = Status.UNFINISHED.value
    error: str = ""
    prefill: int = -1
    decode: int = -1
    stage: str = "prefill"            # prefill -> transfer -> decode -> done
    instants: dict = field(default_factory=dict)
    num_generated: int = 0
    kv_bytes: int = 0
    deadline_at: float = math.inf         # failed_timeout past this instant (wall clock)


#: seconds a request may take from arrival to its last token, and a worker to answer stats
REQUEST_TIMEOUT_S = 600.0
STATS_TIMEOUT_S = 10.0


class Router:
    def __init__(self, token: str, vocab_size: int, max_context: int,
                 routing: str = "least_loaded", request_timeout_s: float = REQUEST_TIMEOUT_S,
                 preauth_slots: int = PREAUTH_SLOTS, preauth_s: float = PREAUTH_S):
        if not request_timeout_s > 0 or not preauth_s > 0:
            raise ValueError(f"request timeout {request_timeout_s!r} s and pre-auth deadline "
                             f"{preauth_s!r} s: need seconds > 0")
        self.key = token.encode()
        self.request_timeout_s, self.preauth_s = request_timeout_s, preauth_s
        self.preauth = PreAuthSlots(preauth_slots)
        self.vocab_size, self.max_context = vocab_size, max_context
        self.route = resolve("routing", routing)
        self.workers: dict[str, dict[int, Worker]] = {"prefill": {}, "decode": {}}
        self.requests: dict[str, Tracked] = {}
        self._ids = itertools.count()
        self._worker_ids = {"prefill": itertools.count(), "decode": itertools.count()}
        self._routed = itertools.count()

    # -- workers ----------------------------------------------------------------------------
    async def on_worker(self, reader, writer) -> None:
        key = object()
        evicted = self.preauth.admit(key, writer.close)
        if evicted is not None:
            evicted()                  # the longest-waiting stranger makes way
        try:
            hello = await asyncio.wait_for(read_frame(reader, "worker", MAX_HELLO),
                                           self.preauth_s)
        except Exception:  # noqa: BLE001  (garbage, silence or evicted: hang up)
            self.preauth.gone(key)
            writer.close()
            return
        token = hello.get("token")
        role = hello.get("role")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.key) \
                or role not in self.workers or not self.preauth.authenticated(key):
            self.preauth.gone(key)
            write_frame(writer, {"ok": False, "message": "wrong token or role"})
            writer.close()
            return
        w = Worker(role, next(self._worker_ids[role]), writer, hello)
        self.workers[role][w.index] = w
        write_frame(writer, {"ok": True, "index": w.index})
        self._announce_peers()
        try:
            while True:
                msg = await read_frame(reader)
                if not hmac.compare_digest(str(msg.get("token", "")).encode(), self.key):
                    break
                self.on_event(w, msg)
        except (TransportError, ConnectionError, ValueError,
                asyncio.CancelledError):       # a worker gone, or the router shutting down
            pass
        finally:
            self._lost(w)

    def _announce_peers(self) -> None:
        peers = {str(i): w.info["pull_address"] for i, w in self.workers["prefill"].items()
                 if w.alive}
        for w in self.alive("decode"):
            write_frame(w.writer, {"op": "peers", "prefill": peers})

    def alive(self, role: str) -> list[Worker]:
        return [w for w in self.workers[role].values() if w.alive]

    def _lost(self, w: Worker) -> None:
        w.alive = False
        if w.stats is not None and not w.stats.done():
            w.stats.set_result(None)
        for r in self.requests.values():
            mine = (r.prefill == w.index and r.stage == "prefill") if w.role == "prefill" \
                else (r.decode == w.index and r.stage in ("transfer", "decode"))
            if mine and r.status == Status.UNFINISHED.value:
                self._fail(r, Status.FAILED_INSTANCE_LOST.value, f"{w.role} worker {w.index} lost")
        if w.role == "prefill":
            self._announce_peers()

    def on_event(self, w: Worker, msg: dict) -> None:
        ev = msg.get("ev")
        w.free_blocks = int(msg.get("free_blocks", w.free_blocks))
        if ev == "stats":
            w.last_stats = {k: v for k, v in msg.items() if k not in ("ev", "token")}
            w.stats_at = time.time()
            if w.stats is not None and not w.stats.done():
                w.stats.set_result(msg)
            return
        if ev == "tokens":
            for rid, tok in msg["items"]:
                r = self.requests.get(rid)
                if r is not None and r.status == Status.UNFINISHED.value:
                    r.instants.setdefault("first_token_at", msg["at"])
                    r.num_generated += 1
                    r.events.put_nowait(("token", tok))
            for rid in msg["finished"]:
                r = self.requests.get(rid)
                if r is not None and r.status == Status.UNFINISHED.value:
                    r.instants["finished_at"] = msg["at"]
                    r.status, r.stage = Status.OK.value, "done"
                    w.load -= r.max_tokens
                    r.events.put_nowait(("done", None))
            return
        r = self.requests.get(msg.get("rid"))
        if r is None or r.status != Status.UNFINISHED.value:
            if ev == "prefilled" and r is not None:   # failed meanwhile: free the held KV
                write_frame(w.writer, {"op": "drop", "rid": msg["rid"]})
            return
        if ev == "prefilled":
            r.instants.update(prefill_start_at=msg["prefill_start_at"],
                              prefill_end_at=msg["prefill_end_at"])
            w.load -= len(r.prompt)
            d = self.workers["decode"].get(r.decode)
            if d is None or not d.alive:
                write_frame(w.writer, {"op": "drop", "rid": r.rid})
                self._fail(r, Status.FAILED_INSTANCE_LOST.value, f"decode worker {r.decode} lost")
                return
            r.stage = "transfer"
            write_frame(d.writer, {"op": "decode", "rid": r.rid, "prefill": r.prefill,
                                   "first_token": msg["first_token"],
                                   "prompt_len": len(r.prompt), "max_tokens": r.max_tokens})
        elif ev == "transferred":
            r.instants.update(transfer_start_at=msg["transfer_start_at"],
                              transfer_end_at=msg["transfer_end_at"])
            r.kv_bytes, r.stage = int(msg["kv_bytes"]), "decode"
        elif ev == "failed":
            self._fail(r, str(msg.get("status", Status.FAILED_ERROR.value)), str(msg.get("error", "")))

    def _fail(self, r: Tracked, status: str, error: str) -> None:
        owed = ((("prefill", r.prefill, len(r.prompt)),) if r.stage == "prefill" else ()) + (
            ("decode", r.decode, r.max_tokens),)
        for role, i, n in owed:
            if i in self.workers[role]:
                self.workers[role][i].load -= n
        r.status, r.error, r.stage = status, error, "done"
        r.instants.setdefault("finished_at", time.time())
        for role, i in (("prefill", r.prefill), ("decode", r.decode)):
            w = self.workers[role].get(i)
            if w is not None and w.alive:
                write_frame(w.writer, {"op": "drop", "rid": r.rid})
        r.events.put_nowait(("error", f"{status}: {error}"))

    # -- requests ---------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int,
               pair: tuple[Worker, Worker] | None = None) -> Tracked:
        """Send a request to a prefill and a decode worker (the routing policy's, or ``pair``)."""
        prefill, decode = self.alive("prefill"), self.alive("decode")
        if not prefill or not decode:
            raise LookupError(f"no live workers: {len(prefill)} prefill, {len(decode)} decode")
        if pair is None:
            n = next(self._routed)
            p = prefill[self.route([w.load for w in prefill], [w.free_blocks for w in prefill], n)]
            d = decode[self.route([w.load for w in decode], [w.free_blocks for w in decode], n)]
        else:
            p, d = pair
        now = time.time()
        r = Tracked(f"r{next(self._ids)}", prompt, max_tokens, now, prefill=p.index,
                    decode=d.index, deadline_at=now + self.request_timeout_s)
        self.requests[r.rid] = r
        p.load += len(prompt)
        d.load += max_tokens
        write_frame(p.writer, {"op": "prefill", "rid": r.rid, "prompt": prompt})
        return r

    def expire(self, now: float) -> list[Tracked]:
        """Fail every unfinished request past its deadline (``failed_timeout``), freeing what
        its workers hold for it; returns them."""
        late = [r for r in self.requests.values()
                if r.status == Status.UNFINISHED.value and now > r.deadline_at]
        for r in late:
            role, i = ("prefill", r.prefill) if r.stage == "prefill" else ("decode", r.decode)
            self._fail(r, Status.FAILED_TIMEOUT.value,
                       f"not finished within {self.request_timeout_s:g} s (in {r.stage}, "
                       f"{role} worker {i})")
        return late

    def cancel(self, r: Tracked, why: str) -> None:
        """The client went away: fail ``r`` (if still unfinished) and free what it holds."""
        if r.status == Status.UNFINISHED.value:
            self._fail(r, Status.FAILED_ERROR.value, why)

    async def warm_up(self, max_tokens: int = 2) -> list[dict]:
        """One short request through every live (prefill, decode) pair, so that no request
        served after this pays a worker's first-use costs (allocations, connections, kernels);
        the requests are not kept in the log. Returns each pair's outcome."""
        pairs = [(p, d) for p in self.alive("prefill") for d in self.alive("decode")]
        tracked = [self.submit([1 + i % (self.vocab_size - 1)] * 8, max_tokens, pair)
                   for i, pair in enumerate(pairs)]
        out = []
        for (p, d), r in zip(pairs, tracked):
            while (await r.events.get())[0] == "token":
                pass
            self.requests.pop(r.rid, None)
            out.append({"prefill": p.index, "decode": d.index, "status": r.status,
                        "error": r.error})
        return out

    def parse(self, body: dict, chat: bool) -> tuple[list[int], int]:
        """Prompt ids and max_tokens of a request body; ``ValueError`` names the bad field."""
        name = "messages[-1].content" if chat else "prompt"
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
                raise ValueError("messages: a non-empty list of {role, content}")
            prompt = messages[-1].get("content")
        else:
            prompt = body.get("prompt")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ValueError(f"stream {body['stream']!r}: true or false")
        if isinstance(prompt, str):
            if not prompt.split():
                raise ValueError(f"{name} {prompt!r}: an empty text has no tokens to prefill")
            prompt = text_to_ids(prompt, self.vocab_size)
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in prompt):
            raise ValueError(f"{name}: text, or a non-empty list of token ids in "
                             f"0..{self.vocab_size - 1}")
        n = body.get("max_tokens", 16)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_tokens {n!r}: an integer >= 1")
        if len(prompt) + n > self.max_context:
            raise ValueError(f"{len(prompt)} prompt tokens + max_tokens {n} exceed the model's "
                             f"context of {self.max_context}")
        return prompt, n

    def record(self, r: Tracked) -> dict:
        return {"rid": r.rid, "prompt_key": prompt_key(r.prompt), "arrival_at": r.arrival_at,
                "num_prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens,
                "status": r.status, "error": r.error, "prefill_instance": r.prefill,
                "decode_instance": r.decode, "num_generated_tokens": r.num_generated,
                "kv_bytes": r.kv_bytes, **r.instants}

    async def worker_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> list[dict]:
        """Each live worker's counters, asked of all at once: one that does not answer within
        ``timeout_s`` (frozen, or busy) is listed with the counters it last sent and
        ``"answered": false``, so a read-out never waits on one worker for longer."""
        live = [w for role in self.workers for w in self.alive(role)]
        for w in live:
            if w.stats is None or w.stats.done():          # one question in flight per worker
                w.stats = asyncio.get_running_loop().create_future()
                write_frame(w.writer, {"op": "stats"})
        if live:
            await asyncio.wait([w.stats for w in live], timeout=timeout_s)
        return [{"role": w.role, "index": w.index, "device": w.info.get("device"),
                 "pid": w.info.get("pid"), **w.last_stats,
                 "answered": w.stats.done() and w.stats.result() is not None,
                 "stats_at": w.stats_at} for w in live]


async def serve(args, token: str, make_router=None) -> None:
    from aiohttp import web

    from hardware.model.config import LlamaConfig, tiny_config

    config = LlamaConfig.from_json(args.model) if args.model else tiny_config()
    router = (make_router or Router)(token, config.vocab_size, config.max_position_embeddings,
                                     args.routing, request_timeout_s=args.request_timeout_s)
    control = await asyncio.start_server(router.on_worker, args.host, args.control_port)
    from hardware.serve.openai_api import make_runner

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    reaper = asyncio.create_task(_expire_forever(router))
    runner = make_runner(router)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    cport = control.sockets[0].getsockname()[1]
    print(json.dumps({"http": f"http://{args.host}:{port}", "control": [args.host, cport]}),
          flush=True)
    try:
        await stopping.wait()
    finally:
        reaper.cancel()
        live = [w for role in router.workers for w in router.alive(role)]
        for w in live:
            write_frame(w.writer, {"op": "stop"})
        await asyncio.gather(*(asyncio.wait_for(w.writer.drain(), 2) for w in live),
                             return_exceptions=True)
        control.close()
        await runner.cleanup()


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not 0 < s < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds > 0")
    return s


async def _expire_forever(router: Router, every_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        router.expire(time.time())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: any free one)")
    p.add_argument("--control-port", type=int, default=0, help="workers' port (default: any)")
    p.add_argument("--routing", default="least_work",
                   help=f"routing policy: {', '.join(sorted(ROUTING))} or module:function")
    p.add_argument("--model", help="a Hugging Face-format directory (default: the tiny Llama)")
    p.add_argument("--request-timeout-s", type=_seconds, default=REQUEST_TIMEOUT_S,
                   help="a request not finished this long after it arrived fails as "
                        "failed_timeout (default %(default)g)")


def main(argv=None, make_router=None) -> int:
    p = argparse.ArgumentParser(prog="hawk real router", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        token = token_from_env()
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    from hardware.lifecycle import watch_parent
    watch_parent()                     # SIGTERM to this process once its parent is gone
    try:
        asyncio.run(serve(args, token, make_router))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
