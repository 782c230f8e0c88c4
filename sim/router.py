"""The router: admits each request at its arrival instant and sends it to a prefill instance.

A request that no instance could ever serve ends at once with a named status (its prompt is
longer than the prefill budget or the model's context, or its KV cache can never fit a send
buffer or a decode instance); the rest go to the instance the routing policy picks.
"""

from __future__ import annotations

from traces.schema import Status


class Router:
    def __init__(self, env, ledger, prefills, decodes, route, max_context: int, progress=None):
        self.env, self.ledger = env, ledger
        self.progress = progress          # a tqdm bar advanced every 4096 arrivals, or None
        self.prefills, self.decodes = prefills, decodes
        self.route = route
        self.max_context = max_context
        self.num_routed = 0
        self.process = env.process(self.run())

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

    def run(self):
        env, ledger, prefills = self.env, self.ledger, self.prefills
        arrivals = ledger.arrival_at
        single = len(prefills) == 1
        for i in range(ledger.n):
            delay = arrivals[i] - env.now
            if delay > 0:
                yield env.timeout(delay)
            ledger.num_open += 1
            ledger.num_arrived += 1
            if self.progress is not None and i & 4095 == 4095:
                self.progress.update(4096)
            reason = self.reject_reason(i)
            if reason is not None:
                ledger.fail(i, reason, env.now)
                continue
            k = 0 if single else self.route([p.load for p in prefills], self.num_routed)
            self.num_routed += 1
            prefills[k].submit(i)
