"""A decode instance: pulls KV caches, then continuous batching with fast-forward.

Flow of one request (Algorithm 1 of the paper, decode side):
1. ``offer``: prefill is done; the request waits in ``pending`` until the instance's memory pool
   (``sim.engine.memory``) can reserve the blocks its admission policy asks for
   (``policies.admission``; on-demand blocks, preemption and restores: ``sim.engine.preemption``).
   A pool that has the room in total but cannot lay it out fails the request (out of memory).
2. Pull: the transfer is priced by the mechanism (``sim.models.transfer``) and handed to the link.
   A failed attempt (``sim.engine.faults``) is retried after a backoff, up to a limit.
   When the bytes have landed the prefill side frees its send buffer; the mechanism's after
   phase (host-to-device copy, re-layout) follows, during which a host-staged mechanism slows
   this node's decode steps. Then the KV is in the pool and the first token reaches the client.
3. At the next iteration boundary the request joins the batch; after ``n - 1`` iterations it
   finishes and its memory is released, which may let the next pending request be pulled.

Fast-forward (docs/design.md): between batch changes the batch is fixed, so the instance schedules
one timer for the ``k`` iterations until the next finish, timed in closed form by the predictor
(``decode_time``). A request landing mid-run, or a change of host slowdown, takes effect at the
next iteration boundary (``decode_next_boundary``): the instance commits the run up to that
boundary and plans the next run from it at once, so a join costs no event of its own (unless
requests wait for memory: see ``_change_at_next_boundary``). The instance's one timer
(``sim.engine.timers.MovableTimer``) is then moved to the new run's end, earlier or later, in place:
a replan adds no event, and no timer fires stale or re-arms. Committed
iterations may run up to one iteration ahead of the clock; a run cut short (``until``) shows
only what had happened by the cut (``Ledger.frame``). With ``fast_forward=False`` every
iteration is its own timer: the oracle the fast path is tested against.
"""

from __future__ import annotations

from bisect import insort
from collections import deque

import numpy as np
import simpy

from policies.admission import ADMISSION
from policies.batching import fcfs_decode_admit
from sim.engine.faults import DecodeFaults
from sim.engine.link import HostQueue
from sim.engine.preemption import DecodePreemption
from sim.engine.timers import MovableTimer
from traces.schema import Status


