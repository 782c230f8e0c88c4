"""Tenant fairness: the order in which queued requests of several customers are served.

A policy is a one-method class: ``tag(tenant, num_tokens) -> key`` is called once per request
as it joins a queue, and the queue serves requests in increasing key order (ties in arrival
order). It holds the only state (per-tenant tags), so a run builds one per queue.

- ``Fcfs``: arrival order whatever the tenant (the default; a burst from one customer queues
  ahead of everyone who arrives after it).
- ``WeightedFair``: per-tenant queues with weighted fair sharing, by start-time fair queueing
  (Goyal, Vin and Cheng, SIGCOMM 1996): a request's start tag is
  ``S = max(V, F_prev(tenant))`` and its finish tag ``F = S + num_tokens / weight(tenant)``,
  where ``V`` is the start tag of the request most recently served. Backlogged tenants share
  prefill tokens in proportion to their weights, so a bursting customer only delays its own
  requests; a tenant that was idle restarts at ``V`` and banks no credit. Tenants named in
  ``priority`` form a class served ahead of all others (fair sharing inside each class).
  Tenants not named in ``weights`` weigh 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class Fcfs:
    """Arrival order: every key is the same, so ties (arrival order) decide."""

    def tag(self, tenant: str, num_tokens: int) -> tuple:
        return (0, 0.0)

    def served(self, key: tuple) -> None:
        pass


@dataclass
class WeightedFair:
    weights: dict[str, float] = field(default_factory=dict)
    priority: tuple[str, ...] = ()
    _clock: float = 0.0                        # V: start tag of the latest request served
    _finish: dict = field(default_factory=dict)  # tenant -> finish tag of its latest request

    def __post_init__(self) -> None:
        for tenant, w in self.weights.items():
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
                raise ValueError(f"tenant weight {tenant!r} must be a number > 0, got {w!r}")

    def tag(self, tenant: str, num_tokens: int) -> tuple:
        """Queue key of a request of ``tenant`` with ``num_tokens`` prompt tokens."""
        start = max(self._clock, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + num_tokens / self.weights.get(tenant, 1.0)
        return (0 if tenant in self.priority else 1, start)

    def served(self, key: tuple) -> None:
        """A request with ``key`` was taken into a batch: advance the virtual clock."""
        if key[1] > self._clock:
            self._clock = key[1]


def fcfs(weights=None, priority=()) -> Fcfs:
    return Fcfs()


def weighted_fair(weights=None, priority=()) -> WeightedFair:
    return WeightedFair(dict(weights or {}), tuple(priority))


#: name -> factory(weights, priority) -> policy with ``tag`` and ``served``
FAIRNESS = {"fcfs": fcfs, "weighted_fair": weighted_fair}
