"""On-demand KV blocks and preemption: the decode instance's side of ``policies.admission``.

``sim.engine.decode.DecodeInstance`` mixes this in (as it does ``sim.engine.faults.DecodeFaults``); the batch
loop and the pull path stay there, and call in here where memory decides.

Admission (``policies.admission``): a policy that reserves up front reserves its tokens when the
request is pulled (``_reservation``), and nothing grows later. On-demand, a request reserves the
blocks of the context it lands with; the running requests' blocks then grow with their contexts
(``sim.engine.memory.GrowingKV``). A pull takes blocks the live run has spare (its slack) or that
are free beyond what the step in progress holds (``_fits``); a pull that may leave the live run
short of blocks cuts it at the next boundary (``_after_reserving``). When a step cannot get its
blocks the most recently admitted request is preempted there (``_make_room``, ``_preempt``): its
blocks are freed and it goes to the head of ``pending``, and later gets its blocks back and its
KV by recompute or swap (``_restore``), which stalls the batch at the next boundary. A boundary
that freed memory is planned once its pulls are in (``_plan_due``): restores reserved there join
it. A boundary planned ahead that a change reaches (a landing, a reservation) is redone once,
when reached (``_redo``, ``_unjoin``): memory freed before then may spare the requests it would
preempt, and the changes before then take one redo.
"""

from __future__ import annotations

from bisect import bisect_left

from policies.admission import reserve_tokens


