"""A decode instance: pulls KV caches, then continuous batching with fast-forward.

Flow of one request (Algorithm 1 of the paper, decode side):
1. ``offer``: prefill is done; the request waits in ``pending`` until the instance's memory pool
   (``sim.engine.memory``) can reserve the blocks its admission policy asks for
   (``policies.admission``; on-demand blocks, preemption and restores: ``sim.engine.preemption``).
   A pool that has the room in total but cannot lay it out fails the request (out of memory).
2. Pull: the transfer is priced by the mechanism (``sim.models.transfer``) and handed to the link.
   With a prefix cache (``prefix``, ``sim.engine.prefix_cache``) the instance pulls only the
   tokens past the blocks it already holds; its memory still reserves the whole prompt.
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

import numpy as np
import simpy

from policies.admission import ADMISSION
from policies.batching import fcfs_decode_admit
from sim.engine import preemption
from sim.engine.decode_state import Batch, Preemptions, Pulls, check_decode
from sim.engine.faults import lose_instance, transfer_failed
from sim.engine.link import HostQueue
from sim.engine.timers import MovableTimer
from traces.schema import Status


class DecodeInstance:
    """One decode instance. Its state is three objects (``sim.engine.decode_state``, where
    their invariants are written): ``batch`` (the running batch and the live run),
    ``pulls`` (requests waiting for memory or on the link) and ``room`` (on-demand blocks
    and preemption); ``kv`` is the running requests' on-demand blocks
    (``sim.engine.memory.GrowingKV``, None when requests reserve up front). The rest is
    configuration and collaborators, set here and never changed (``faults``, ``reroute``:
    by the cluster before the run; ``lost``: once, by ``lose``)."""

    #: check every invariant of ``sim.engine.decode_state`` after each timer firing (slow:
    #: for tests, which set it on the class)
    check_every_step = False

    def __init__(self, env: simpy.Environment, index: int, ledger, predictor, link, *,
                 memory, pricing, max_batch_size: int, host_slowdown: float = 1.0,
                 fast_forward: bool = True, admission: str = "oracle-reserve",
                 max_tokens: int = 0, restore_time=None):
        self.env, self.index, self.ledger = env, index, ledger
        self.predictor, self.link = predictor, link
        self.memory, self.pricing = memory, pricing
        self.stages = memory.stages       # the pool frees staging space once re-laid out
        self.max_batch_size = max_batch_size
        self.host_slowdown = host_slowdown
        self.fast_forward = fast_forward
        # The engine pads every request to the batch's longest context: a step costs
        # batch x the longest (sim.models.predictor.BATCH_PADDINGS), a total that also grows by
        # batch per step, so a run's closed form still holds until membership changes.
        self.padded = getattr(predictor, "batch_padding", "none") == "longest"
        self.host = HostQueue()           # this node's host CPU and PCIe root (sim.engine.link)
        # KV admission (policies.admission). A staging pool (GN-Direct's single buffer) lays
        # each request out whole when it lands, so it reserves prompt + output whatever the
        # policy: on-demand growth is modelled for the block and HAWK pools.
        self.admission = ADMISSION[admission]
        self.max_tokens = max_tokens          # longest context one request may reach here
        self.restore_time = restore_time      # (tokens, "recompute"|"swap") -> seconds
        on_demand = self.admission.on_demand and not self.stages
        if not on_demand:
            self.admission = ADMISSION["oracle-reserve"] if self.stages else self.admission
        self.kv = None
        if on_demand:
            from sim.engine.memory import GrowingKV

            self.kv = GrowingKV(memory)
        self.batch, self.pulls = Batch(), Pulls()
        self.room = Preemptions(slack=memory.free_blocks if hasattr(memory, "free_blocks")
                                else 0)
        self.timer = MovableTimer(env, self._on_timer_checked if self.check_every_step
                                  else self._on_timer)   # at the live run's end
        # Faults (sim.engine.faults): set by the cluster when the run injects any.
        self.faults = None
        self.reroute = None                   # (request, source) -> None: another instance
        self.lost = False
        self.prefix = None                    # its prefix cache (set by the cluster), or None

    def check(self, ended: bool = False) -> None:
        """Assert every invariant of the instance's state (``sim.engine.decode_state``);
        ``ended``: the run went to its end, so it holds nothing."""
        check_decode(self, ended)

    def _on_timer_checked(self) -> None:
        self._on_timer()
        check_decode(self)

    # the run's statistics (``sim.engine.cluster``)
    num_iterations = property(lambda self: self.batch.num_iterations)
    num_wakeups = property(lambda self: self.batch.num_wakeups)
    num_preemptions = property(lambda self: self.room.num_preemptions)

    def lose(self) -> None:
        """The instance is lost now (``sim.engine.faults.lose_instance``)."""
        lose_instance(self)

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] spent in decode iterations, for ``t`` = now (the end of a run,
        cut or not). Runs are committed up to the live plan's start, which lies past ``t``
        only when a run was committed ahead to its next boundary: then the term below is
        negative and takes that part back; otherwise it adds the live run up to ``t``."""
        batch = self.batch
        if batch.plan is None:
            return batch.busy_time
        return batch.busy_time + min(t, batch.end_at) - batch.plan[0]

    @property
    def load(self) -> int:
        return self.pulls.num_assigned

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
        pulls = self.pulls
        pulls.num_assigned += 1
        self.ledger.decode_instance[i] = self.index
        pulls.pending.append((i, source))
        if len(pulls.pending) == 1:           # else it waits behind earlier requests
            self._pull()

    def _pull(self) -> None:
        ledger, pulls, now = self.ledger, self.pulls, self.env._now
        pending = pulls.pending
        try_reserve, prompt, output = self.memory.try_reserve, ledger.prompt, ledger.output
        kv, room, oracle = self.kv, self.room, self.admission.name == "oracle-reserve"
        while pending:
            i, source = pending[0]
            if kv is None:
                extra = output[i] if oracle else preemption.reservation(self, i)
            else:                     # on-demand: the blocks of the context it lands with
                if source is None:    # preempted: it resumes with the context it had
                    if now < room.preempted_at[i]:
                        break         # preempted at a boundary planned ahead: not yet reached
                    context = room.resume[i]
                else:
                    if room.rejoin or room.due is not None:
                        preemption.plan_due(self, now)
                    context = prompt[i] + 1
                if pulls.num_assigned - len(pending) >= self.max_batch_size:
                    break             # no batch slot for it yet (vLLM's max_num_seqs)
                need = -(-context // kv.block_size)
                if need <= room.slack:
                    room.slack -= need                 # the live run keeps its blocks
                elif preemption.fits(self, need):
                    room.slack = -1                    # the live run may be short of blocks
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
                pulls.num_assigned -= 1
                continue
            if source is None:                        # preempted: its KV comes back here
                preemption.restore(self, i, context, now)
                continue
            if room.slack < 0:                        # (on-demand only)
                preemption.after_reserving(self, now)
            if self.faults is not None:
                pulls.in_flight[i] = source
            hit = 0 if self.prefix is None else self.prefix.admit(i, prompt[i])
            cost = self.pricing.price(prompt[i] - hit)    # what it lacks
            ledger.kv_bytes[i] = int(cost.wire_bytes)
            ledger.transfer_start_at[i] = now
            self.link.start(cost.before_s, cost.wire_bytes, self._arrived, (i, source, cost),
                            getattr(source, "host", None), getattr(cost, "source_host_s", 0.0))
        if kv is not None and (room.rejoin or room.due is not None):
            preemption.plan_due(self, now)

    def _arrived(self, transfer: tuple) -> None:
        """The last byte landed: free the sender, then the mechanism's after phase."""
        i, source, cost = transfer
        if self.faults is not None and transfer_failed(self, transfer):
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
            self.pulls.in_flight.pop(i, None)
        ledger, now, batch = self.ledger, self.env._now, self.batch
        if self.stages:
            self.memory.relayout_done(i)
        ledger.transfer_end_at[i] = ledger.first_token_at[i] = now
        if ledger.output[i] == 1:
            self._finish(i, now)
            self._pull()
            return
        batch.waiting.append(i)
        if batch.plan is None:
            self._boundary(0)
        elif len(batch.running) < self.max_batch_size:
            self._change_at_next_boundary(now)

    def _finish(self, i: int, now: float) -> None:
        self.ledger.finish(i, now)
        self.memory.release(i)
        if self.prefix is not None:
            self.prefix.release(i)
        self.pulls.num_assigned -= 1

    def _host_change(self, delta: int) -> None:
        batch = self.batch
        batch.host_jobs += delta
        factor = self.host_slowdown if batch.host_jobs else 1.0
        if factor != batch.factor:
            batch.factor = factor
            if batch.plan is not None:
                self._change_at_next_boundary(self.env.now)

    # -- the batch loop -----------------------------------------------------------------
    def _change_at_next_boundary(self, now: float) -> None:
        """A change mid-run (a request landed with room in the batch, a new step-time factor)
        takes effect at the next iteration boundary: commit the live run up to there and plan
        the next run from it, now. Only the timer moves; no event marks the join."""
        if not self.fast_forward:
            return                                     # the oracle stops at every boundary
        b, kv = self.batch, self.kv
        start, batch, context, steps, factor = b.plan
        if now < start and now < b.boundary_at:
            # A planned run not yet begun: redo it from the same boundary (its instant stays
            # ``boundary_at``; ``start`` is later by any restore stall planned there). If room
            # must or may be made there (short of blocks, or requests wait for memory), redo
            # it when the boundary is reached: memory freed before then (a failed transfer, a
            # one-token request ending as it lands) may spare the requests a redo now would
            # preempt, and the changes before then (landings come in bursts as memory frees)
            # take one redo, not one each, for a timer firing. Else redo it now (no event).
            if b.redo_due:
                return
            if kv is not None and b.running and (
                    self.pulls.pending or kv.short(b.iteration)):
                b.redo_due = True
                self.timer.set(b.boundary_at)
                return
            preemption.redo(self, short=False)
            return
        # (in a stall, its first step has begun)
        done, t = self.predictor.decode_next_boundary(batch, context, steps,
                                                      max(now - start, 0.0) / factor)
        if done >= steps:
            return                                     # the run's end is that boundary
        at = start + factor * t
        if kv is not None and (self.pulls.pending or self.room.slack < 0 and
                               kv.short(b.iteration + done)):
            # Room must or may be made at that boundary (a run with slack >= 0 has the blocks
            # of all its steps; requests waiting for memory may take them): decide whom to
            # preempt when it is reached (memory freed before then may spare them), with the
            # changes made until then planned once. The live run ends there instead.
            b.plan = (start, batch, context, done, factor)
            b.steps, b.end_at, self.room.slack = done, at, -1
            self.timer.set(at)
            return
        b.busy_time += at - start
        b.num_iterations += done
        b.iteration += done
        self._plan_from(self._admit(at))

    def _on_timer(self) -> None:
        batch = self.batch
        batch.num_wakeups += 1
        if batch.redo_due:                     # a boundary planned ahead, reached: redo it
            batch.redo_due = False
            preemption.redo(self)
            return
        self._boundary(batch.steps)

    def _boundary(self, steps: int) -> None:
        """``steps`` iterations of the live run have completed: finish, admit, replan."""
        now, ledger, batch, kv = self.env._now, self.ledger, self.batch, self.kv
        running = batch.running
        if batch.plan is not None:
            batch.busy_time += now - batch.plan[0]
            batch.num_iterations += steps
        batch.iteration += steps
        it = batch.iteration
        freed = False
        if running and running[0][0] == it:
            prompt, joined = ledger.prompt, ledger.join_iteration
            while running and running[0][0] == it:
                _, i = running.pop(0)
                batch.context_base -= (kv.leave(i) if kv is not None
                                       else prompt[i] + 1 - joined[i])
                self._finish(i, now)
            freed = True
        at = now if batch.plan is not None or now >= batch.idle_at else batch.idle_at
        pending = self.pulls.pending
        if freed and pending and kv is not None:
            at = self._admit(at)
            if running:
                # Pulls follow: restores among them join this boundary, so plan once they are
                # in (``preemption.plan_due``); until then the step in progress is this
                # boundary's.
                self.room.due, self.room.slack = at, -1
            else:
                self._plan_from(at)
            self._pull()
            return
        self._plan_from(self._admit(at))
        if freed and pending:
            self._pull()

    def _admit(self, at: float, redo: bool = False, room: bool = True) -> float:
        """At iteration boundary ``at``: make room (on-demand, preempt what the step has no
        blocks for; restores and swaps stall the batch), then join waiting requests. Returns
        the run's start (``at`` after any stall). ``redo``: the boundary planned last again;
        ``room`` False: the step's blocks are known to be there."""
        batch, kv = self.batch, self.kv
        running, waiting, it = batch.running, batch.waiting, batch.iteration
        pre = self.room
        if not redo:
            batch.boundary_at = at
            if pre.joined:
                pre.joined.clear()
        # The last plan left ``slack`` blocks over its last step; one step more takes at
        # most one block per request it ran, so only a smaller slack needs the bound.
        if room and kv is not None and (pre.restoring or pre.stall or running and (
                batch.plan is None or pre.slack < batch.plan[1]) and
                kv.growth_upper(it) > self.memory.free_blocks):
            at = preemption.make_room(self, at, it)
        if waiting and pre.preempted_step != it:      # no joins in a step that preempted
            ledger, resume = self.ledger, pre.resume
            for _ in range(fcfs_decode_admit(len(waiting), len(running), self.max_batch_size)):
                i = waiting.popleft()
                ledger.join_iteration[i] = it
                prompt = ledger.prompt[i]
                restored = bool(resume) and i in resume
                context = resume.pop(i) if restored else prompt + 1
                batch.context_base += context - it
                insort(running, (it + ledger.output[i] - context + prompt, i))
                if kv is not None:
                    kv.join(i, context - it, it)
                    pre.joined.append((i, restored))
        return at

    def _plan_from(self, at: float) -> None:
        """Plan the run from the boundary reached (starting at ``at``): up to the next finish
        (fast-forward) or one iteration (the oracle); on-demand, also up to the first step
        short of blocks, where running requests are preempted."""
        b, kv = self.batch, self.kv
        running, it = b.running, b.iteration
        if running:
            batch, factor = len(running), b.factor
            steps = running[0][0] - it if self.fast_forward else 1
            if kv is not None:
                if b.waiting and self.room.preempted_step == it:
                    steps = 1                      # they join at the next boundary
                B = kv.block_size                  # spare blocks over the run's last step
                slack = self.memory.free_blocks + kv.reserved - (
                    b.context_base + batch * (it + steps + B - 2)) // B
                if slack < 0:
                    steps, slack = kv.steps_short(it, steps), 0
                self.room.slack = slack
            context = b.context_base + batch * it
            if self.padded:               # a request's context is its offset + it, where
                ledger = self.ledger      # offset = prompt + output - finish iteration
                context = batch * (it + max([ledger.prompt[i] + ledger.output[i] - f
                                             for f, i in running]))
            b.plan = (at, batch, context, steps, factor)
            end = at + factor * self.predictor.decode_time(batch, context, steps)
            b.steps, b.end_at = steps, end
            self.timer.set(end)                    # moved, or set when none is pending
        else:
            b.plan = None
            self.timer.cancel()
            b.idle_at = at                     # a boundary planned ahead ends there
            if kv is not None:
                self.room.slack = self.memory.free_blocks
