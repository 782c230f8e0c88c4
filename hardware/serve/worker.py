"""A prefill or decode worker process: ``python -m hardware.serve.worker --role prefill|decode``
(``hawk real worker``); ``--role aggregated`` runs as ``hardware.serve.aggregated_worker``.

A worker dials the router's control port (``--router HOST:PORT``) and shows the run token
(``HAWK_RUN_TOKEN`` in its environment); the router answers with its index. Messages are
``hardware.wire`` frames (length-prefixed JSON)::

    router -> prefill   {"op": "prefill", "rid", "prompt"} | {"op": "drop", "rid"} | stats | stop
    prefill -> router   {"ev": "prefilled", "rid", "first_token", "prefill_start_at",
                         "prefill_end_at"} | {"ev": "failed", "rid", "status", "error"}
    router -> decode    {"op": "peers", "prefill": {index: [host, port]}}
                        {"op": "decode", "rid", "prefill", "first_token", "prompt_len",
                         "max_tokens"} | {"op": "drop", "rid"} | stats | stop
    decode -> router    {"ev": "transferred", "rid", "transfer_start_at", "transfer_end_at",
                         "kv_bytes"} | {"ev": "tokens", "at", "items": [[rid, token]...],
                         "finished": [rid...]} | {"ev": "failed", ...}

Instants are the worker's wall clock (``time.time()``). A prefill worker also serves pulls of
its KV (``hardware.protocol.PrefillServer``, on ``--host``); a decode worker pulls them one
request at a time on a transfer thread (``DecodeClient`` per prefill worker) and decodes on
its main thread. A full send buffer (``SendBufferExhausted``) or a decode cache without free
blocks makes the pull wait and retry: back-pressure reaches the prefill batcher as held blocks.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time

from hardware.wire import recv_msg, send_msg, token_from_env
from traces.schema import Status

RETRY_S = 0.02


class StepLog:
    """``--step-log DIR``: one CSV row per engine step in ``DIR/<role><index>.csv`` (``hawk
    real profile`` reads them: what a step costs inside the serving loop). Columns: ``batch``
    (sequences computed), ``longest`` and ``total`` (prompt tokens in prefill; tokens each
    request attends in decode), ``engine_s`` (the model call), ``period_s`` (decode: from the
    end of the previous iteration to the end of this one, its tokens sent, when the loop ran
    a model step in both and never waited between them; else empty)."""

    COLUMNS = ("batch", "longest", "total", "engine_s", "period_s")

    def __init__(self, directory: str, role: str, index: int):
        path = os.path.join(directory, f"{role}{index}.csv")
        os.makedirs(directory, exist_ok=True)
        self.file = open(path, "w", buffering=1)
        self.file.write(",".join(self.COLUMNS) + "\n")
        self.last_end: float | None = None

    def step(self, lengths: list[int], engine_s: float) -> None:
        """A step over ``lengths`` just ended (its messages sent)."""
        now = time.time()
        if not lengths:                       # no model call: the next period spans two
            self.last_end = None
            return
        period = "" if self.last_end is None else repr(now - self.last_end)
        self.file.write(f"{len(lengths)},{max(lengths)},{sum(lengths)},{engine_s!r},{period}\n")
        self.last_end = now

    def waited(self) -> None:
        self.last_end = None


class RouterLink:
    """The worker's control connection: a reader thread into ``inbox``, locked sends."""

    def __init__(self, address: tuple[str, int], token: str, hello: dict):
        self.sock = socket.create_connection(address, timeout=30)
        self.token, self._lock = token, threading.Lock()
        self.send({"op": "hello", "pid": os.getpid(), **hello})
        self.sock.settimeout(30)
        reply = recv_msg(self.sock, "router")
        if not reply.get("ok"):
            raise SystemExit(f"worker: router refused: {reply.get('message')}")
        self.index = int(reply["index"])
        self.inbox: queue.Queue = queue.Queue()
        # Blocking from here on: the reader waits for messages without a timeout, so it never
        # narrows the timeout that a send on another thread runs under.
        self.sock.settimeout(None)
        threading.Thread(target=self._read, daemon=True, name="router-reader").start()

    def send(self, msg: dict) -> None:
        with self._lock:
            send_msg(self.sock, {**msg, "token": self.token})

    def _read(self) -> None:
        while True:
            try:
                self.inbox.put(recv_msg(self.sock, "router"))
            except Exception as e:  # noqa: BLE001  (router gone: stop the worker)
                print(f"worker: router link closed ({e})", file=sys.stderr, flush=True)
                self.inbox.put({"op": "stop"})
                return


def load_model(args):
    import torch

    from hardware.model.config import tiny_config
    from hardware.model.llama import LlamaModel

    torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else (
        "cuda" if args.role != "decode" and torch.cuda.is_available() else "cpu")
    if args.model:
        return LlamaModel.load(args.model, device=device)
    return LlamaModel.random(tiny_config(), seed=args.seed, device=device)