class DecodeInstance(DecodePreemption, DecodeFaults):
    def __init__(self, env: simpy.Environment, index: int, ledger, predictor, link, *,
                 memory, pricing, max_batch_size: int, host_slowdown: float = 1.0,
                 fast_forward: bool = True, admission: str = "oracle-reserve",
                 max_tokens: int = 0, restore_time=None):
        self.env, self.index, self.ledger = env, index, ledger
        self.predictor, self.link = predictor, link
        self.memory, self.pricing = memory, pricing
        self._stages = memory.stages      # the pool frees staging space once re-laid out
        self.max_batch_size = max_batch_size
        self.host_slowdown = host_slowdown
        self.fast_forward = fast_forward
        # The engine pads every request to the batch's longest context: a step costs
        # batch x the longest (sim.models.predictor.BATCH_PADDINGS), a total that also grows by
        # batch per step, so a run's closed form still holds until membership changes.
        self._padded = getattr(predictor, "batch_padding", "none") == "longest"
        self.host = HostQueue()           # this node's host CPU and PCIe root (sim.engine.link)
        self.pending: deque = deque()     # (request, prefill instance) awaiting memory
        self.waiting: deque[int] = deque()  # KV in the pool, waiting for a batch slot
        self.running: list = []           # (finish_iteration, request), sorted
        self.num_assigned = 0             # requests offered and not yet ended
        self.iteration = 0                # iterations completed since the start of the run
        self._context_base = 0            # total context = base + len(running) * iteration
        self._host_jobs = 0               # host-staged after phases running on this node
        self._factor = 1.0                # step-time factor in force (host slowdown)
        self._plan: tuple | None = None   # (start_at, batch, context, steps, factor)
        self._timer = MovableTimer(env, self._on_timer)   # at the live run's end
        self._timer_steps = 0             # iterations of the live run
        self._end = 0.0                   # when the live run ends
        self.busy_time = 0.0              # runs committed so far (up to the live plan's start)
        self.num_iterations = 0
        self.num_wakeups = 0              # timer firings: each ends a run at a boundary
        # KV admission (policies.admission). A staging pool (GN-Direct's single buffer) lays
        # each request out whole when it lands, so it reserves prompt + output whatever the
        # policy: on-demand growth is modelled for the block and HAWK pools.
        self.admission = ADMISSION[admission]
        self.max_tokens = max_tokens          # longest context one request may reach here
        self.restore_time = restore_time      # (tokens, "recompute"|"swap") -> seconds
        self._recompute_seconds: dict = {}    # tokens -> restore_time(tokens, "recompute")
        on_demand = self.admission.on_demand and not self._stages
        if not on_demand:
            self.admission = ADMISSION["oracle-reserve"] if self._stages else self.admission
        self._kv = None
        if on_demand:
            from sim.engine.memory import GrowingKV

            self._kv = GrowingKV(memory)
        self._resume: dict = {}               # preempted request -> context it resumes with
        self._preempted_at: dict = {}         # preempted request -> instant of its preemption
        self._restoring: list = []            # (request, seconds): KV being restored
        self._stall = 0.0                     # restore/swap seconds due at the next boundary
        self._boundary_at = 0.0               # when the live plan's first boundary was reached
        self._rejoin = False                  # restores reserved at that boundary: replan it
        self._due: float | None = None        # a boundary's run start, planned after its pulls
        self.num_preemptions = 0
        self._preempted_step = -1             # the last step that preempted (no joins then)
        self._joined: list = []               # (request, restored?) joined at _boundary_at
        self._redo_due = False                # the boundary planned ahead is redone when reached
        self._idle_at = 0.0                   # when the last run ended (idle since)
        self._slack = memory.free_blocks if hasattr(memory, "free_blocks") else 0
        # blocks pulls may take without cutting the live run short (on-demand; < 0: check)
        # Faults (sim.engine.faults): set by the cluster when the run injects any.
        self.faults = None
        self.reroute = None                   # (request, source) -> None: another instance
        self.lost = False
        self._in_flight: dict = {}            # request -> its source until its bytes land
        self._num_failed: dict = {}           # request -> failed attempts of its transfer
        self._attempt_at: dict = {}           # request -> start of its current retry

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
        if self.lost:                         # no live instance was left to take it
            self.ledger.decode_instance[i] = self.index
            self.ledger.fail(i, Status.FAILED_INSTANCE_LOST, self.env.now)
            source.release(i)
            return
        self.num_assigned += 1
        self.ledger.decode_instance[i] = self.index
        self.pending.append((i, source))
        if len(self.pending) == 1:            # else it waits behind earlier requests
            self._pull()

    def _pull(self) -> None:
        ledger, pending, now = self.ledger, self.pending, self.env._now
        try_reserve, prompt, output = self.memory.try_reserve, ledger.prompt, ledger.output
        kv, oracle = self._kv, self.admission.name == "oracle-reserve"
        while pending:
            i, source = pending[0]
            if kv is None:
                extra = output[i] if oracle else self._reservation(i)
            else:                     # on-demand: the blocks of the context it lands with
                if source is None:    # preempted: it resumes with the context it had
                    if now < self._preempted_at[i]:
                        break         # preempted at a boundary planned ahead: not yet reached
                    context = self._resume[i]
                else:
                    if self._rejoin or self._due is not None:
                        self._plan_due(now)
                    context = prompt[i] + 1
                if self.num_assigned - len(pending) >= self.max_batch_size:
                    break             # no batch slot for it yet (vLLM's max_num_seqs)
                need = -(-context // kv.block_size)
                if need <= self._slack:
                    self._slack -= need                # the live run keeps its blocks
                elif self._fits(need):
                    self._slack = -1                   # the live run may be short of blocks
                else:
                    self.memory.num_waits += 1
                    break
                extra = context - prompt[i]
            verdict = try_reserve(i, prompt[i], extra)
            if verdict == "wait":
                break
            pending.popleft()
            if verdict == "oom":
                ledger.fail(i, Status.FAILED_OUT_OF_MEMORY, now)
                source.release(i)
                self.num_assigned -= 1
                continue
            if source is None:                        # preempted: its KV comes back here
                self._restore(i, context, now)
                continue
            if self._slack < 0:
                self._after_reserving(now)
            if self.faults is not None:
                self._in_flight[i] = source
            cost = self.pricing.price(prompt[i])
            ledger.kv_bytes[i] = int(cost.wire_bytes)
            ledger.transfer_start_at[i] = now
            self.link.start(cost.before_s, cost.wire_bytes, self._arrived, (i, source, cost),
                            getattr(source, "host", None), getattr(cost, "source_host_s", 0.0))
        if self._rejoin or self._due is not None:
            self._plan_due(now)

    def _arrived(self, transfer: tuple) -> None:
        """The last byte landed: free the sender, then the mechanism's after phase."""
        i, source, cost = transfer
        if self.faults is not None and self._transfer_fault(transfer):
            return
        source.release(i)
        if cost.after_s > 0:
            if cost.host_cpu_s > 0:
                self._host_change(+1)
            queued = getattr(cost, "dest_host_s", 0.0)   # waits behind this host's other work
            now = self.env._now
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
        if self.faults is not None:
            if self.lost:
                return                            # failed with the instance
            self._in_flight.pop(i, None)
        ledger, now = self.ledger, self.env._now
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
        if now < start and now < self._boundary_at:
            # A planned run not yet begun: redo it from the same boundary (its instant stays
            # ``_boundary_at``; ``start`` is later by any restore stall planned there). If room
            # must or may be made there (short of blocks, or requests wait for memory), redo
            # it when the boundary is reached: memory freed before then (a failed transfer, a
            # one-token request ending as it lands) may spare the requests a redo now would
            # preempt, and the changes before then (landings come in bursts as memory frees)
            # take one redo, not one each, for a timer firing. Else redo it now (no event).
            if self._redo_due:
                return
            if self._kv is not None and self.running and (
                    self.pending or self._kv.short(self.iteration)):
                self._redo_due = True
                self._timer.set(self._boundary_at)
                return
            self._redo(short=False)
            return
        # (in a stall, its first step has begun)
        done, t = self.predictor.decode_next_boundary(batch, context, steps,
                                                      max(now - start, 0.0) / factor)
        if done >= steps:
            return                                     # the run's end is that boundary
        at = start + factor * t
        if self._kv is not None and (self.pending or self._slack < 0 and
                                     self._kv.short(self.iteration + done)):
            # Room must or may be made at that boundary (a run with slack >= 0 has the blocks
            # of all its steps; requests waiting for memory may take them): decide whom to
            # preempt when it is reached (memory freed before then may spare them), with the
            # changes made until then planned once. The live run ends there instead.
            self._plan = (start, batch, context, done, factor)
            self._timer_steps, self._end, self._slack = done, at, -1
            self._timer.set(at)
            return
        self.busy_time += at - start
        self.num_iterations += done
        self.iteration += done
        self._plan_from(self._admit(at))

    def _on_timer(self) -> None:
        self.num_wakeups += 1
        if self._redo_due:                     # a boundary planned ahead, reached: redo it
            self._redo_due = False
            self._redo()
            return
        self._boundary(self._timer_steps)

    def _boundary(self, steps: int) -> None:
        """``steps`` iterations of the live run have completed: finish, admit, replan."""
        now, ledger, running = self.env._now, self.ledger, self.running
        if self._plan is not None:
            self.busy_time += now - self._plan[0]
            self.num_iterations += steps
        self.iteration += steps
        it = self.iteration
        freed = False
        if running and running[0][0] == it:
            prompt, joined = ledger.prompt, ledger.join_iteration
            while running and running[0][0] == it:
                _, i = running.pop(0)
                self._context_base -= (self._kv.leave(i) if self._kv is not None
                                       else prompt[i] + 1 - joined[i])
                self._finish(i, now)
            freed = True
        at = now if self._plan is not None or now >= self._idle_at else self._idle_at
        if freed and self.pending and self._kv is not None:
            at = self._admit(at)
            if running:
                # Pulls follow: restores among them join this boundary, so plan once they are
                # in (``_plan_due``); until then the step in progress is this boundary's.
                self._due, self._slack = at, -1
            else:
                self._plan_from(at)
            self._pull()
            return
        self._plan_from(self._admit(at))
        if freed and self.pending:
            self._pull()

    def _admit(self, at: float, redo: bool = False, room: bool = True) -> float:
        """At iteration boundary ``at``: make room (on-demand, preempt what the step has no
        blocks for; restores and swaps stall the batch), then join waiting requests. Returns
        the run's start (``at`` after any stall). ``redo``: the boundary planned last again;
        ``room`` False: the step's blocks are known to be there."""
        running, waiting, it, kv = self.running, self.waiting, self.iteration, self._kv
        if not redo:
            self._boundary_at = at
            if self._joined:
                self._joined.clear()
        # The last plan left ``_slack`` blocks over its last step; one step more takes at
        # most one block per request it ran, so only a smaller slack needs the bound.
        if room and kv is not None and (self._restoring or self._stall or running and (
                self._plan is None or self._slack < self._plan[1]) and
                kv.growth_upper(it) > self.memory.free_blocks):
            at = self._make_room(at, it)
        if waiting and self._preempted_step != it:     # no joins in a step that preempted
            ledger, resume = self.ledger, self._resume
            for _ in range(fcfs_decode_admit(len(waiting), len(running), self.max_batch_size)):
                i = waiting.popleft()
                ledger.join_iteration[i] = it
                prompt = ledger.prompt[i]
                restored = bool(resume) and i in resume
                context = resume.pop(i) if restored else prompt + 1
                self._context_base += context - it
                insort(running, (it + ledger.output[i] - context + prompt, i))
                if kv is not None:
                    kv.join(i, context - it, it)
                    self._joined.append((i, restored))
        return at

    def _plan_from(self, at: float) -> None:
        """Plan the run from the boundary reached (starting at ``at``): up to the next finish
        (fast-forward) or one iteration (the oracle); on-demand, also up to the first step
        short of blocks, where running requests are preempted."""
        running, it, kv = self.running, self.iteration, self._kv
        if running:
            batch, factor = len(running), self._factor
            steps = running[0][0] - it if self.fast_forward else 1
            if kv is not None:
                if self.waiting and self._preempted_step == it:
                    steps = 1                      # they join at the next boundary
                B = kv.block_size                  # spare blocks over the run's last step
                slack = self.memory.free_blocks + kv.reserved - (
                    self._context_base + batch * (it + steps + B - 2)) // B
                if slack < 0:
                    steps, slack = kv.steps_short(it, steps), 0
                self._slack = slack
            context = self._context_base + batch * it
            if self._padded:              # a request's context is its offset + it, where
                ledger = self.ledger      # offset = prompt + output - finish iteration
                context = batch * (it + max([ledger.prompt[i] + ledger.output[i] - f
                                             for f, i in running]))
            self._plan = (at, batch, context, steps, factor)
            end = at + factor * self.predictor.decode_time(batch, context, steps)
            self._timer_steps, self._end = steps, end
            self._timer.set(end)                   # moved, or set when none is pending
        else:
            self._plan = None
            self._timer.cancel()
            self._idle_at = at                 # a boundary planned ahead ends there
            if kv is not None:
                self._slack = self.memory.free_blocks
