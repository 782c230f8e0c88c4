"""The KV link between prefill and decode instances (SimPy's ``Cable``, grown up).

Bandwidth is shared equally by concurrent transfers (processor sharing), tracked with a
virtual clock: ``served`` grows at ``bandwidth / n_active`` bytes per second, and a transfer
of ``b`` bytes entering at ``served = v`` completes when ``served`` reaches ``v + b``. Before
sharing, each transfer pays a fixed delay (latency + per-request cost) from its pricing.
Pricing is pluggable: ``price(nbytes) -> (fixed_delay_s, wire_bytes)``.

Topology: every node has its own NIC and PCIe root complex, and nodes meet at a switch. The
simulator gives each decode node one ``KVLink`` (its NIC: the transfers it pulls share it)
and each node one ``HostQueue`` (its host CPU and PCIe root: host-staged copies and host
re-layouts on that node queue there, first come first served). Limitation: a prefill node's
own NIC is not a shared resource; with one prefill node per decode node (the paper's setups)
the two NICs carry the same transfers, so the decode side's NIC is the one that binds.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable

import simpy

from sim.engine.timers import MovableTimer

INF = math.inf


class HostQueue:
    """One node's host CPU and PCIe root complex as a FIFO server of host-side work (staging
    copies, host re-layouts). FIFO with known service times needs no events: a job that
    arrives at ``now`` for ``seconds`` ends at ``max(now, free_at) + seconds``."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_time = 0.0
        self.num_jobs = 0

    def reserve(self, now: float, seconds: float) -> float:
        """Queue ``seconds`` of host work arriving at ``now``; returns when it ends."""
        if seconds < 0:
            raise ValueError(f"host work of {seconds} s must be >= 0")
        start = self.free_at if self.free_at > now else now
        self.free_at = start + seconds
        self.busy_time += seconds
        self.num_jobs += 1
        return self.free_at


class KVLink:
    """Transfers first wait out their fixed delay (``pending``), then share the bandwidth
    (``active``). Entries are folded into the virtual clock lazily, so one timer -- at the
    next completion -- is all the link schedules. A transfer that starts on an idle link
    (the usual case below saturation) is ``solo``: its completion is known at once, and it
    joins the shared clock only if another transfer starts before it is done."""

    def __init__(self, env: simpy.Environment, bandwidth_bytes_s: float, latency_s: float = 0.0):
        if not bandwidth_bytes_s > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bandwidth_bytes_s}")
        self.env = env
        self.bandwidth = bandwidth_bytes_s
        self.latency_s = latency_s
        self._served = 0.0          # virtual clock: bytes served to each active transfer
        self._served_at = 0.0       # simulated instant the clock was last brought up to date
        self._pending: list = []    # heap of (enter_at, seq, wire_bytes, callback, arg)
        self._active: list = []     # heap of (finish_served, seq, callback, arg)
        self._seq = 0
        self._solo = None           # (enter_at, seq, wire_bytes, callback, arg) or None
        self._timer = MovableTimer(env, self._on_timer)   # at the next completion
        self._timer_at = math.inf   # when it fires (inf: the link is idle)
        self.bytes_moved = 0.0
        self.busy_time = 0.0        # time with at least one transfer on the wire

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] with a transfer on the wire, for ``t`` = now (the end of a run,
        cut or not): ``busy_time`` settles lazily, at completions."""
        if self._active or self._pending:
            self._advance(t)                 # catch the shared clock up; changes no instant
        busy = self.busy_time
        if self._solo is not None:
            busy += max(0.0, min(t, self._timer_at) - self._solo[0])
        return busy

    @property
    def num_active(self) -> int:
        return len(self._active) + len(self._pending) + (self._solo is not None)

    def start(self, before_s: float, wire_bytes: float, on_done: Callable[[Any], None],
              arg, host: HostQueue | None = None, host_s: float = 0.0) -> None:
        """Begin a transfer: ``before_s`` of source-side work, then ``wire_bytes`` through the
        shared NIC; ``on_done(arg)`` runs when the last byte has landed. ``host_s`` of the
        ``before_s`` queue on the source node's ``host`` (FIFO) behind earlier host work."""
        now = self.env._now
        if host is not None and host_s > 0:
            before_s = host.reserve(now, host_s) - now + (before_s - host_s)
        self._seq += 1
        wire = float(wire_bytes)
        self.bytes_moved += wire
        enter_at = now + before_s + self.latency_s
        if self._timer_at == INF:             # idle link: this transfer has it to itself
            self._solo = (enter_at, self._seq, wire, on_done, arg)
            self._timer_at = at = enter_at + wire / self.bandwidth
            self._timer.set(at)
            return
        if self._solo is not None:            # share from here on
            heapq.heappush(self._pending, self._solo)
            self._solo = None
        heapq.heappush(self._pending, (enter_at, self._seq, wire, on_done, arg))
        self._advance(now)
        self._schedule(now)

    def _advance(self, until: float) -> None:
        """Bring the virtual clock to ``until``, letting pending transfers enter on the way."""
        pending, active = self._pending, self._active
        while pending and pending[0][0] <= until:
            enter_at, seq, wire, on_done, arg = heapq.heappop(pending)
            self._run_clock(enter_at)
            heapq.heappush(active, (self._served + wire, seq, on_done, arg))
        self._run_clock(until)

    def _run_clock(self, t: float) -> None:
        elapsed = t - self._served_at
        if elapsed > 0:
            if self._active:
                self._served += elapsed * self.bandwidth / len(self._active)
                self.busy_time += elapsed
            self._served_at = t

    def _next_completion(self) -> float:
        """Instant of the next completion, accounting for the pending entries before it."""
        t, served, n = self._served_at, self._served, len(self._active)
        head = self._active[0][0] if n else math.inf
        pending = self._pending
        if len(pending) > 1:
            pending = sorted(pending)
        bw = self.bandwidth
        for enter_at, _, wire, _, _ in pending:
            if n and t + (head - served) * n / bw <= enter_at:
                break
            if n:
                served += (enter_at - t) * bw / n
            t, n = enter_at, n + 1
            if served + wire < head:
                head = served + wire
        if not n:
            return math.inf
        return t + (head - served) * n / bw if head > served else t

    def _schedule(self, now: float) -> None:
        at = self._next_completion()
        if at == math.inf:
            self._timer_at = at     # idle
            self._timer.cancel()
            return
        if at == self._timer_at:
            return                  # the timer already fires then
        self._timer_at = at
        self._timer.set(at)         # moved there (sim.engine.timers), or set when none is pending

    def _on_timer(self) -> None:
        solo = self._solo
        if solo is not None:
            self._solo = None
            self._timer_at = INF
            self.busy_time += solo[2] / self.bandwidth
            solo[3](solo[4])                  # on_done(arg)
            return
        now = self.env._now
        self._timer_at = math.inf
        self._advance(now)
        # The timer was set for the head's completion, so the head is done whatever rounding
        # says (large clocks times large bandwidths lose bytes to rounding); others finishing
        # at the same instant go with it.
        active = self._active
        if active[0][0] > self._served:
            self._served = active[0][0]
        done = []
        limit = self._served + 1e-9 * (self._served if self._served > 1.0 else 1.0)
        while active and active[0][0] <= limit:
            _, _, on_done, arg = heapq.heappop(active)
            done.append((on_done, arg))
        self._schedule(now)
        for on_done, arg in done:
            on_done(arg)
