"""On-demand KV blocks and preemption: the decode instance's side of ``policies.admission``.

Functions over a ``sim.engine.decode.DecodeInstance`` ``d``: its batch loop and pull path
stay there, and call in here where memory decides. They change ``d.room``
(``sim.engine.decode_state.Preemptions``), ``d.batch`` (requests preempted, restored, stalls)
and ``d.pulls.pending`` (a preempted request goes first), and read ``d.kv``, ``d.memory``.

Admission (``policies.admission``): a policy that reserves up front reserves its tokens when the
request is pulled (``reservation``), and nothing grows later. On-demand, a request reserves the
blocks of the context it lands with; the running requests' blocks then grow with their contexts
(``sim.engine.memory.GrowingKV``). A pull takes blocks the live run has spare (its slack) or that
are free beyond what the step in progress holds (``fits``); a pull that may leave the live run
short of blocks cuts it at the next boundary (``after_reserving``). When a step cannot get its
blocks the most recently admitted request is preempted there (``make_room``, ``preempt``): its
blocks are freed and it goes to the head of ``pending``, and later gets its blocks back and its
KV by recompute or swap (``restore``), which stalls the batch at the next boundary. A boundary
that freed memory is planned once its pulls are in (``plan_due``): restores reserved there join
it. A boundary planned ahead that a change reaches (a landing, a reservation) is redone once,
when reached (``redo``, ``unjoin``): memory freed before then may spare the requests it would
preempt, and the changes before then take one redo.
"""

from __future__ import annotations

from bisect import bisect_left

from policies.admission import reserve_tokens


def reservation(d, i: int) -> int:
    """Tokens beyond the prompt that request ``i`` reserves (policies that reserve up
    front: nothing grows later)."""
    prompt = d.ledger.prompt[i]
    return reserve_tokens(d.admission, prompt, d.ledger.output[i], prompt + 1,
                          d.max_tokens) - prompt


def fits(d, need: int) -> bool:
    """Whether ``need`` blocks are free now beyond those the step in progress holds: the
    running requests' growth up to the live run's last step bounds theirs in that step
    (``sim.engine.memory.GrowingKV``, O(1)), which settles most cases; else the exact sum."""
    free, kv, batch = d.memory.free_blocks, d.kv, d.batch
    if need > free:
        return False
    plan = batch.plan
    last = batch.iteration + plan[3] - 1 if plan and d.room.due is None else batch.iteration
    if not kv.base or need <= free - kv.growth_upper(last):
        return True
    return need <= free - kv.growth(step_now(d))


def step_now(d) -> int:
    """The decode step in progress now (its blocks are taken)."""
    batch = d.batch
    if batch.plan is None or d.room.due is not None:
        return batch.iteration
    start, size, context, steps, factor = batch.plan
    now = d.env._now
    if now < start:                # in a stall (step `iteration` has its blocks) or a run
        return batch.iteration if now >= batch.boundary_at else batch.iteration - 1
    j, _ = d.predictor.decode_next_boundary(size, context, steps, (now - start) / factor)
    return batch.iteration + j - 1


def after_reserving(d, now: float) -> None:
    """Reservations made now may cut the live run short, and restores join at the next
    boundary; both take effect there (at once when the instance is idle)."""
    batch, room = d.batch, d.room
    if batch.plan is None:
        if room.restoring:
            d._plan_from(d._admit(max(now, batch.idle_at)))
        return
    if room.restoring or d.kv.short(batch.iteration + batch.plan[3] - 1):
        d._change_at_next_boundary(now)
    elif room.slack < 0:
        room.slack = 0                         # the live run fits, with no room to spare


def restore(d, i: int, context: int, now: float) -> None:
    """Preempted ``i`` has its blocks again (for its ``context`` tokens): its KV is
    recomputed (a prefill-like pass of the tokens it had) or swapped back in, stalling
    the batch at the next boundary."""
    room = d.room
    room.slack = -1                            # restores take effect at the next boundary
    del room.preempted_at[i]
    kind = d.admission.preemption
    tokens = context - 1 if kind == "recompute" else context
    seconds = room.recompute_seconds.get(tokens) if kind == "recompute" else None
    if seconds is None:
        seconds = d.restore_time(tokens, kind) if tokens > 0 else 0.0
        if kind == "recompute":        # memoised: most restores recompute a context seen before
            room.recompute_seconds[tokens] = seconds
    room.restoring.append((i, seconds))
    if d.batch.plan is not None and now == d.batch.boundary_at:
        room.rejoin = True             # this boundary: redo it once the pull's restores are in
    else:
        after_reserving(d, now)


