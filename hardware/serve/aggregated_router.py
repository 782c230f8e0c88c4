"""The router in front of aggregated workers: ``python -m hardware.serve.aggregated_router``
(the same flags, endpoints and printed line as ``hardware.serve.router``).

An aggregated worker (``hardware.serve.aggregated_worker``) serves both phases of a request on
one model and cache, so a request goes to one worker, chosen by the routing policy over the
workers' outstanding tokens (prompt + max_tokens until its first token, then max_tokens), and
no KV moves. Messages (``hardware.wire`` frames)::

    router -> worker   {"op": "generate", "rid", "prompt", "max_tokens"} | {"op": "drop", "rid"}
                       | {"op": "stats"} | {"op": "stop"}
    worker -> router   {"ev": "prefilled", "rid", "prefill_start_at", "prefill_end_at"}
                       | {"ev": "tokens", "at", "items", "finished", "free_blocks"}
                       | {"ev": "failed", "rid", "status", "error"} | {"ev": "stats", ...}

Everything else is the disaggregated router's (``router.Router``): timeouts, cancellation, a
lost worker failing its own requests (``failed_instance_lost``), the log of
``/hawk/requests``, whose records carry the worker's index as both ``prefill_instance`` and
``decode_instance``, no transfer instants and ``kv_bytes`` 0.
"""

from __future__ import annotations

import itertools
import sys
import time

from hardware.serve.router import Router, Tracked, Worker
from hardware.wire import write_frame
from traces.schema import Status

ROLE = "aggregated"


class AggregatedRouter(Router):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers = {ROLE: {}}
        self._worker_ids = {ROLE: itertools.count()}

    def alive(self, role: str) -> list[Worker]:
        return [w for w in self.workers.get(role, {}).values() if w.alive]

    def _announce_peers(self) -> None:          # nobody pulls KV from anybody
        pass

    def _owed(self, r: Tracked) -> int:
        """Tokens ``r`` still adds to its worker's load."""
        return r.max_tokens + (len(r.prompt) if r.stage == "prefill" else 0)

    def _lost(self, w: Worker) -> None:
        w.alive = False
        if w.stats is not None and not w.stats.done():
            w.stats.set_result(None)
        for r in self.requests.values():
            if r.prefill == w.index and r.status == Status.UNFINISHED.value:
                self._fail(r, Status.FAILED_INSTANCE_LOST.value, f"{ROLE} worker {w.index} lost")

    def on_event(self, w: Worker, msg: dict) -> None:
        if msg.get("ev") != "prefilled":
            return super().on_event(w, msg)      # stats, tokens, failed
        r = self.requests.get(msg.get("rid"))
        if r is None or r.status != Status.UNFINISHED.value:
            return
        r.instants.update(prefill_start_at=msg["prefill_start_at"],
                          prefill_end_at=msg["prefill_end_at"])
        r.stage = "decode"
        w.load -= len(r.prompt)

    def _fail(self, r: Tracked, status: str, error: str) -> None:
        w = self.workers[ROLE].get(r.prefill)
        if w is not None:
            w.load -= self._owed(r)
        r.status, r.error, r.stage = status, error, "done"
        r.instants.setdefault("finished_at", time.time())
        if w is not None and w.alive:
            write_frame(w.writer, {"op": "drop", "rid": r.rid})
        r.events.put_nowait(("error", f"{status}: {error}"))

    def submit(self, prompt: list[int], max_tokens: int, worker: Worker | None = None) -> Tracked:
        """Send a request to an aggregated worker (the routing policy's, or ``worker``)."""
        live = self.alive(ROLE)
        if not live:
            raise LookupError("no live workers: 0 aggregated")
        if worker is None:
            n = next(self._routed)
            worker = live[self.route([w.load for w in live], [w.free_blocks for w in live], n)]
        now = time.time()
        r = Tracked(f"r{next(self._ids)}", prompt, max_tokens, now, prefill=worker.index,
                    decode=worker.index, deadline_at=now + self.request_timeout_s)
        self.requests[r.rid] = r
        worker.load += len(prompt) + max_tokens
        write_frame(worker.writer, {"op": "generate", "rid": r.rid, "prompt": prompt,
                                    "max_tokens": max_tokens})
        return r

    def expire(self, now: float) -> list[Tracked]:
        late = [r for r in self.requests.values()
                if r.status == Status.UNFINISHED.value and now > r.deadline_at]
        for r in late:
            self._fail(r, Status.FAILED_TIMEOUT.value,
                       f"not finished within {self.request_timeout_s:g} s (in {r.stage}, "
                       f"{ROLE} worker {r.prefill})")
        return late

    async def warm_up(self, max_tokens: int = 2) -> list[dict]:
        """One short request through every live worker (not kept in the log)."""
        live = self.alive(ROLE)
        tracked = [self.submit([1 + i % (self.vocab_size - 1)] * 8, max_tokens, w)
                   for i, w in enumerate(live)]
        out = []
        for w, r in zip(live, tracked):
            while (await r.events.get())[0] == "token":
                pass
            self.requests.pop(r.rid, None)
            out.append({ROLE: w.index, "status": r.status, "error": r.error})
        return out


def main(argv=None) -> int:
    from hardware.serve import router
    return router.main(argv, AggregatedRouter)


if __name__ == "__main__":
    sys.exit(main())