def run_prefill(args, token: str) -> None:
    import numpy as np

    from hardware.protocol import PrefillServer
    from hardware.serve.engines import PrefillEngine, PrefillJob
    from hardware.transport import make_transport

    model = load_model(args)
    if args.mechanism == "GN-HAWK" and model.device.type == "cpu":
        from hardware import layout_kernel
        layout_kernel.warm_up()             # before joining: no request waits on a compile
    engine = PrefillEngine(model, args.num_blocks, args.max_batch_tokens, args.max_batch_size)
    transport = make_transport(args.transport, host=args.host)
    send_buffer = np.zeros(int(args.send_buffer_mb * (1 << 20)), np.uint8)
    server = PrefillServer(transport, send_buffer, engine.source, token, host=args.host).start()
    link = RouterLink(args.router, token, {"role": "prefill", "device": str(model.device),
                                           "pull_address": list(server.address)})
    print(f"prefill worker {link.index}: pulls on {server.address[0]}:{server.address[1]}, "
          f"{model.device}", file=sys.stderr, flush=True)
    log = StepLog(args.step_log, "prefill", link.index) if args.step_log else None
    try:
        while True:
            try:
                msg = link.inbox.get(timeout=None if not engine.queue else 0)
            except queue.Empty:
                msg = None
            while msg is not None:
                op = msg.get("op")
                if op == "stop":
                    return
                if op == "prefill":
                    why = engine.check(msg["prompt"])
                    if why:
                        link.send({"ev": "failed", "rid": msg["rid"],
                                   "status": Status.REJECTED_PROMPT_TOO_LONG.value, "error": why})
                    else:
                        engine.queue.append(PrefillJob(msg["rid"], msg["prompt"]))
                elif op == "drop":
                    engine.queue = type(engine.queue)(j for j in engine.queue
                                                      if j.request_id != msg["rid"])
                    engine.source.drop(msg["rid"])
                elif op == "stats":
                    link.send({"ev": "stats", "busy_s": engine.busy_s,
                               "held_blocks": sorted(engine.pool.held),
                               "send_buffer": sorted(server.reserved()),
                               "open_regions": len(transport.open_to_peers()),
                               "queued": len(engine.queue)})
                msg = link.inbox.get_nowait() if not link.inbox.empty() else None
            done = engine.step()
            if not done and engine.queue:
                time.sleep(RETRY_S)         # held KV fills the cache: wait for pulls
            for rid, first, start, end in done:
                link.send({"ev": "prefilled", "rid": rid, "first_token": first,
                           "prefill_start_at": start, "prefill_end_at": end,
                           "free_blocks": engine.pool.num_free})
            if log is not None and done:
                log.step(engine.last_lens, done[0][3] - done[0][2])
    finally:
        server.stop()
        transport.close()


