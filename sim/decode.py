"""A decode instance: pulls KV caches, then continuous batching with fast-forward.

Flow of one request (Algorithm 1 of the paper, decode side):
1. ``offer``: prefill is done; the request waits in ``pending`` until the instance's memory pool
   (``sim.npu_memory``) can reserve its KV blocks for prompt + output (no preemption). A pool
   that has the room in total but cannot lay it out fails the request (out of memory).
2. Pull: the transfer is priced by the mechanism (``sim.transfer``) and handed to the link.
   When the bytes have landed the prefill side frees its send buffer; the mechanism's after
   phase (host-to-device copy, re-layout) follows, during which a host-staged mechanism slows
   this node's decode steps. Then the KV is in the pool and the first token reaches the client.
3. At the next iteration boundary the request joins the batch; after ``n - 1`` iterations it
   finishes and its memory is released, which may let the next pending request be pulled.

Fast-forward (docs/design.md): between batch changes the batch is fixed, so the instance schedules
one timer for the ``k`` iterations until the next finish, timed in closed form by the predictor
(``decode_time``). A request landing mid-run, or a change of host slowdown, takes effect at the
next iteration boundary (``decode_next_boundary``): the instance commits the run up to that
boundary and plans the next run from it at once, so a join costs no event of its own. The live
timer is kept when the new run ends later (it re-arms when it fires) and replaced when it ends
sooner (only the latest timer counts; a superseded one does nothing when it fires). Committed
iterations may run up to one iteration ahead of the clock; a run cut short (``until``) shows
only what had happened by the cut (``Ledger.frame``). With ``fast_forward=False`` every
iteration is its own timer: the oracle the fast path is tested against.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
import simpy
from simpy.events import Timeout

from policies.batching import fcfs_decode_admit
from sim.link import HostQueue
from traces.schema import Status


class DecodeInstance:
    def __init__(self, env: simpy.Environment, index: int, ledger, predictor, link, *,
                 memory, pricing, max_batch_size: int, host_slowdown: float = 1.0,
                 fast_forward: bool = True):
        self.env, self.index, self.ledger = env, index, ledger
        self.predictor, self.link = predictor, link
        self.memory, self.pricing = memory, pricing
        self._stages = memory.stages      # the pool frees staging space once re-laid out
        self.max_batch_size = max_batch_size
        self.host_slowdown = host_slowdown
        self.fast_forward = fast_forward
        self.host = HostQueue()           # this node's host CPU and PCIe root (sim.link)
        self.pending: deque = deque()     # (request, prefill instance) awaiting memory
        self.waiting: deque[int] = deque()  # KV in the pool, waiting for a batch slot
        self.running: list = []           # heap of (finish_iteration, request)
        self.num_assigned = 0             # requests offered and not yet ended
        self.iteration = 0                # iterations completed since the start of the run
        self._context_base = 0            # total context = base + len(running) * iteration
        self._host_jobs = 0               # host-staged after phases running on this node
        self._factor = 1.0                # step-time factor in force (host slowdown)
        self._plan: tuple | None = None   # (start_at, batch, context, steps, factor)
        self._timer = None                # the live timer; any other one that fires is stale
        self._timer_at = 0.0              # when the live timer fires
        self._timer_steps = 0             # iterations of the live run
        self._end = 0.0                   # when the live run ends (>= _timer_at)
        self.busy_time = 0.0              # runs committed so far (up to the live plan's start)
        self.num_iterations = 0

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] spent in decode iterations, for ``t`` = now (the end of a run,
        cut or not). Runs are committed up to the live plan's start, which lies past ``t``
        only when a run was committed ahead to its next boundary: then the term below is
        negative and takes that part back; otherwise it adds the live run up to ``t``."""
        if self._plan is None:
            return self.busy_time
        return self.busy_time + min(t, self._end) - self._plan[0]

    @property
    def load(self) -> int:
        return self.num_assigned

    def fits_many(self, prompts: np.ndarray, outputs: np.ndarray) -> np.ndarray:
        """Whether each request could ever fit this instance's memory (arrays of lengths;
        the router checks a whole trace at once)."""
        return self.memory.fits_ever_many(prompts, outputs)

    # -- pull and transfer --------------------------------------------------------------
    def offer(self, i: int, source) -> None:
        """Prefill of ``i`` is done on ``source``; pull its KV cache when memory allows."""
        self.num_assigned += 1
        self.ledger.decode_instance[i] = self.index
        self.pending.append((i, source))
        if len(self.pending) == 1:            # else it waits behind earlier requests
            self._pull()

    def _pull(self) -> None:
        ledger, pending, now = self.ledger, self.pending, self.env.now
        try_reserve, prompt, output = self.memory.try_reserve, ledger.prompt, ledger.output
        while pending:
            i, source = pending[0]
            verdict = try_reserve(i, prompt[i], output[i])
            if verdict == "wait":
                return
            pending.popleft()
            if verdict == "oom":
                ledger.fail(i, Status.FAILED_OUT_OF_MEMORY, now)
                source.release(i)
                self.num_assigned -= 1
                continue
            cost = self.pricing.price(prompt[i])
            ledger.kv_bytes[i] = int(cost.wire_bytes)
            ledger.transfer_start_at[i] = now
            self.link.start(cost.before_s, cost.wire_bytes, self._arrived, (i, source, cost),
                            getattr(source, "host", None), getattr(cost, "source_host_s", 0.0))

    def _arrived(self, transfer: tuple) -> None:
        """The last byte landed: free the sender, then the mechanism's after phase."""
        i, source, cost = transfer
        source.release(i)
        if cost.after_s > 0:
            if cost.host_cpu_s > 0:
                self._host_change(+1)
            queued = getattr(cost, "dest_host_s", 0.0)   # waits behind this host's other work
            now = self.env.now
            delay = (self.host.reserve(now, queued) - now + cost.after_s - queued if queued > 0
                     else cost.after_s)
            timer = self.env.timeout(delay)
            timer.callbacks.append(lambda _ev: self._after_done(i, cost))
        else:
            self._landed(i)

    def _after_done(self, i: int, cost) -> None:
        if cost.host_cpu_s > 0:
            self._host_change(-1)
        self._landed(i)

    def _landed(self, i: int) -> None:
        """The KV cache of ``i`` is in the pool: its first token reaches the client."""
        ledger, now = self.ledger, self.env.now
        if self._stages:
            self.memory.relayout_done(i)
        ledger.transfer_end_at[i] = ledger.first_token_at[i] = now
        if ledger.output[i] == 1:
            self._finish(i, now)
            self._pull()
            return
        self.waiting.append(i)
        if self._plan is None:
            self._boundary(0)
        elif len(self.running) < self.max_batch_size:
            self._change_at_next_boundary(now)

    def _finish(self, i: int, now: float) -> None:
        self.ledger.finish(i, now)
        self.memory.release(i)
        self.num_assigned -= 1

    def _host_change(self, delta: int) -> None:
        self._host_jobs += delta
        factor = self.host_slowdown if self._host_jobs else 1.0
        if factor != self._factor:
            self._factor = factor
            if self._plan is not None:
                self._change_at_next_boundary(self.env.now)

    # -- the batch loop -----------------------------------------------------------------
    def _change_at_next_boundary(self, now: float) -> None:
        """A change mid-run (a request landed with room in the batch, a new step-time factor)
        takes effect at the next iteration boundary: commit the live run up to there and plan
        the next run from it, now. Only the timer moves; no event marks the join."""
        if not self.fast_forward:
            return                                     # the oracle stops at every boundary
        start, batch, context, steps, factor = self._plan
        if now < start:
            at = start                                 # a planned run not yet begun: redo it
        else:
            done, t = self.predictor.decode_next_boundary(batch, context, steps,
                                                          (now - start) / factor)
            if done >= steps:
                return                                 # the run's end is that boundary
            at = start + factor * t
            self.busy_time += at - start
            self.num_iterations += done
            self.iteration += done
        self._admit_and_plan(at, now)

    def _set_timer(self, end: float, now: float) -> None:
        self._timer_at = end
        timer = self._timer = Timeout(self.env, end - now if end > now else 0.0)
        timer.callbacks.append(self._on_timer)

    def _on_timer(self, timer) -> None:
        if timer is not self._timer:
            return                                     # superseded by an earlier timer
        if self._end > self._timer_at:                 # the run grew after this timer was set
            self._set_timer(self._end, self.env.now)
        else:
            self._timer = None
            self._boundary(self._timer_steps)

    def _boundary(self, steps: int) -> None:
        """``steps`` iterations of the live run have completed: finish, admit, replan."""
        now, ledger, running = self.env.now, self.ledger, self.running
        if self._plan is not None:
            self.busy_time += now - self._plan[0]
            self.num_iterations += steps
        self.iteration += steps
        it = self.iteration
        freed = False
        if running and running[0][0] == it:
            prompt, joined = ledger.prompt, ledger.join_iteration
            while running and running[0][0] == it:
                _, i = heapq.heappop(running)
                self._context_base -= prompt[i] + 1 - joined[i]
                self._finish(i, now)
            freed = True
        self._admit_and_plan(now, now)
        if freed and self.pending:
            self._pull()

    def _admit_and_plan(self, at: float, now: float) -> None:
        """Join waiting requests at iteration boundary ``at``, then plan the run from there:
        up to the next finish (fast-forward) or one iteration (the oracle)."""
        running, waiting, it = self.running, self.waiting, self.iteration
        if waiting:
            ledger = self.ledger
            for _ in range(fcfs_decode_admit(len(waiting), len(running), self.max_batch_size)):
                i = waiting.popleft()
                ledger.join_iteration[i] = it
                self._context_base += ledger.prompt[i] + 1 - it
                heapq.heappush(running, (it + ledger.output[i] - 1, i))
        if running:
            batch, factor = len(running), self._factor
            steps = running[0][0] - it if self.fast_forward else 1
            context = self._context_base + batch * it
            self._plan = (at, batch, context, steps, factor)
            end = at + factor * self.predictor.decode_time(batch, context, steps)
            self._timer_steps, self._end = steps, end
            # A live timer that fires no later is kept (it re-arms when it fires, _on_timer);
            # an earlier end needs a new timer, and the old one goes stale.
            if self._timer is None or end < self._timer_at:
                self._set_timer(end, now)
        else:
            self._plan = None
            self._timer = None
