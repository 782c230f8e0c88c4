"""The router: admits each request at its arrival instant and sends it to a prefill instance.

A request that no instance could ever serve ends at its arrival with a named status (its prompt
is longer than the prefill budget or the model's context, or its KV cache can never fit a send
buffer or a decode instance); the rest go to the instance the routing policy picks.

With several prefill instances the router is a process with one timer per arrival, since the
policy looks at the instances' loads at that instant. With one instance there is nothing to
decide, so arrivals are admitted lazily: a busy instance takes the requests that arrived
meanwhile when it next looks at its queue, and an idle one takes the next arrival ahead of time
and starts its batch at that arrival, so arrivals need no timers at all. Both ways give the
same instants (tested).

Aggregated pools (``sim.engine.aggregated``) have their own two: ``LazyArrivals`` for a lone
aggregated instance, ``PoolRouter`` for several, or for an aggregated pool beside a P/D pool.
"""

from __future__ import annotations

import math

import numpy as np
from simpy.events import URGENT, Event

from policies.routing import round_robin
from sim.engine.timers import run_now_if_next, schedule_after


class Router:
    def __init__(self, env, ledger, prefills, decodes, route, max_context: int, progress=None,
                 eager: bool = False):
        self.env, self.ledger = env, ledger
        self.progress = progress          # a tqdm bar advanced every 4096 arrivals, or None
        self.prefills, self.decodes = prefills, decodes
        self.route = route
        self.max_context = max_context
        self.num_routed = 0
        self.next = 0                     # the first request not yet admitted
        self.reasons = self.reject_reasons()
        if len(prefills) == 1 and not eager:
            prefills[0].source = self
            prefills[0].kick()
        else:
            env.process(self.run())

    def reject_reasons(self):
        """Per request, why no instance could ever serve it (None: it can be served), as the
        ledger judges by ``reject_codes``: the whole trace at once, or chunk by chunk as the
        requests stream in (``sim.engine.stream``)."""
        return self.ledger.judge(self.reject_codes)

    def reject_codes(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        """Rejection codes (``sim.engine.ledger.REJECTIONS``) of requests of these lengths. The
        checks depend only on lengths and fixed capacities; instances of a role are alike."""
        too_long = prompt + output > self.max_context
        if not self.prefills[0].traits.splits_prompts:
            too_long |= prompt > self.prefills[0].max_batch_tokens  # one iteration per prompt
        no_prefill = ~self.prefills[0].fits_many(prompt)
        no_decode = ~self.decodes[0].fits_many(prompt, output)
        return np.select([too_long, no_prefill, no_decode], [1, 2, 3], 0)

    def _admit(self, i: int, prefill) -> bool:
        """Admit request ``i`` at its arrival: queue it on ``prefill`` or end it rejected."""
        if self.progress is not None and i & 4095 == 4095:
            self.progress.update(4096)
        reason = self.reasons[i]
        if reason is not None:
            self.ledger.fail(i, reason, self.ledger.arrival_at[i])
            return False
        self.num_routed += 1
        prefill.enqueue(i)
        return True

    # -- one prefill instance: lazy admission ---------------------------------------------
    def admit_until(self, now: float, prefill) -> None:
        """Admit every request that has arrived by ``now`` to the single ``prefill``. If none
        is queued there then, admit the requests of the next arrival instant ahead of time:
        nothing can reach the instance before them, so its batch starts at their arrival
        (``PrefillInstance``) with no timer to wake it."""
        i, n = self.next, self.ledger.n
        if i == n:
            return
        arrivals, queue = self.ledger.arrival_at, prefill.queue
        if arrivals[i] > now:
            if queue:
                return
            now = arrivals[i]                      # idle: the next arrival instant
        reasons, enqueue = self.reasons, prefill.enqueue
        while True:                                # request i has arrived by now
            while True:
                if reasons[i] is None and i & 4095 != 4095:   # _admit's common case
                    self.num_routed += 1
                    enqueue(i)
                else:
                    self._admit(i, prefill)
                i += 1
                if i == n or arrivals[i] > now:
                    break
            if queue or i == n:
                break
            now = arrivals[i]                      # all rejected, still idle: the next one
        self.next = i

    # -- several prefill instances: one timer per arrival ---------------------------------
    def run(self):
        env, ledger, prefills = self.env, self.ledger, self.prefills
        arrivals = ledger.arrival_at
        for i in range(ledger.n):
            delay = arrivals[i] - env.now
            if delay > 0:
                yield env.timeout(delay)
            self.next = i + 1
            k = self.route([p.load for p in prefills], [p.free_blocks for p in prefills],
                           self.num_routed)
            if self._admit(i, prefills[k]):
                prefills[k].kick()


# -- aggregated pools (``[cluster] kind = "aggregated" | "both"``) ------------------------
def aggregated_rejects(instance, prompt: np.ndarray, output: np.ndarray,
                       max_context: int) -> np.ndarray:
    """``sim.engine.ledger.REJECTIONS`` codes for an aggregated instance: 1 a request longer
    than the model's context, 3 one whose KV cache can never fit the instance's blocks."""
    total = np.asarray(prompt, dtype=np.int64) + np.asarray(output, dtype=np.int64)
    no_room = -(-total // instance.block_size) > instance.num_blocks
    return np.select([total > max_context, no_room], [1, 3], 0)


class LazyArrivals:
    """Arrivals for a lone aggregated instance (``sim.engine.aggregated``): there is nothing
    to decide, so the instance admits the requests that have arrived whenever it schedules a
    step, and sleeps until the next arrival when it has nothing to do: no timer per arrival."""

    def __init__(self, ledger, instance, max_context: int):
        self.ledger, self.instance = ledger, instance
        self.next = 0
        self.reasons = ledger.judge(lambda p, o: aggregated_rejects(instance, p, o, max_context))
        instance.source = instance.horizon = self
        instance.ahead = instance.fast_forward    # it knows every arrival: commit ahead
        instance.env.timeout(0).callbacks.append(lambda _ev: instance.kick())

    def admit_until(self, now: float) -> float:
        """Admit every request that has arrived by ``now``; returns ``next_arrival_at()``."""
        i, n, ledger = self.next, self.ledger.n, self.ledger
        arrivals, reasons, enqueue = ledger.arrival_at, self.reasons, self.instance.enqueue
        while i < n:
            at = arrivals[i]
            if at > now:
                self.next = i
                return at
            if reasons[i] is None:
                enqueue(i)
            else:
                ledger.fail(i, reasons[i], at)
            i += 1
        self.next = i
        return math.inf

    def next_arrival_at(self) -> float:
        return self.ledger.arrival_at[self.next] if self.next < self.ledger.n else math.inf


class PoolRouter:
    """Routes every arrival, at its instant, to an aggregated instance or (``kind = "both"``)
    first to a pool, by ``pool_route`` over ``[aggregated pool, P/D pool]`` loads (requests
    in flight per device: ``policies.routing.POOL_ROUTING``), then to an instance of that
    pool by ``route``. A request one pool can never serve goes to the other; one that
    neither can ends at its arrival with the P/D pool's reason (else the aggregated one's).

    Arrivals are events of urgent priority: at any instant they are routed before the
    instances' step boundaries of that instant, so a request arriving at a boundary joins
    the step that starts there, with or without fast-forward."""

    def __init__(self, env, ledger, aggregated: list, route, max_context: int, *,
                 prefills=(), decodes=(), pool_route=None, devices=(1, 1)):
        self.env, self.ledger = env, ledger
        self.aggregated, self.prefills, self.decodes = aggregated, list(prefills), list(decodes)
        self.route, self.pool_route, self.max_context = route, pool_route, max_context
        self.devices = devices                    # (aggregated pool, P/D pool) devices
        self.num_routed = [0, 0, 0]               # to aggregated, to P/D, pools chosen
        self.next = 0
        self.reasons = ledger.judge(self.reject_codes)
        self._event = Event(env)
        self._event._ok, self._event._value = True, None
        self._callbacks = [self._arrive]          # SimPy only reads an event's callback list
        for a in aggregated:                      # no one looks at them between arrivals
            a.horizon, a.ahead = self, a.fast_forward
            a.on_lost = self._lost
        self._live = aggregated                   # the instances not lost (all, if none is)
        self._blind = route is round_robin        # it reads neither loads nor free blocks
        self._arm()

    def _lost(self) -> None:
        """An aggregated instance was lost: later arrivals go to the others, if any."""
        self._live = [a for a in self.aggregated if not a.lost] or self.aggregated

    def next_arrival_at(self) -> float:
        """The instant of the next arrival not yet routed (inf: none is left)."""
        return self.ledger.arrival_at[self.next] if self.next < self.ledger.n else math.inf

    def reject_codes(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        agg = aggregated_rejects(self.aggregated[0], prompt, output, self.max_context)
        if not self.prefills:
            return agg
        pd = Router.reject_codes(self, prompt, output)   # its checks on our prefills/decodes
        return np.where((agg == 0) | (pd == 0), 0, np.where(pd != 0, pd, agg))

    def _arm(self) -> None:
        ledger, i = self.ledger, self.next
        if i == ledger.n:
            return
        now, at = self.env._now, ledger.arrival_at[i]
        self._event.callbacks = self._callbacks
        schedule_after(self.env, at - now if at > now else 0.0, self._event, URGENT)

    def _arrive(self, _event) -> None:
        """Route the arrival that is due, and each next one that comes before any other
        event at once (``run_now_if_next``), with no event of its own; then arm the next."""
        env, n, arrivals = self.env, self.ledger.n, self.ledger.arrival_at
        while True:
            i = self.next
            self.next = i + 1
            self._route(i)
            if i + 1 == n:
                return
            now, at = env._now, arrivals[i + 1]
            if not run_now_if_next(env, at - now if at > now else 0.0):
                break
        self._arm()

    def _route(self, i: int) -> None:
        reason = self.reasons[i]
        if reason is not None:
            self.ledger.fail(i, reason, self.ledger.arrival_at[i])
        elif not self.prefills or self._to_aggregated(i):
            live, routed = self._live, self.num_routed
            if self._blind:                       # round_robin's choice, without its inputs
                a = live[routed[0] % len(live)]
            else:
                a = live[self.route([a.load for a in live], [a.free_blocks for a in live],
                                    routed[0])]
            routed[0] += 1
            a.enqueue(i)
            a.kick()
        else:
            prefills = self.prefills
            k = self.route([p.load for p in prefills], [p.free_blocks for p in prefills],
                           self.num_routed[1])
            self.num_routed[1] += 1
            prefills[k].enqueue(i)
            prefills[k].kick()

    def _to_aggregated(self, i: int) -> bool:
        if not self.prefills:
            return True
        one = (np.array([self.ledger.prompt[i]]), np.array([self.ledger.output[i]]))
        agg_ok = aggregated_rejects(self.aggregated[0], *one, self.max_context)[0] == 0
        pd_ok = Router.reject_codes(self, *one)[0] == 0
        if agg_ok != pd_ok:                       # (one of them fits: it was not rejected)
            return agg_ok
        in_agg = sum([a.load for a in self.aggregated])
        in_pd = sum([len(p.queue) for p in self.prefills]) + sum(
            [d.load for d in self.decodes])
        loads = [in_agg / self.devices[0], in_pd / self.devices[1]]
        pool = self.pool_route(loads, [0, 0], self.num_routed[2])
        self.num_routed[2] += 1
        return pool == 0
