"""An aggregated worker process: ``python -m hardware.serve.aggregated_worker --role aggregated``
(``hawk real worker --role aggregated``; the other flags are ``hardware.serve.worker``'s): both phases of its requests on one model and one KV cache
(``aggregated_engine.AggregatedEngine``), no KV transfer.

It joins the router's control port as the other workers do (``worker.RouterLink``) and
speaks ``aggregated_router``'s messages. Each iteration reads every message waiting, then runs
one engine step and reports it: a ``prefilled`` event for each request whose prompt the step
finished (the start of its first chunk's step, this step's end), then one ``tokens`` event
stamped with the step's end (each request's first token comes in the step that finished its
prompt). A request whose prompt and output can never fit the cache is refused
(``rejected_decode_capacity``). ``--num-tokens`` is the cache's capacity, in blocks of 16.
With ``--step-log DIR`` each step is a row of ``DIR/aggregated<index>.csv`` (``STEP_COLUMNS``).
"""

from __future__ import annotations

import os
import queue
import sys
import time

from hardware.serve import worker
from traces.schema import Status

#: one row per engine step: decodes and their total and longest context, prompt chunks and
#: their total and longest tokens, preemptions, the step's seconds (start..end) and the loop's
#: period (from the end of the previous iteration, its messages sent, to the end of this one;
#: empty unless the loop stepped in both and never waited between them)
STEP_COLUMNS = ("num_decodes", "decode_total", "decode_longest", "num_chunks", "chunk_total",
                "chunk_longest", "num_preempted", "seconds", "period_s")


def step_row(result, period_s: float | None) -> str:
    c, t = result.decode_contexts, [n for n, _ in result.chunks]
    cells = (len(c), sum(c), max(c, default=0), len(t), sum(t), max(t, default=0),
             len(result.preempted), repr(result.end - result.start),
             "" if period_s is None else repr(period_s))
    return ",".join(map(str, cells)) + "\n"


def make_engine(model, args):
    from hardware.kv_layout import blocks_for
    from hardware.serve.aggregated_engine import BLOCK_TOKENS, AggregatedEngine

    return AggregatedEngine(model, blocks_for(args.num_tokens, BLOCK_TOKENS),
                            args.max_batch_tokens, args.max_batch_size, BLOCK_TOKENS)


def _handle(msg: dict, engine, link) -> bool:
    """Act on one router message; False for ``stop``."""
    op = msg.get("op")
    if op == "stop":
        return False
    if op == "generate":
        why = engine.check(msg["prompt"], msg["max_tokens"])
        if why:
            link.send({"ev": "failed", "rid": msg["rid"],
                       "status": Status.REJECTED_DECODE_CAPACITY.value, "error": why})
        else:
            engine.add(msg["rid"], msg["prompt"], msg["max_tokens"])
    elif op == "drop":
        engine.drop(msg["rid"])
    elif op == "stats":
        link.send({"ev": "stats", "busy_s": engine.busy_s,
                   "held_blocks": sorted(engine.held_blocks),
                   "running": len(engine.running), "queued": len(engine.waiting),
                   "num_preemptions": engine.num_preemptions,
                   "free_blocks": len(engine.free)})
    return True


def _report(result, engine, link) -> None:
    for rid, start, end in result.prefilled:
        link.send({"ev": "prefilled", "rid": rid, "prefill_start_at": start,
                   "prefill_end_at": end})
    link.send({"ev": "tokens", "at": result.end, "items": result.items,
               "finished": result.finished, "free_blocks": len(engine.free)})


def run_aggregated(args, token: str) -> None:
    model = worker.load_model(args)
    engine = make_engine(model, args)
    link = worker.RouterLink(args.router, token, {"role": "aggregated", "device": str(model.device)})
    print(f"aggregated worker {link.index}: {engine.num_blocks} KV blocks of "
          f"{engine.block_size}, {model.device}", file=sys.stderr, flush=True)
    log = None
    if args.step_log:
        os.makedirs(args.step_log, exist_ok=True)
        log = open(os.path.join(args.step_log, f"aggregated{link.index}.csv"), "w", buffering=1)
        log.write(",".join(STEP_COLUMNS) + "\n")
    last_end = None                           # the previous iteration's end, if it stepped
    try:
        while True:
            busy = bool(engine.running or engine.waiting)
            if not busy:
                last_end = None
            try:
                msg = link.inbox.get(timeout=None if not busy else 0)
            except queue.Empty:
                msg = None
            while msg is not None:
                if not _handle(msg, engine, link):
                    return
                msg = link.inbox.get_nowait() if not link.inbox.empty() else None
            if not (engine.running or engine.waiting):
                continue
            result = engine.step()
            if result is None:                  # nothing fits now (cannot last: see check)
                time.sleep(worker.RETRY_S)
                last_end = None
                continue
            _report(result, engine, link)
            now = time.time()
            if log is not None:
                log.write(step_row(result, None if last_end is None else now - last_end))
            last_end = now
    finally:
        if log is not None:
            log.close()


def main(argv=None) -> int:
    return worker.main(argv, run_aggregated)


if __name__ == "__main__":
    sys.exit(main())
