"""Slots for connections that have not shown the run token yet, which no stranger can exhaust.

A control port (the router's, a prefill worker's KV server) admits every new connection into a
small pool of pre-authentication slots. When the pool is full, the connection that has waited
longest without authenticating is hung up on to make room: a peer that opens many idle
connections only ever evicts its own, and a legitimate worker, which sends its hello as soon
as it connects, is never refused for lack of a slot. A connection that authenticates leaves
the pool (its own cap, if any, is the server's business); one that stays in it longer than the
server's pre-authentication deadline is closed by the server.

Thread-safe, so both the router (asyncio) and the prefill server (a thread per connection)
use it::

    slots = PreAuthSlots(8)
    evicted = slots.admit(key, hang_up)   # call what it returns (another's hang_up) or None
    slots.authenticated(key)              # or slots.gone(key) when the connection ends
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

#: pre-authentication slots of one control port, and the seconds a connection may hold one
PREAUTH_SLOTS = 16
PREAUTH_S = 5.0


class PreAuthSlots:
    """At most ``num_slots`` unauthenticated connections; the oldest makes way for a new one."""

    def __init__(self, num_slots: int = PREAUTH_SLOTS):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"pre-auth slots {num_slots!r}: need a whole number >= 1")
        self.num_slots = num_slots
        self._waiting: OrderedDict[object, Callable[[], None]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_evicted = 0

    def admit(self, key, hang_up: Callable[[], None]) -> Callable[[], None] | None:
        """Take a slot for ``key``; returns the ``hang_up`` of the connection evicted to make
        room (the caller calls it, outside any lock of its own), or None."""
        with self._lock:
            evicted = None
            if len(self._waiting) >= self.num_slots:
                _, evicted = self._waiting.popitem(last=False)
                self.num_evicted += 1
            self._waiting[key] = hang_up
            return evicted

    def authenticated(self, key) -> bool:
        """``key`` showed the token: it leaves the pool. False if it was evicted meanwhile."""
        with self._lock:
            return self._waiting.pop(key, None) is not None

    def gone(self, key) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