def plan_due(d, now: float) -> None:
    """Plan the run from the boundary just reached, once its pulls are in (before a new
    request's pull, which checks that plan's slack, or when the pulls stop).

    Restores reserved there join it: its plan is made (or redone) once for all of them.
    Each stalls the batch in turn (as a replan per restore would add it); they join
    first, in the order they were restored. Which restores fit depends on no plan: the
    step in progress is the boundary's, whose blocks they hold as their reservation."""
    batch, room = d.batch, d.room
    at, room.due = (batch.plan[0], None) if room.due is None else (room.due, None)
    if not room.rejoin:
        d._plan_from(at)
        return
    room.rejoin = False
    waiting, restoring = batch.waiting, room.restoring
    for i, _ in reversed(restoring):
        waiting.appendleft(i)
    for _, seconds in restoring:
        if seconds:
            batch.busy_time += seconds
            at += seconds
    restoring.clear()                          # (they fitted beyond the step's blocks:
    d._plan_from(d._admit(at, redo=True, room=False))   # no room to make)


def make_room(d, at: float, it: int) -> float:
    """At boundary ``it``: preempt what step ``it`` has no blocks for, queue the restored
    requests to join first, and stall for restores and swaps. Returns the run's start."""
    batch, room = d.batch, d.room
    running, waiting = batch.running, batch.waiting
    if running:
        before = len(running)
        for i, base in d.kv.make_room(it):
            preempt(d, i, base, it)
        if len(running) < before:              # no joins in a step that preempted
            room.preempted_step = it if running else -1
    for i, seconds in reversed(room.restoring):
        waiting.appendleft(i)
        room.stall += seconds
    room.restoring.clear()
    if room.stall:
        batch.busy_time += room.stall
        at += room.stall
        room.stall = 0.0
    return at


def preempt(d, i: int, base: int, it: int) -> None:
    """Preempt running ``i`` at iteration ``it``: free its blocks and queue it first."""
    # Its entry is (finish iteration, i), the finish iteration prompt + output - base
    # (a sorted list, not a heap: found by bisection, removed without re-heapifying).
    batch, room, ledger = d.batch, d.room, d.ledger
    running = batch.running
    del running[bisect_left(running, (ledger.prompt[i] + ledger.output[i] - base, i))]
    batch.context_base -= base
    d.memory.release(i)
    if d.prefix is not None:                 # its blocks may be evicted until it resumes
        d.prefix.release(i)
    context = room.resume[i] = base + it
    room.preempted_at[i] = batch.boundary_at
    if d.admission.preemption == "swap":
        room.stall += d.restore_time(context, "swap")          # swap out
    d.pulls.pending.appendleft((i, None))
    room.num_preemptions += 1


def unjoin(d) -> None:
    """Redoing a boundary planned ahead: the requests that joined there leave again, so
    that room is made among those running before it, and then they join afresh after
    the restores reserved since, as the oracle has it (it reaches that boundary with all
    of them reserved): restores first in line (their stall is counted already), then the
    others ahead of requests that landed since."""
    kv, ledger, batch, room = d.kv, d.ledger, d.batch, d.room
    running, it = batch.running, batch.iteration
    restores, others = [], []
    for i, restored in room.joined:
        base = kv.leave(i)
        batch.context_base -= base
        running.remove((ledger.prompt[i] + ledger.output[i] - base, i))
        if restored:
            room.resume[i] = base + it
            restores.append((i, 0.0))
        else:
            others.append(i)
    room.joined.clear()
    room.restoring[:0] = restores
    batch.waiting.extendleft(reversed(others))


def redo(d, short: bool | None = None) -> None:
    """Redo the boundary planned last, from its instant (see
    ``DecodeInstance._change_at_next_boundary``). ``short``: whether its step is short of
    blocks, when the caller has just found out (None: not known)."""
    room = d.room
    if room.joined and (room.restoring or (
            d.kv.short(d.batch.iteration) if short is None else short)):
        unjoin(d)                # (else they would join again alike: they hold no growth)
    # A step known not short needs no room made, unless restores or a stall are due
    # (saves re-deriving it: the bound, and make_room's exact growth).
    needs_room = short is not False or bool(room.restoring) or bool(room.stall)
    d._plan_from(d._admit(d.batch.plan[0], redo=True, room=needs_room))
