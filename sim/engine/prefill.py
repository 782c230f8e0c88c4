"""A prefill instance: FCFS queue, vLLM-like batches, a finite KV send buffer.

Each batch takes the longest FCFS head that fits the token budget, the batch size and the
free blocks of the send buffer (``policies.batching``), waits the batch's predicted time (one
wake-up event, re-armed for every batch), then hands every request to the decode side. The
instance is driven by callbacks: an arrival or a buffer release starts the next batch when it
is idle. A batch of requests admitted ahead of their arrival (``Router.admit_until``) starts at
the last one's arrival. A request's KV cache stays in the send buffer until the decode side has
pulled it (``release``), so a slow decode side backs up into prefill.

Other policies (``policies.batching.PREFILL_BATCHING``: shortest-prompt-first, chunked prefill
(the default); ``policies.fairness``: per-tenant weighted fair queues) take the general path:
the batching policy picks (request, tokens) pairs from the queue, and a request leaves the queue
once all its prompt tokens are computed (``done``). Without a fairness policy the queue is a
deque in arrival order (a chunked batch's finished requests lead it); with one, a list kept in
the policy's order. The policy's declared traits (``policies.batching.BatchingTraits``) choose
the fast paths, in arrival order only: whole prompts in order (FCFS) keep the head-of-queue
fast path (``_take_fcfs``); prompts split in order (chunked prefill) take a lone queued
request directly (``_take_chunked``). A policy that declares neither takes the general path.

Prefix caching (``prefix``, a ``sim.engine.prefix_cache.PrefixCache``, or None) takes the
general path too: a request's first pick admits it to the cache, and the tokens it hits are
not computed: a batch is priced as prompt chunks of the tokens past the hit, attending to the
cached tokens (``mixed_step_time``). The batching policy still counts a hit's
tokens against the token budget and the send buffer still holds all of a request's blocks
(the cache's docstring says why). The decode side pulls the whole KV cache, unless it keeps a
prefix cache of its own (``sim.engine.decode``).
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np
import simpy
from simpy.events import Event

from policies.batching import blocks_for, fcfs_prefill_batch, fcfs_token_budget, traits_of
from sim.engine.link import HostQueue
from sim.engine.timers import schedule_after


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, ledger, predictor, *,
                 max_batch_size: int, max_batch_tokens: int, buffer_blocks: int,
                 block_size: int, on_prefilled, pick=None, fairness=None, prefix=None):
        self.env, self.index, self.ledger, self.predictor = env, index, ledger, predictor
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.buffer_blocks = buffer_blocks
        self.free_blocks = buffer_blocks
        self.on_prefilled = on_prefilled          # callback(request, prefill_instance)
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.busy_time = 0.0
        self.num_batches = 0
        self._busy = False
        # Free blocks the queue's head waits for before any batch can start (chunked prefill
        # in arrival order: an empty pick means an unstarted head whose blocks don't fit, and
        # arrivals queue behind it); a release short of them skips the futile pick. 0: try.
        self._blocked_on = 0
        self._batch: tuple | list = ()     # the batch in progress (one at a time)
        self._span = (0.0, 0.0)            # (start, end) of the latest batch
        self.source = None                # a router admitting arrivals lazily, or None
        self.host = HostQueue()           # this node's host CPU and PCIe root (staging copies)
        self.save_time = None             # prompt -> s the engine spends saving its KV to host
                                          # memory (host-staged mechanisms: wait_for_save)
        # The batching policy (None: FCFS, ``fcfs_token_budget``) and what it promises
        # (``policies.batching.BatchingTraits``): in arrival order, a policy in order takes a
        # fast path; any other, or any in a fairness policy's order, the general path.
        self.pick, self.fairness, self.prefix = pick, fairness, prefix
        self.traits = traits_of(pick or fcfs_token_budget)
        self._chunks: list = []           # (tokens past the hit, context before) of a batch
        if pick is not None or fairness is not None or prefix is not None:
            self.done: dict[int, int] = {}   # request -> prompt tokens computed so far
            self.pick = pick or fcfs_token_budget
        self._hits: dict[int, int] = {}   # request being prefilled -> its cached tokens
        if fairness is not None:          # else the deque: arrival order is serving order
            self.queue = []               # request indices in serving order
            self._keys: list = []         # their (fairness key, arrival count), sorted
            self._count = 0
            tenant = getattr(ledger.trace, "tenant", None)
            self._tenant = tenant.tolist() if tenant is not None else None
        # The end of the batch in progress: one event, re-armed for each batch (at most one
        # is pending), so a batch costs a queue entry and no new event (``_next_batch``).
        self._wakeup = Event(env)
        self._wakeup._ok, self._wakeup._value = True, None
        self._wakeup_callbacks = [self._done]
        self._take = self._take_general
        if fairness is None and prefix is None and self.traits.in_order:
            if not self.traits.splits_prompts:
                self._take = self._take_fcfs
            elif max_batch_size > 0 and max_batch_tokens > 0:   # (a 0 budget picks nothing)
                self._take = self._take_chunked

    def fits_many(self, prompts: np.ndarray) -> np.ndarray:
        """Whether each prompt can ever be prefilled here (an array of prompt lengths)."""
        prompts = np.asarray(prompts, dtype=np.int64)
        fits = blocks_for(prompts, self.block_size) <= self.buffer_blocks
        if not self.traits.splits_prompts:
            fits &= prompts <= self.max_batch_tokens    # one iteration per prompt
        return fits

    @property
    def load(self) -> int:
        return self.queued_tokens

    def enqueue(self, i: int) -> None:
        """The router admits ``i`` here (at its arrival instant)."""
        if self.fairness is None:
            self.queue.append(i)
        else:
            tenant = self._tenant[i] if self._tenant is not None else ""
            key = (self.fairness.tag(tenant, self.ledger.prompt[i]), self._count)
            self._count += 1
            k = bisect.bisect(self._keys, key)
            self._keys.insert(k, key)
            self.queue.insert(k, i)
        self.queued_tokens += self.ledger.prompt[i]
        self.ledger.prefill_instance[i] = self.index

    def kick(self) -> None:
        """Something changed (an arrival, a freed buffer): start a batch if idle."""
        if not self._busy:
            self._next_batch()

    def release(self, i: int) -> None:
        """The decode side has pulled request ``i``'s KV cache: free its send buffer."""
        self.free_blocks += -(-self.ledger.prompt[i] // self.block_size)   # blocks_for
        if self.prefix is not None:
            self.prefix.release(i)
        if not self._busy and self.queue:   # an idle, empty instance waits for an arrival
            if self.free_blocks >= self._blocked_on:
                self._next_batch()
            elif self.source is not None:   # the head still waits: only admit the arrivals
                self.source.admit_until(self.env._now, self)

    def _next_batch(self) -> None:
        """Start the next batch if one fits; otherwise stay idle until a kick or release."""
        now = self.env._now
        if self.source is not None:
            self.source.admit_until(now, self)
        taken = self._take(now) if self.queue else None
        if taken is None:
            self._busy = False
            return
        self._busy = True
        finished, lens, at = taken
        duration = (self.predictor.prefill_time(lens) if self.prefix is None else
                    self.predictor.mixed_step_time(self._chunks, []))
        if self.save_time is not None:            # the batch ends when its KV is saved
            prompt = self.ledger.prompt
            duration += sum([self.save_time(prompt[i]) for i in finished])
        if not duration >= 0:
            raise ValueError(f"prefill instance {self.index}: a batch of {lens} prompt tokens "
                             f"priced at {duration} s; a predictor's time must be >= 0")
        self.busy_time += duration
        self._span = (at, at + duration)
        self.num_batches += 1
        self._batch = finished
        # The batch's end, as ``Timeout(env, at - now + duration)`` would schedule it, with
        # the one wake-up event (``sim.engine.timers.schedule_after``).
        wakeup = self._wakeup
        wakeup.callbacks = self._wakeup_callbacks
        schedule_after(self.env, at - now + duration, wakeup)

    def _take_fcfs(self, now: float) -> tuple | None:
        """The FCFS fast path: the longest head of the queue that fits, whole prompts.
        Returns (requests finished, prompt tokens computed, start) or None."""
        queue, prompt, bs = self.queue, self.ledger.prompt, self.block_size
        take = fcfs_prefill_batch(queue, prompt, self.max_batch_size, self.max_batch_tokens,
                                  self.free_blocks, bs)
        if take == 0:
            return None
        if take == 1:                             # the common batch below saturation
            batch = (queue.popleft(),)
            lens = [prompt[batch[0]]]
            self.queued_tokens -= lens[0]
            self.free_blocks -= -(-lens[0] // bs)           # blocks_for
        else:
            batch = [queue.popleft() for _ in range(take)]
            lens = [prompt[i] for i in batch]
            self.queued_tokens -= sum(lens)
            self.free_blocks -= sum([blocks_for(n, bs) for n in lens])
        last = self.ledger.arrival_at[batch[-1]]
        at = last if last > now else now          # admitted ahead of its arrival (lazy router)
        start = self.ledger.prefill_start_at
        for i in batch:
            start[i] = at
        return batch, lens, at

    def _take_chunked(self, now: float) -> tuple | None:
        """Chunked prefill in arrival order. A lone queued request (the common batch below
        saturation) is ``chunked_prefill``'s whole pick: as many of its remaining tokens as
        the budget allows, if its blocks fit; taken here without building the pick list. So
        is an empty pick: an unstarted head whose blocks don't fit (the policy stops there)."""
        queue, prompt = self.queue, self.ledger.prompt
        i = queue[0]
        computed = self.done.get(i, 0)
        if not computed:                          # an unstarted head: its blocks first
            need = -(-prompt[i] // self.block_size)    # blocks_for
            if need > self.free_blocks:           # the policy would pick nothing
                self._blocked_on = need
                return None
        if len(queue) != 1:
            return self._take_general(now)        # (the head is in the pick)
        left, n = prompt[i] - computed, self.max_batch_tokens
        return self._take_one(i, left if left < n else n, now)

    def _take_one(self, i: int, n: int, now: float) -> tuple:
        """A pick of one: request ``i`` computes ``n`` more prompt tokens. Its first chunk
        takes its blocks and starts it; its last takes it off the queue."""
        ledger, done = self.ledger, self.done
        at = ledger.arrival_at[i]
        if not at > now:
            at = now
        computed = done.pop(i, None)
        if computed is None:                      # first chunk: its blocks, its start
            self.free_blocks -= -(-ledger.prompt[i] // self.block_size)   # blocks_for
            ledger.prefill_start_at[i] = at
            computed = 0
        computed += n
        self.queued_tokens -= n
        if computed != ledger.prompt[i]:
            done[i] = computed
            return (), [n], at
        self.queue.remove(i)
        return (i,), [n], at

    def _take_general(self, now: float) -> tuple | None:
        """The general path: the batching policy picks (request, tokens) from the queue in
        the fairness policy's order; finished prompts leave the queue."""
        ledger, queue, done = self.ledger, self.queue, self.done
        prompt = ledger.prompt
        picks = self.pick(queue, prompt, done, self.max_batch_size, self.max_batch_tokens,
                          self.free_blocks, self.block_size)
        if not picks:
            return None
        if self.prefix is not None:
            self._chunks = self._past_hits(picks)
        if len(picks) == 1 and self.fairness is None:   # the common batch below saturation
            (i, n), = picks
            return self._take_one(i, n, now)
        arrival, bs = ledger.arrival_at, self.block_size
        at, lens, first, finished, blocks = now, [], [], [], 0
        for i, n in picks:
            if arrival[i] > at:                   # the batch starts once all have arrived
                at = arrival[i]
            lens.append(n)
            computed = done.get(i)
            if computed is None:                  # first chunk: its blocks, its start
                blocks += -(-prompt[i] // bs)     # blocks_for
                first.append(i)
                computed = 0
            computed += n
            if computed == prompt[i]:
                finished.append(i)
                done.pop(i, None)
            else:
                done[i] = computed
        start = ledger.prefill_start_at
        for i in first:
            start[i] = at
        self.free_blocks -= blocks
        self.queued_tokens -= sum(lens)
        if self.fairness is None:                 # arrival order: finished ones lead it
            for i in finished:
                queue.remove(i)
        else:
            keys = self._keys
            for i in finished:
                k = queue.index(i)
                self.fairness.served(keys[k][0])
                del queue[k], keys[k]
        return finished, lens, at

    def _past_hits(self, picks: list) -> list:
        """The picks as (tokens computed, cached context) chunks: a request's first pick
        admits it to the prefix cache, the tokens of a pick that it hit are skipped, and the
        rest attend to the hit. (A chunk is priced without the request's earlier chunks as
        context, as ``prefill_time`` prices it with no cache: with no hit, the same times.)"""
        prefix, done, hits, chunks = self.prefix, self.done, self._hits, []
        for i, n in picks:
            c = done.get(i)
            if c is None:
                c, hits[i] = 0, prefix.admit(i, self.ledger.prompt[i])
            h = hits[i]
            start = c if c > h else h
            if c + n > start:
                chunks.append((c + n - start, h))
            if c + n == self.ledger.prompt[i]:
                del hits[i]
        return chunks

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] spent in prefill batches, for ``t`` >= the latest batch's
        admission (the end of a run): ``busy_time`` counts a batch whole when it is admitted."""
        start, end = self._span
        return self.busy_time - max(0.0, end - max(start, t))

    def _done(self, _timer) -> None:
        batch, now, end_at = self._batch, self.env._now, self.ledger.prefill_end_at
        for i in batch:
            end_at[i] = now
        self._busy = False
        self._blocked_on = 0                      # the head may have changed: try
        on_prefilled = self.on_prefilled
        for i in batch:
            on_prefilled(i, self)
        if not self._busy:
            self._next_batch()
