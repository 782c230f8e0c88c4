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
"""

from __future__ import annotations

import numpy as np


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
