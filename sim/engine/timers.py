"""SimPy's event queue, touched here only: a timer that moves, a wake-up scheduled without a
new event, and the run loop.

A timer that moves: one pending wake-up per component, rescheduled in place.

A decode instance sleeps until its run's next finish and a link until its next completion;
both often learn, before that instant, that it has moved (a request joined, a transfer
started). Superseding the timer costs a new event now and a stale firing later; a timer that
ends later than planned would fire early and re-arm. ``MovableTimer.set`` instead moves the one
pending entry in SimPy's event queue: no new event, no stale firing, no re-arm.

Ordering: the moved entry takes a fresh event id, as a new timer created at that moment would,
so it sorts among events of the same instant exactly like one (records are unchanged).

A firing that has run leaves its event processed and referenced nowhere else, so the next
``set`` reuses it instead of making a new one (a cancelled firing's event stays in the queue
and is never reused).

The queue holds an entry or two per component (prefill and decode instances, links, the
router), so finding the entry and restoring the heap cost a few comparisons at C speed.
``schedule_after`` puts an event that has fired before back in the queue as a ``Timeout``
would schedule it (a prefill instance's one wake-up per batch); ``run_events`` is
``env.run`` with ``Environment.step`` inlined.

This relies on SimPy 4's event queue (``pyproject.toml`` pins ``simpy>=4.1,<5``):
``env._queue`` a heap of ``(time, priority, id, event)``, ``env._eid`` the id counter and
``env._now`` the clock; ``tests/test_timers.py`` checks that layout, and
``tests/test_structure.py`` that no other module of ``sim`` mentions ``_queue`` or ``_eid``.
Other modules read ``env._now`` (the clock, without ``env.now``'s property call: the engine's
hot paths do it per event); only ``run_events`` writes it.
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush, heapreplace
from typing import Callable

from simpy.core import Environment
from simpy.events import NORMAL, Event


def timeout_instant(now: float, at: float) -> float:
    """The instant a ``Timeout`` of ``at - now`` made at ``now`` fires at (``now`` if ``at``
    has passed): ``now + (at - now)``, which may round away from ``at``."""
    return now + (at - now) if at > now else now


class MovableTimer:
    """Calls ``callback()`` at the instant last given to ``set``; ``cancel`` makes the
    pending firing do nothing. At most one firing is pending at a time."""

    __slots__ = ("env", "callback", "_entry", "_at", "_spare", "_callbacks")

    def __init__(self, env: Environment, callback: Callable[[], None]):
        self.env, self.callback = env, callback
        self._entry: tuple | None = None        # the queue entry of the pending firing
        self._at = math.inf
        self._spare: Event | None = None        # the event of the firing that ran last
        self._callbacks = [self._fire]          # SimPy only reads an event's callback list

    @property
    def at(self) -> float:
        """The instant last given to ``set`` while a firing is pending (inf: none is)."""
        return self._at if self._entry is not None else math.inf

    @property
    def fires_at(self) -> float:
        """The clock's instant of the pending firing (``at`` as a ``Timeout`` would round it;
        inf: none is pending)."""
        return self._entry[0] if self._entry is not None else math.inf

    def first_until(self, at: float) -> bool:
        """Whether no event is due at or before the instant ``at`` (this timer's own firing
        may be pending later): a firing set for ``at`` now would be the run's next event."""
        queue = self.env._queue
        return not queue or at < queue[0][0]

    @property
    def pending(self) -> bool:
        return self._entry is not None

    def set(self, at: float, now: float | None = None) -> None:
        """Fire at ``at`` (now, if ``at`` has passed; timed as a ``Timeout`` of ``at - now``
        would be): move the pending firing there, or schedule one. A firing pending at ``at``
        already keeps its place. ``now``: the instant to time it from, if not the clock's (a
        component that ran ahead of the clock sets it as it would have then)."""
        old = self._entry
        env = self.env
        if now is None:
            now = env._now
        if old is None:                         # none pending (often: set from its firing)
            self._at = at
            event = self._spare
            if event is None:
                event = Event(env)
                event._ok, event._value = True, None
            else:
                self._spare = None
            event.callbacks = self._callbacks
            self._entry = entry = (timeout_instant(now, at), NORMAL, next(env._eid), event)
            heappush(env._queue, entry)
            return
        if at == self._at:
            return                              # pending there already
        self._at = at                           # pending: move it
        at = timeout_instant(now, at)
        entry = self._entry = (at, NORMAL, next(env._eid), old[3])
        queue = env._queue
        if queue[0] is old:                     # the next event (often): O(1) or O(log n)
            if at < old[0]:
                queue[0] = entry
            else:
                heapreplace(queue, entry)
        else:
            queue[queue.index(old)] = entry
            heapify(queue)

    def cancel(self) -> None:
        """The pending firing, if any, does nothing (it stays in the queue: the run's last
        instant is the same as with a timer that went stale)."""
        self._entry = None

    def _fire(self, event: Event) -> None:
        entry = self._entry
        if entry is None or entry[3] is not event:
            return                              # cancelled
        self._entry = None
        self._spare = event                     # processed: it may carry the next firing
        self.callback()


def schedule_after(env: Environment, delay: float, event: Event,
                   priority: int = NORMAL) -> None:
    """Schedule ``event`` (triggered, its callbacks set) ``delay`` seconds from now, as
    ``Timeout(env, delay)`` would be: the same instant, priority and place among ties, but
    no new event (the caller reuses one that has fired). ``priority`` URGENT puts it ahead of
    the instant's normal events (an arrival joining the step that ends then)."""
    heappush(env._queue, (env._now + delay, priority, next(env._eid), event))


def run_now_if_next(env: Environment, delay: float) -> bool:
    """Whether an event scheduled now ``delay`` seconds ahead (as ``schedule_after`` would
    schedule it, any priority) would be the queue's next one, strictly before every event
    in it; if so the clock moves to its instant, as ``run_events`` would move it to pop it,
    and the caller runs it at once instead of scheduling it. Events keep their order: the
    id it would have taken is skipped, and ids only break ties."""
    at = env._now + delay
    queue = env._queue
    if queue and queue[0][0] <= at:
        return False
    env._now = at
    return True


def run_events(env: Environment, until: float | None = None) -> None:
    """``env.run(until)``. A run to the end steps SimPy's event queue itself, with
    ``Environment.step`` inlined after the first event: the same events in the same order,
    and a failed event that nobody defused raises as ``step`` raises it, but one Python call
    fewer per event (of about three per request). The first event goes through ``step``,
    where ``hawk bench``'s start-up probe stops a run."""
    if until is not None:
        env.run(until=until)
        return
    queue = env._queue
    if queue:
        env.step()
    while queue:
        env._now, _, _, event = heappop(queue)
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc
