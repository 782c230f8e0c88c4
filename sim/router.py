"""The router: admits each request at its arrival instant and sends it to a prefill instance.

A request that no instance could ever serve ends at its arrival with a named status (its prompt
is longer than the prefill budget or the model's context, or its KV cache can never fit a send
buffer or a decode instance); the rest go to the instance the routing policy picks.

With several prefill instances the router is a process with one timer per arrival, since the
policy looks at the instances' loads at that instant. With one instance there is nothing to
decide, so arrivals are admitted lazily: a busy instance takes the requests that arrived
meanwhile when it next looks at its queue, and only an idle one needs a timer, at the next
arrival. Both ways give the same instants.
"""

from __future__ import annotations

from simpy.events import Timeout

from traces.schema import Status


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
        self._wake_pending = False
        if len(prefills) == 1 and not eager:
            prefills[0].source = self
            self.wake(prefills[0])
        else:
            env.process(self.run())

    def reject_reason(self, i: int) -> Status | None:
        ledger = self.ledger
        prompt = ledger.prompt[i]
        if prompt + ledger.output[i] > self.max_context or prompt > self.prefills[0].max_batch_tokens:
            return Status.REJECTED_PROMPT_TOO_LONG
        if not self.prefills[0].fits(prompt):
            return Status.REJECTED_PREFILL_CAPACITY
        if not self.decodes[0].fits(i):
            return Status.REJECTED_DECODE_CAPACITY
        return None

    def _admit(self, i: int, prefill) -> bool:
        """Admit request ``i`` at its arrival: queue it on ``prefill`` or end it rejected."""
        if self.progress is not None and i & 4095 == 4095:
            self.progress.update(4096)
        reason = self.reject_reason(i)
        if reason is not None:
            self.ledger.fail(i, reason, self.ledger.arrival_at[i])
            return False
        self.num_routed += 1
        prefill.enqueue(i)
        return True

    # -- one prefill instance: lazy admission ---------------------------------------------
    def admit_until(self, now: float, prefill) -> None:
        """Admit every request that has arrived by ``now`` to the single ``prefill``."""
        arrivals, n = self.ledger.arrival_at, self.ledger.n
        while self.next < n and arrivals[self.next] <= now:
            self._admit(self.next, prefill)
            self.next += 1

    def wake(self, prefill) -> None:
        """``prefill`` is idle with nothing queued: start it at the next arrival."""
        if self._wake_pending or self.next >= self.ledger.n:
            return
        self._wake_pending = True
        delay = self.ledger.arrival_at[self.next] - self.env.now
        timer = Timeout(self.env, delay if delay > 0.0 else 0.0)
        timer.callbacks.append(self._woken)

    def _woken(self, _timer) -> None:
        self._wake_pending = False
        self.prefills[0].kick()

    # -- several prefill instances: one timer per arrival ---------------------------------
    def run(self):
        env, ledger, prefills = self.env, self.ledger, self.prefills
        arrivals = ledger.arrival_at
        for i in range(ledger.n):
            delay = arrivals[i] - env.now
            if delay > 0:
                yield env.timeout(delay)
            self.next = i + 1
            k = self.route([p.load for p in prefills], self.num_routed)
            if self._admit(i, prefills[k]):
                prefills[k].kick()
