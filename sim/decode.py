"""A decode instance: pulls KV caches, then continuous batching with fast-forward.

Flow of one request (Algorithm 1 of the paper, decode side):
1. ``offer``: prefill is done; the request waits in ``pending`` until this instance has the KV
   blocks for its prompt + output tokens (reserved whole on pull: no preemption).
2. Pull: the blocks are reserved and the link moves the KV cache; on landing the first token
   reaches the client, the prefill side frees its send buffer, and the request waits to join.
3. At the next iteration boundary it joins the batch; after ``n - 1`` iterations it finishes
   and its blocks are released, which may let the next pending request be pulled.

Fast-forward (DESIGN.md): between batch changes the batch is fixed, so the instance schedules
one timer for the ``k`` iterations until the next finish, timed in closed form by the predictor
(``decode_time``). A request landing mid-run moves the timer to the next iteration boundary
(``decode_steps_within``), where it joins. With ``fast_forward=False`` every iteration is its
own timer: the oracle the fast path is tested against. Timers are superseded by bumping a
generation counter; a stale timer does nothing when it fires.
"""

from __future__ import annotations

import heapq
from collections import deque

import simpy

from policies.batching import blocks_for, fcfs_decode_admit


class DecodeInstance:
    def __init__(self, env: simpy.Environment, index: int, ledger, predictor, link, *,
                 max_batch_size: int, capacity_blocks: int, block_size: int,
                 kv_bytes_per_token: float, fast_forward: bool = True):
        self.env, self.index, self.ledger = env, index, ledger
        self.predictor, self.link = predictor, link
        self.max_batch_size = max_batch_size
        self.capacity_blocks = capacity_blocks
        self.free_blocks = capacity_blocks
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fast_forward = fast_forward
        self.pending: deque = deque()     # (request, prefill instance) awaiting KV blocks
        self.waiting: deque[int] = deque()  # KV landed, waiting for a batch slot
        self.running: list = []           # heap of (finish_iteration, request)
        self.num_assigned = 0             # requests offered and not yet finished
        self.iteration = 0                # iterations completed since the start of the run
        self._context_base = 0            # total context = base + len(running) * iteration
        self._sources: dict[int, object] = {}
        self._plan: tuple | None = None   # (start_at, batch, context, steps) of the live timer
        self._generation = 0
        self._join_scheduled = False
        self.busy_time = 0.0
        self.num_iterations = 0

    # -- admission and transfer ---------------------------------------------------------
    def blocks_needed(self, i: int) -> int:
        return blocks_for(self.ledger.prompt[i] + self.ledger.output[i], self.block_size)

    def fits(self, i: int) -> bool:
        return self.blocks_needed(i) <= self.capacity_blocks

    def offer(self, i: int, source) -> None:
        """Prefill of ``i`` is done on ``source``; pull its KV cache when blocks allow."""
        self.num_assigned += 1
        self.ledger.decode_instance[i] = self.index
        self.pending.append((i, source))
        self._pull()

    def _pull(self) -> None:
        ledger, now = self.ledger, self.env.now
        while self.pending and self.blocks_needed(self.pending[0][0]) <= self.free_blocks:
            i, source = self.pending.popleft()
            self.free_blocks -= self.blocks_needed(i)
            self._sources[i] = source
            nbytes = int(ledger.prompt[i] * self.kv_bytes_per_token)
            ledger.kv_bytes[i] = nbytes
            ledger.transfer_start_at[i] = now
            self.link.start(nbytes, self._landed, i)

    def _landed(self, i: int) -> None:
        ledger, now = self.ledger, self.env.now
        ledger.transfer_end_at[i] = now
        ledger.first_token_at[i] = now
        self._sources.pop(i).release(i)
        if ledger.output[i] == 1:
            self._finish(i, now)
            self._pull()
            return
        self.waiting.append(i)
        if self._plan is None:
            self._boundary(0)
        elif (self.fast_forward and not self._join_scheduled
              and len(self.running) < self.max_batch_size):
            self._schedule_join(now)

    def _finish(self, i: int, now: float) -> None:
        self.ledger.finish(i, now)
        self.free_blocks += self.blocks_needed(i)
        self.num_assigned -= 1

    # -- the batch loop -----------------------------------------------------------------
    def _schedule_join(self, now: float) -> None:
        """A request landed mid-run: stop the run at the next iteration boundary."""
        start, batch, context, steps = self._plan
        done = self.predictor.decode_steps_within(batch, context, steps, now - start)
        if done < steps and start + self.predictor.decode_time(batch, context, done) >= now:
            self._retime(done, now)                    # a boundary falls exactly now
        elif done + 1 < steps:
            at = start + self.predictor.decode_time(batch, context, done + 1)
            self._retime(done + 1, at)
        self._join_scheduled = True

    def _retime(self, steps: int, at: float) -> None:
        self._generation += 1
        generation = self._generation
        timer = self.env.timeout(max(0.0, at - self.env.now))
        timer.callbacks.append(lambda _ev: self._on_timer(generation, steps))

    def _on_timer(self, generation: int, steps: int) -> None:
        if generation == self._generation:
            self._boundary(steps)

    def _boundary(self, steps: int) -> None:
        """``steps`` iterations of the live plan have completed: finish, admit, replan."""
        now, ledger, running = self.env.now, self.ledger, self.running
        if self._plan is not None:
            self.busy_time += now - self._plan[0]
            self.num_iterations += steps
        self.iteration += steps
        it = self.iteration
        freed = False
        while running and running[0][0] == it:
            _, i = heapq.heappop(running)
            self._context_base -= ledger.prompt[i] + 1 - ledger.join_iteration[i]
            self._finish(i, now)
            freed = True
        for _ in range(fcfs_decode_admit(len(self.waiting), len(running), self.max_batch_size)):
            i = self.waiting.popleft()
            ledger.join_iteration[i] = it
            self._context_base += ledger.prompt[i] + 1 - it
            heapq.heappush(running, (it + ledger.output[i] - 1, i))
        self._join_scheduled = False
        if running:
            batch = len(running)
            steps = 1 if not self.fast_forward else running[0][0] - it
            context = self._context_base + batch * it
            self._plan = (now, batch, context, steps)
            self._retime(steps, now + self.predictor.decode_time(batch, context, steps))
        else:
            self._plan = None
            self._generation += 1
        if freed:
            self._pull()

    @property
    def load(self) -> int:
        return self.num_assigned