class DecodePreemption:
    """On-demand blocks, preemption and restores of ``sim.engine.decode.DecodeInstance`` (it mixes
    this in): reads and updates that instance's batch state and its ``GrowingKV`` (``_kv``)."""

    def _reservation(self, i: int) -> int:
        """Tokens beyond the prompt that request ``i`` reserves (policies that reserve up
        front: nothing grows later)."""
        prompt = self.ledger.prompt[i]
        return reserve_tokens(self.admission, prompt, self.ledger.output[i], prompt + 1,
                              self.max_tokens) - prompt

    def _fits(self, need: int) -> bool:
        """Whether ``need`` blocks are free now beyond those the step in progress holds: the
        running requests' growth up to the live run's last step bounds theirs in that step
        (``sim.engine.memory.GrowingKV``, O(1)), which settles most cases; else the exact sum."""
        free, kv = self.memory.free_blocks, self._kv
        if need > free:
            return False
        plan = self._plan
        last = self.iteration + plan[3] - 1 if plan and self._due is None else self.iteration
        if not kv.base or need <= free - kv.growth_upper(last):
            return True
        return need <= free - kv.growth(self._step_now())

    def _step_now(self) -> int:
        """The decode step in progress now (its blocks are taken)."""
        if self._plan is None or self._due is not None:
            return self.iteration
        start, batch, context, steps, factor = self._plan
        now = self.env._now
        if now < start:                # in a stall (step `iteration` has its blocks) or a run
            return self.iteration if now >= self._boundary_at else self.iteration - 1
        j, _ = self.predictor.decode_next_boundary(batch, context, steps, (now - start) / factor)
        return self.iteration + j - 1

    def _after_reserving(self, now: float) -> None:
        """Reservations made now may cut the live run short, and restores join at the next
        boundary; both take effect there (at once when the instance is idle)."""
        if self._plan is None:
            if self._restoring:
                self._plan_from(self._admit(max(now, self._idle_at)))
            return
        if self._restoring or self._kv.short(self.iteration + self._plan[3] - 1):
            self._change_at_next_boundary(now)
        elif self._slack < 0:
            self._slack = 0                    # the live run fits, with no room to spare

    def _restore(self, i: int, context: int, now: float) -> None:
        """Preempted ``i`` has its blocks again (for its ``context`` tokens): its KV is
        recomputed (a prefill-like pass of the tokens it had) or swapped back in, stalling
        the batch at the next boundary."""
        self._slack = -1                       # restores take effect at the next boundary
        del self._preempted_at[i]
        kind = self.admission.preemption
        tokens = context - 1 if kind == "recompute" else context
        seconds = self._recompute_seconds.get(tokens) if kind == "recompute" else None
        if seconds is None:
            seconds = self.restore_time(tokens, kind) if tokens > 0 else 0.0
            if kind == "recompute":    # memoised: most restores recompute a context seen before
                self._recompute_seconds[tokens] = seconds
        self._restoring.append((i, seconds))
        if self._plan is not None and now == self._boundary_at:
            self._rejoin = True        # this boundary: redo it once the pull's restores are in
        else:
            self._after_reserving(now)

    def _plan_due(self, now: float) -> None:
        """Plan the run from the boundary just reached, once its pulls are in (before a new
        request's pull, which checks that plan's slack, or when the pulls stop).

        Restores reserved there join it: its plan is made (or redone) once for all of them.
        Each stalls the batch in turn (as a replan per restore would add it); they join
        first, in the order they were restored. Which restores fit depends on no plan: the
        step in progress is the boundary's, whose blocks they hold as their reservation."""
        at, self._due = (self._plan[0], None) if self._due is None else (self._due, None)
        if not self._rejoin:
            self._plan_from(at)
            return
        self._rejoin = False
        waiting, restoring = self.waiting, self._restoring
        for i, _ in reversed(restoring):
            waiting.appendleft(i)
        for _, seconds in restoring:
            if seconds:
                self.busy_time += seconds
                at += seconds
        restoring.clear()                      # (they fitted beyond the step's blocks:
        self._plan_from(self._admit(at, redo=True, room=False))   # no room to make)

    def _make_room(self, at: float, it: int) -> float:
        """At boundary ``it``: preempt what step ``it`` has no blocks for, queue the restored
        requests to join first, and stall for restores and swaps. Returns the run's start."""
        running, waiting = self.running, self.waiting
        if running:
            before = len(running)
            for i, base in self._kv.make_room(it):
                self._preempt(i, base, it)
            if len(running) < before:              # no joins in a step that preempted
                self._preempted_step = it if running else -1
        for i, seconds in reversed(self._restoring):
            waiting.appendleft(i)
            self._stall += seconds
        self._restoring.clear()
        if self._stall:
            self.busy_time += self._stall
            at += self._stall
            self._stall = 0.0
        return at

    def _preempt(self, i: int, base: int, it: int) -> None:
        """Preempt running ``i`` at iteration ``it``: free its blocks and queue it first."""
        # Its entry is (finish iteration, i), the finish iteration prompt + output - base
        # (a sorted list, not a heap: found by bisection, removed without re-heapifying).
        running, ledger = self.running, self.ledger
        del running[bisect_left(running, (ledger.prompt[i] + ledger.output[i] - base, i))]
        self._context_base -= base
        self.memory.release(i)
        context = self._resume[i] = base + it
        self._preempted_at[i] = self._boundary_at
        if self.admission.preemption == "swap":
            self._stall += self.restore_time(context, "swap")      # swap out
        self.pending.appendleft((i, None))
        self.num_preemptions += 1

    def _unjoin(self) -> None:
        """Redoing a boundary planned ahead: the requests that joined there leave again, so
        that room is made among those running before it, and then they join afresh after
        the restores reserved since, as the oracle has it (it reaches that boundary with all
        of them reserved): restores first in line (their stall is counted already), then the
        others ahead of requests that landed since."""
        kv, ledger, running, it = self._kv, self.ledger, self.running, self.iteration
        restores, others = [], []
        for i, restored in self._joined:
            base = kv.leave(i)
            self._context_base -= base
            running.remove((ledger.prompt[i] + ledger.output[i] - base, i))
            if restored:
                self._resume[i] = base + it
                restores.append((i, 0.0))
            else:
                others.append(i)
        self._joined.clear()
        self._restoring[:0] = restores
        self.waiting.extendleft(reversed(others))

    def _redo(self, short: bool | None = None) -> None:
        """Redo the boundary planned last, from its instant (see
        ``DecodeInstance._change_at_next_boundary``). ``short``: whether its step is short of
        blocks, when the caller has just found out (None: not known)."""
        if self._joined and (self._restoring or (
                self._kv.short(self.iteration) if short is None else short)):
            self._unjoin()           # (else they would join again alike: they hold no growth)
        # A step known not short needs no room made, unless restores or a stall are due
        # (saves re-deriving it: the bound, and make_room's exact growth).
        room = short is not False or bool(self._restoring) or bool(self._stall)
        self._plan_from(self._admit(self._plan[0], redo=True, room=room))
