"""The KV link between prefill and decode instances (SimPy's ``Cable``, grown up).

Bandwidth is shared equally by concurrent transfers (processor sharing), tracked with a
virtual clock: ``served`` grows at ``bandwidth / n_active`` bytes per second, and a transfer
of ``b`` bytes entering at ``served = v`` completes when ``served`` reaches ``v + b``. Before
sharing, each transfer pays a fixed delay (latency + per-request cost) from its pricing.
Pricing is pluggable: ``price(nbytes) -> (fixed_delay_s, wire_bytes)``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import simpy


@dataclass(frozen=True)
class DirectRdma:
    """One-sided RDMA writes straight between device memories: fixed cost + bytes on the wire."""

    latency_s: float
    per_request_s: float

    def price(self, nbytes: int) -> tuple[float, float]:
        return self.latency_s + self.per_request_s, float(nbytes)


class KVLink:
    def __init__(self, env: simpy.Environment, bandwidth_bytes_s: float, pricing):
        if not bandwidth_bytes_s > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth_bytes_s}")
        self.env = env
        self.bandwidth = bandwidth_bytes_s
        self.pricing = pricing
        self._served = 0.0          # virtual clock: bytes served to each active transfer
        self._served_at = 0.0       # simulated instant of the last update
        self._active: list = []     # heap of (finish_served, seq, callback, arg)
        self._seq = 0
        self._generation = 0
        self.bytes_moved = 0.0
        self.busy_time = 0.0        # time with at least one transfer on the wire

    @property
    def num_active(self) -> int:
        return len(self._active)

    def start(self, nbytes: int, on_done: Callable[[int], None], arg: int) -> None:
        """Begin a transfer of ``nbytes``; ``on_done(arg)`` runs when it has landed."""
        fixed, wire = self.pricing.price(nbytes)
        if fixed > 0:
            ev = self.env.timeout(fixed)
            ev.callbacks.append(lambda _ev: self._enter(wire, on_done, arg))
        else:
            self._enter(wire, on_done, arg)

    def _advance(self) -> None:
        now = self.env.now
        if self._active:
            self._served += (now - self._served_at) * self.bandwidth / len(self._active)
            self.busy_time += now - self._served_at
        self._served_at = now

    def _enter(self, wire: float, on_done, arg) -> None:
        self._advance()
        self._seq += 1
        heapq.heappush(self._active, (self._served + wire, self._seq, on_done, arg))
        self.bytes_moved += wire
        self._reschedule()

    def _reschedule(self) -> None:
        self._generation += 1
        if not self._active:
            return
        remaining = self._active[0][0] - self._served
        delay = max(0.0, remaining * len(self._active) / self.bandwidth)
        ev = self.env.timeout(delay)
        generation = self._generation
        ev.callbacks.append(lambda _ev: self._on_timer(generation))

    def _on_timer(self, generation: int) -> None:
        if generation != self._generation:
            return                  # superseded by a later arrival
        self._advance()
        # The timer was set for the head's completion, so the head is done whatever rounding
        # says (large clocks times large bandwidths lose bytes to rounding); others finishing
        # at the same instant go with it.
        self._served = max(self._served, self._active[0][0])
        done = []
        tolerance = 1e-9 * max(1.0, self._served)
        while self._active and self._active[0][0] <= self._served + tolerance:
            finish, _, on_done, arg = heapq.heappop(self._active)
            self._served = max(self._served, finish)
            done.append((on_done, arg))
        self._reschedule()
        for on_done, arg in done:
            on_done(arg)
