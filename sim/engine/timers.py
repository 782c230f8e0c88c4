"""A timer that moves: one pending wake-up per component, rescheduled in place.

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
This relies on SimPy 4's event queue: ``env._queue`` a heap of ``(time, priority, id,
event)``, ``env._eid`` the id counter; ``tests/test_timers.py`` checks that layout.
"""

from __future__ import annotations

import math
from heapq import heapify, heappush, heapreplace
from typing import Callable

from simpy.core import Environment
from simpy.events import NORMAL, Event


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
    def pending(self) -> bool:
        return self._entry is not None

    def set(self, at: float) -> None:
        """Fire at ``at`` (now, if ``at`` has passed; timed as a ``Timeout`` of ``at - now``
        would be): move the pending firing there, or schedule one. A firing pending at ``at``
        already keeps its place."""
        old = self._entry
        env = self.env
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
            self._entry = entry = (now + (at - now) if at > now else now, NORMAL,
                                   next(env._eid), event)
            heappush(env._queue, entry)
            return
        if at == self._at:
            return                              # pending there already
        self._at = at                           # pending: move it
        at = now + (at - now) if at > now else now
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
