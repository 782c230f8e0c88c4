"""The waiting queue of an aggregated instance (``sim.engine.aggregated``): new requests in
arrival order, or in a fairness policy's order (``policies.fairness``: its ``tag`` on entry,
``served`` when a request leaves the queue to run); preempted requests go to the front, the
latest preempted first, as vLLM V1 prepends them."""

from __future__ import annotations

import bisect
from collections import deque


class WaitingQueue:
    __slots__ = ("fairness", "items", "_keys", "_count", "_tenant")

    def __init__(self, fairness=None, tenant=None):
        self.fairness = fairness              # None: arrival order (a deque, no keys)
        self.items: deque[int] | list[int] = deque() if fairness is None else []
        self._keys: list = []                 # fairness keys of ``items`` (sorted)
        self._count = 0
        self._tenant = tenant                 # request -> tenant (an array), or None

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self):
        return iter(self.items)

    def head(self) -> int:
        return self.items[0]

    def add(self, i: int, num_tokens: int) -> None:
        """A new request of ``num_tokens`` prompt tokens."""
        if self.fairness is None:
            self.items.append(i)
            return
        tenant = self._tenant[i] if self._tenant is not None else ""
        key = (self.fairness.tag(tenant, num_tokens), self._count)
        self._count += 1
        k = bisect.bisect(self._keys, key)
        self._keys.insert(k, key)
        self.items.insert(k, i)

    def add_first(self, i: int) -> None:
        """A preempted request: ahead of every other."""
        if self.fairness is None:
            self.items.appendleft(i)
            return
        self._count += 1
        self._keys.insert(0, ((-1, -self._count), -self._count))
        self.items.insert(0, i)

    def pop(self) -> int:
        """The head leaves to run."""
        if self.fairness is None:
            return self.items.popleft()
        key = self._keys.pop(0)[0]
        if key[0] >= 0:                       # a new request, not a preempted one
            self.fairness.served(key)
        return self.items.pop(0)

    def clear(self) -> None:
        self.items.clear()
        self._keys.clear()