class Puller:
    """The decode worker's transfer thread: one pull at a time, in arrival order."""

    def __init__(self, engine, transport, token: str, link: RouterLink, timeout_s: float):
        self.engine, self.transport, self.token, self.link = engine, transport, token, link
        self.timeout_s = timeout_s
        self.peers: dict[int, tuple[str, int]] = {}
        self.clients: dict[int, object] = {}
        self.todo: queue.Queue = queue.Queue()
        self.landed: queue.Queue = queue.Queue()
        self.dropped: set[str] = set()
        threading.Thread(target=self._loop, daemon=True, name="puller").start()

    def _client(self, p: int):
        from hardware.protocol import DecodeClient
        if p not in self.clients:
            self.clients[p] = DecodeClient(self.transport, self.engine.sink, self.peers[p],
                                           self.token, timeout_s=self.timeout_s)
        return self.clients[p]

    def _loop(self) -> None:
        from hardware.transport import SendBufferExhausted, TransportError
        from hardware.serve.engines import Sequence

        while True:
            msg = self.todo.get()
            rid, sink = msg["rid"], self.engine.sink
            if sink.blocks_needed(rid) > sink.pool.num_blocks:
                sink.free(rid)
                self.link.send({"ev": "failed", "rid": rid, "status": Status.REJECTED_DECODE_CAPACITY.value,
                                "error": f"needs {sink.blocks_needed(rid)} KV blocks; the decode "
                                         f"cache has {sink.pool.num_blocks}"})
                continue
            while rid not in self.dropped and sink.pool.num_free < sink.blocks_needed(rid):
                time.sleep(RETRY_S)                    # decode cache full: wait for finishes
            if rid in self.dropped:
                continue
            start = time.time()
            try:
                result = self._client(msg["prefill"]).pull(rid)
            except SendBufferExhausted:
                time.sleep(RETRY_S)
                self.todo.put(msg)
                continue
            except (TransportError, OSError, KeyError, ValueError) as e:
                self.clients.pop(msg["prefill"], None)
                sink.free(rid)
                self.link.send({"ev": "failed", "rid": rid, "status": Status.FAILED_TRANSFER.value,
                                "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            end = time.time()
            if rid in self.dropped:                    # failed meanwhile: nothing to decode
                sink.free(rid)
                continue
            self.link.send({"ev": "transferred", "rid": rid, "transfer_start_at": start,
                            "transfer_end_at": end, "kv_bytes": result.nbytes})
            self.landed.put(Sequence(rid, msg["prompt_len"], msg["first_token"],
                                     msg["max_tokens"]))
            self.link.inbox.put({"op": "landed"})      # wake an idle decode loop now


def run_decode(args, token: str) -> None:
    from hardware.serve.engines import DecodeEngine
    from hardware.transport import make_transport

    model = load_model(args)
    transport = make_transport(args.transport, host=args.host)
    engine = DecodeEngine(model, args.mechanism, transport, args.num_tokens,
                          args.max_request_tokens, args.max_batch_size, args.kv_dtype)
    link = RouterLink(args.router, token, {"role": "decode", "device": str(model.device),
                                           "mechanism": args.mechanism})
    layout = args.kv_dtype if args.mechanism.startswith("GN") else "paged"
    print(f"decode worker {link.index}: {args.mechanism}, KV {layout}", file=sys.stderr,
          flush=True)
    puller = Puller(engine, transport, token, link, args.transfer_timeout_s)
    log = StepLog(args.step_log, "decode", link.index) if args.step_log else None
    try:
        while True:
            busy = engine.running or engine.waiting or not puller.landed.empty()
            if log is not None and not busy:
                log.waited()
            try:
                msg = link.inbox.get(timeout=0 if busy else 0.05)
            except queue.Empty:
                msg = None
            while msg is not None:
                op = msg.get("op")
                if op == "stop":
                    return
                if op == "peers":
                    puller.peers.update({int(k): tuple(v) for k, v in msg["prefill"].items()})
                elif op == "decode":
                    engine.sink.expect(msg["rid"], msg["prompt_len"],
                                       msg["prompt_len"] + msg["max_tokens"])
                    puller.todo.put(msg)
                elif op == "drop":
                    puller.dropped.add(msg["rid"])
                    engine.drop(msg["rid"])
                # "landed" (from the puller) only wakes the loop: the landed queue is read below
                elif op == "stats":
                    link.send({"ev": "stats", "busy_s": engine.busy_s,
                               "held_blocks": sorted(engine.sink.pool.held),
                               "registered": len(transport.live_regions()),
                               "running": len(engine.running) + len(engine.waiting)})
                msg = link.inbox.get_nowait() if not link.inbox.empty() else None
            while not puller.landed.empty():
                seq = puller.landed.get()
                if seq.request_id in puller.dropped:
                    engine.sink.free(seq.request_id)
                else:
                    engine.landed(seq)
            if engine.running or engine.waiting:
                busy_s = engine.busy_s
                items, finished = engine.step()
                link.send({"ev": "tokens", "at": time.time(), "items": items,
                           "finished": finished, "free_blocks": engine.sink.pool.num_free})
                if log is not None:
                    log.step(engine.last_contexts, engine.busy_s - busy_s)
    finally:
        engine.sink.close()
        transport.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"address {text!r}: HOST:PORT")
    return host, int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hardware.mechanisms import MECHANISMS
    p.add_argument("--role", choices=("prefill", "decode", "aggregated"), required=True)
    p.add_argument("--router", type=_address, required=True, help="router control HOST:PORT")
    p.add_argument("--host", default="127.0.0.1",
                   help="address this worker's KV path binds to (default: loopback)")
    p.add_argument("--transport", choices=("mooncake", "verbs"), default="mooncake")
    p.add_argument("--mechanism", choices=MECHANISMS, default="GN-HAWK")
    p.add_argument("--kv-dtype", choices=("bfloat8_b", "bfloat16"), default="bfloat8_b",
                   help="the decode side's NPU tile format (GN mechanisms)")
    p.add_argument("--model", help="a Hugging Face-format directory (default: the seeded tiny "
                                   "Llama)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    p.add_argument("--device", default="auto",
                   help="auto: CUDA for prefill and aggregated workers when present")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--num-blocks", type=int, default=256, help="prefill KV blocks of 16 tokens")
    p.add_argument("--num-tokens", type=int, default=16384,
                   help="decode (or aggregated) KV capacity, tokens")
    p.add_argument("--max-request-tokens", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--send-buffer-mb", type=float, default=16.0)
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--step-log", metavar="DIR", help="write one CSV row per engine step to "
                   "DIR/<role><index>.csv (StepLog)")


def main(argv=None, run=None) -> int:
    """The process: ``run(args, token)`` is the role's loop (``aggregated_worker`` passes its
    own; here prefill or decode)."""
    p = argparse.ArgumentParser(prog="hawk real worker", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.role == "aggregated" and run is None:
        p.error("--role aggregated runs as python -m hardware.serve.aggregated_worker")
    try:
        token = token_from_env()
    except ValueError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    from hardware.lifecycle import terminate_as_interrupt, watch_parent
    terminate_as_interrupt()           # SIGTERM stops the worker as Ctrl-C does
    watch_parent()                     # and so does its parent's end
    try:
        (run or (run_prefill if args.role == "prefill" else run_decode))(args, token)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
