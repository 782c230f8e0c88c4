"""The state of one decode instance, in three objects with their invariants written down.

``sim.engine.decode.DecodeInstance`` owns one of each; its batch loop, the preemption logic
(``sim.engine.preemption``) and the fault logic (``sim.engine.faults``) are functions over them.
Each class says who changes which field. The KV blocks themselves are the pool's
(``sim.engine.memory``: reservations) and, on-demand, ``sim.engine.memory.GrowingKV``'s (the
running requests' growth in closed form); ``check_decode`` checks theirs too.

A request assigned to an instance is in exactly one place: ``Pulls.pending`` (waiting for
memory; a preempted request too), on the link or in its after phase (``Pulls.in_flight`` when
the run injects faults, else not tracked), ``Preemptions.restoring`` (its blocks back, its KV
being restored), ``Batch.waiting`` (KV in the pool, waiting for a batch slot) or
``Batch.running``. ``check_decode`` checks all of it (tests call it at the end of runs, and
after every timer firing with ``DecodeInstance.check_every_step``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Batch:
    """The running batch and its live run (fast-forward: ``sim.engine.decode``).

    - ``running``: (finish iteration, request) pairs, sorted; at most ``max_batch_size``.
      A request that joined with ``base`` tokens (context - join iteration) finishes at
      iteration prompt + output - base.
    - ``context_base`` is the sum of the running requests' bases: their total context in
      step ``iteration`` is ``context_base + len(running) * iteration``.
    - ``plan`` = (start_at, batch, context, steps, factor) of the live run, None when none
      is live (no request runs); the timer is pending exactly when a run is live, at
      ``end_at`` (or at ``boundary_at`` with ``redo_due``). ``steps`` is the live run's.
    - ``iteration`` counts iterations committed (up to the live run's start, which may lie
      one boundary ahead of the clock); ``busy_time`` the seconds of the runs committed so
      far, restore stalls included.
    - ``factor`` is ``host_slowdown`` while ``host_jobs`` > 0 host-staged after phases run,
      else 1.

    Changed by the batch loop (``DecodeInstance._boundary``, ``_admit``, ``_plan_from``,
    ``_change_at_next_boundary``, ``_host_change``), by preemption (``make_room``,
    ``preempt``, ``unjoin``, ``plan_due``: stalls, requests leaving) and by
    ``faults.lose_instance``.
    """

    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)   # KV in the pool, waiting for a slot
    iteration: int = 0
    context_base: int = 0
    plan: tuple | None = None
    steps: int = 0                # iterations of the live run (its timer's)
    end_at: float = 0.0           # when the live run ends
    factor: float = 1.0           # step-time factor in force (host slowdown)
    host_jobs: int = 0            # host-staged after phases running on this node
    boundary_at: float = 0.0      # when the live plan's first boundary was reached
    idle_at: float = 0.0          # when the last run ended (idle since)
    redo_due: bool = False        # the boundary planned ahead is redone when reached
    busy_time: float = 0.0
    num_iterations: int = 0
    num_wakeups: int = 0          # timer firings: each ends a run at a boundary


@dataclass(slots=True, eq=False)
class Pulls:
    """Requests assigned to the instance that are not yet in the pool, and the count of all.

    - ``num_assigned``: requests offered and not yet ended; at least every one in a queue
      (pending, restoring, waiting, running) and, when faults are injected (``in_flight``
      tracked), exactly those plus the ones in flight.
    - ``pending``: (request, prefill source) in pull order; the source is None for a
      preempted request (its KV comes back here), exactly those in
      ``Preemptions.preempted_at``. Only the head is tried: the others wait behind it.
    - ``in_flight`` (faults only): request -> its source until its bytes land (None once
      they have: the sender is freed), through the after phase; ``num_failed``: failed
      attempts of a transfer being retried; ``attempt_at``: the start of its current retry.

    Changed by ``DecodeInstance.offer``, ``_pull``, ``_landed``, ``_finish``, by
    ``preemption.preempt`` (a preempted request goes first) and by ``faults``.
    """

    pending: deque = field(default_factory=deque)
    num_assigned: int = 0
    in_flight: dict = field(default_factory=dict)
    num_failed: dict = field(default_factory=dict)
    attempt_at: dict = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Preemptions:
    """On-demand blocks: what the pulls may take, and the preempted requests on their way
    back (``sim.engine.preemption``). With up-front reservations only ``slack`` is read
    (>= 0, never changed) and the rest stays empty.

    - ``slack``: blocks pulls may take without cutting the live run short; < 0: check.
    - ``preempted_at``: preempted request (in ``pending``) -> its boundary's instant; it is
      pulled again once that boundary is reached. ``resume``: request -> the context it
      resumes with, for every preempted or restoring request (and a restored one that
      waits to join: it leaves ``resume`` when it joins).
    - ``restoring``: (request, seconds) with their blocks back, whose KV restore (recompute
      or swap in) stalls the batch at the next boundary; ``stall``: swap-out seconds due
      there (0 between events).
    - ``due``: a boundary's run start, planned once its pulls are in; ``rejoin``: restores
      reserved at that boundary join it (both clear between events).
    - ``joined``: (request, restored?) that joined at ``Batch.boundary_at`` (its redo makes
      them leave and join again); ``preempted_step``: the last step that preempted (no
      joins in it).

    Changed by ``sim.engine.preemption`` and, at boundaries and pulls, by the batch loop.
    """

    slack: int = 0
    resume: dict = field(default_factory=dict)
    preempted_at: dict = field(default_factory=dict)
    restoring: list = field(default_factory=list)
    stall: float = 0.0
    due: float | None = None
    rejoin: bool = False
    joined: list = field(default_factory=list)
    preempted_step: int = -1
    recompute_seconds: dict = field(default_factory=dict)   # tokens -> restore_time memo
    num_preemptions: int = 0


def check_decode(d, ended: bool = False) -> None:
    """Assert the invariants above on decode instance ``d`` between events (O(requests
    held): for tests, at the end of a run or after every timer firing). ``ended``: the run
    went to its end, so ``d`` holds no request and no block."""
    batch, pulls, room, kv = d.batch, d.pulls, d.room, d.kv
    queued = (len(pulls.pending) + len(room.restoring) + len(batch.waiting)
              + len(batch.running))
    if ended:
        held = getattr(d.memory, "held", None)
        assert pulls.num_assigned == queued == len(pulls.in_flight) == 0, "requests left"
        assert not (d.memory.blocks if held is None else held), "blocks left"
        assert d.lost or not (room.resume or room.preempted_at or pulls.num_failed), "left"
        prefix = getattr(d, "prefix", None)
        assert prefix is None or not prefix.leaks(), f"prefix cache holds {prefix.leaks()}"
    if d.lost:
        assert queued == pulls.num_assigned == 0 and batch.plan is None, "lost, yet holds"
        return
    assert pulls.num_assigned >= queued, (pulls.num_assigned, queued)
    if d.faults is not None:
        assert pulls.num_assigned == queued + len(pulls.in_flight), "assigned, untracked"
    _check_batch(d, batch)
    preempted = {i for i, source in pulls.pending if source is None}
    assert preempted == set(room.preempted_at), "preempted, not pending"
    back = preempted | {i for i, _ in room.restoring}
    assert back <= set(room.resume) <= back | set(batch.waiting), "resume"
    assert room.due is None and not room.rejoin and room.stall == 0, "left planned"
    if kv is None:
        assert room.slack >= 0 and not room.joined and not back, "on-demand state"
    else:
        check_growing_kv(kv)
        assert set(kv.base) == {i for _, i in batch.running}, "kv holds others"
        assert batch.context_base == kv.sum_base, "context base"
        assert pulls.num_assigned - len(pulls.pending) <= d.max_batch_size, "slots"
    if hasattr(d.memory, "held") and hasattr(d.memory, "free_blocks"):
        check_block_pool(d.memory)


def _check_batch(d, batch: Batch) -> None:
    running, ledger, it = batch.running, d.ledger, batch.iteration
    assert running == sorted(running) and len(running) <= d.max_batch_size, "running"
    assert (batch.plan is None) == (not running), "a run is live exactly while requests run"
    assert d.timer.pending == (batch.plan is not None), "timer"
    if batch.plan is not None:
        assert d.timer.at == (batch.boundary_at if batch.redo_due else batch.end_at), "timer"
    base = {}
    for finish, i in running:
        base[i] = (d.kv.base[i] if d.kv is not None
                   else ledger.prompt[i] + 1 - ledger.join_iteration[i])
        assert finish == ledger.prompt[i] + ledger.output[i] - base[i] > it, (finish, i, it)
    assert batch.context_base == sum(base.values()), "context base"
    assert batch.factor == (d.host_slowdown if batch.host_jobs else 1.0), "factor"
    assert batch.host_jobs >= 0 and batch.busy_time >= 0, "counts"


def check_block_pool(pool) -> None:
    """``sim.engine.memory.BlockPool`` (and ``HawkPool``): the blocks held plus the free ones
    are the capacity, and the peak is at least what is held now (on-demand growth is
    ``GrowingKV``'s, taken from the free blocks without being counted there)."""
    held = sum(pool.held.values())
    assert held + pool.free_blocks == pool.capacity_blocks, (held, pool.free_blocks)
    assert 0 <= held <= pool.peak_blocks, (held, pool.peak_blocks)


def check_growing_kv(kv) -> None:
    """``sim.engine.memory.GrowingKV``: its sums and sorted residues are those of its bases,
    ``reserved`` is what the running requests hold, and the growth it remembers is exact."""
    b, base, held = kv.block_size, kv.base, kv.pool.held
    assert kv.sum_base == sum(base.values()), "sum_base"
    assert kv.sum_q == sum(x // b for x in base.values()), "sum_q"
    assert kv.residues == sorted(x % b for x in base.values()), "residues"
    assert kv.reserved == sum(held[i] for i in base), "reserved"
    if kv._step is not None:
        exact = sum(max(0, -(-(x + kv._step) // b) - held[i]) for i, x in base.items())
        assert kv._growth == exact, (kv._growth, exact)
