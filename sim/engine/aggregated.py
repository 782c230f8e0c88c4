"""An aggregated instance: prefill and decode in the same steps, as vLLM V1 schedules them.

One engine holds a model and its KV cache and runs one step at a time. A step
(``_schedule``, vLLM V1's ``Scheduler.schedule`` with its defaults) has a token budget
(``max_batch_tokens``: max_num_batched_tokens) and serves, in order:

1. the running requests, oldest first: each needs ``num_tokens - num_computed_tokens``
   tokens (1 for a decode; the rest of its prompt, capped by the budget, for the one whose
   prompt was cut into chunks: it is the newest running request);
2. then, if no request was preempted in this step, waiting requests (preempted ones first,
   then new ones in arrival order or the fairness policy's), each a chunk of its prompt as
   long as the budget allows, while fewer than ``max_batch_size`` (max_num_seqs) run.

KV blocks of ``block_size`` tokens are allocated on demand for the tokens a step computes.
When a running request's blocks cannot be had, the newest running request is preempted: its
blocks are freed, its computed tokens forgotten, and it goes to the front of the waiting
queue to prefill its prompt and the tokens it had generated again (recompute). A waiting
request whose first chunk's blocks cannot be had waits, and so do the ones behind it.

A step that computes a request's last uncomputed token samples its next token: the step that
finishes a prompt gives the first token (TTFT is that step's end), each decode step one more;
a request ends when it has all its output tokens. The step's time is the predictor's
``mixed_step_time(prefill chunks, decode contexts)`` (``sim.models.predictor``).

Fast-forward: a step of decodes only, with no waiting request that could join before the
next finish, repeats with the same members until the first of: a request finishing, the
blocks running short, the next arrival. The instance takes those steps as one run with one
timer (``decode_time``), cut at the first step boundary at or after an arrival routed to it
meanwhile (``decode_next_boundary``). A request that arrives at a boundary's instant joins
the step that starts there (arrivals are admitted before boundaries of the same instant:
``sim.engine.router``). With ``fast_forward=False`` every step is its own timer: the oracle.

Records: ``prefill_start_at`` is the start of the step of its first chunk,
``prefill_end_at`` = ``first_token_at`` the end of the step that finished its prompt first;
no KV moves (``transfer_*_at`` NaN, ``kv_bytes`` 0); ``prefill_instance`` and
``decode_instance`` are both this instance's index.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from sim.engine.timers import MovableTimer
from traces.schema import Status


class AggregatedInstance:
    def __init__(self, env, index: int, ledger, predictor, *, max_batch_size: int,
                 max_batch_tokens: int, num_blocks: int, block_size: int,
                 fast_forward: bool = True, fairness=None, record_index: int | None = None):
        if max_batch_size < 1 or max_batch_tokens < max_batch_size:
            raise ValueError(f"aggregated instance {index}: max_batch_size {max_batch_size} "
                             f"must be >= 1 and <= max_batch_tokens {max_batch_tokens}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"aggregated instance {index}: {num_blocks} blocks of "
                             f"{block_size} tokens; need >= 1 of each")
        self.env, self.index, self.ledger, self.predictor = env, index, ledger, predictor
        self.record_index = index if record_index is None else record_index
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = num_blocks
        self.fast_forward = fast_forward
        self.fairness = fairness
        self.waiting: deque[int] | list[int] = deque() if fairness is None else []
        self._keys: list = []                 # fairness keys of ``waiting`` (sorted)
        self._count = 0
        self.running: list[int] = []          # admission order: the newest last
        self.computed: dict[int, int] = {}    # num_computed_tokens (KV held)
        self.generated: dict[int, int] = {}   # output tokens sampled so far
        self.held: dict[int, int] = {}        # KV blocks held
        self.decoding: set[int] = set()       # running, past its (re)prefill
        self._step: tuple | None = None       # (start, decodes, chunks, steps, context)
        self._timer = MovableTimer(env, self._on_timer)
        self.source = None                    # lazy arrivals (sim.engine.router), or None
        self.lost = False
        self.busy_time = 0.0
        self.num_steps = 0                    # engine steps taken
        self.num_wakeups = 0                  # timer firings
        self.num_preemptions = 0
        self.log: list | None = None          # (start, end, decodes, chunks) per run, if set

    # -- what the router sees -------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests assigned here and not yet ended."""
        return len(self.waiting) + len(self.running)

    def reject_codes(self, prompt: np.ndarray, output: np.ndarray,
                     max_context: int) -> np.ndarray:
        """``sim.engine.ledger.REJECTIONS`` codes: 1 a request longer than the model's
        context, 3 one whose whole KV cache can never fit this instance's blocks."""
        prompt = np.asarray(prompt, dtype=np.int64)
        total = prompt + np.asarray(output, dtype=np.int64)
        too_long = total > max_context
        no_room = -(-total // self.block_size) > self.num_blocks
        return np.select([too_long, no_room], [1, 3], 0)

    def enqueue(self, i: int) -> None:
        """The router assigns arrived request ``i`` here."""
        ledger = self.ledger
        ledger.prefill_instance[i] = ledger.decode_instance[i] = self.record_index
        if self.lost:
            ledger.fail(i, Status.FAILED_INSTANCE_LOST, self.env._now)
            return
        self.generated[i] = 0
        if self.fairness is None:
            self.waiting.append(i)
        else:
            tenant = getattr(ledger.trace, "tenant", None)
            key = (self.fairness.tag(tenant[i] if tenant is not None else "",
                                     ledger.prompt[i]), self._count)
            self._count += 1
            k = bisect.bisect(self._keys, key)
            self._keys.insert(k, key)
            self.waiting.insert(k, i)

    def kick(self) -> None:
        """A request was enqueued: start a step if idle, else cut a run of decodes at its
        next boundary (the request is considered there)."""
        if self._step is None:
            self._timer.cancel()
            self._start(self.env._now)
            return
        start, decodes, chunks, steps, context = self._step
        if steps > 1:
            j, t = self.predictor.decode_next_boundary(len(decodes), context, steps,
                                                       self.env._now - start)
            if j < steps:
                self._step = (start, decodes, chunks, j, context)
                self._timer.set(start + t)

    # -- the step loop --------------------------------------------------------------------
    def _on_timer(self) -> None:
        self.num_wakeups += 1
        now = self.env._now
        if self._step is not None:
            start, decodes, chunks, steps, _ = self._step
            self._step = None
            self.busy_time += now - start
            self.num_steps += steps
            if self.log is not None:
                self.log.append((start, now, tuple(decodes), tuple(chunks), steps))
            self._commit(decodes, chunks, steps, now)
        self._start(now)

    def _start(self, now: float) -> None:
        """Schedule the step starting ``now`` (or sleep until the next arrival)."""
        if self.source is not None:
            self.source.admit_until(now)
        decodes, chunks, steady = self._schedule(now)
        if not decodes and not chunks:
            at = self.source.next_arrival_at() if self.source is not None else math.inf
            if at < math.inf:
                self._timer.set(at)
            return
        contexts = [self.computed[i] + 1 for i in decodes]
        context = sum(contexts)
        if chunks or not (steady and self.fast_forward):
            duration = self.predictor.mixed_step_time(
                [(n, c) for _, n, c in chunks], contexts)
            steps = 1
        else:
            steps = self._run_length(decodes, contexts, now)
            duration = self.predictor.decode_time(len(decodes), context, steps)
        if not duration >= 0:
            raise ValueError(f"aggregated instance {self.index}: a step priced at "
                             f"{duration} s; a predictor's time must be >= 0")
        self._step = (now, decodes, chunks, steps, context)
        self._timer.set(now + duration)

    def _schedule(self, now: float) -> tuple[list, list, bool]:
        """The step's decodes (requests) and prompt chunks ((request, tokens, computed
        before)), blocks allocated; ``steady``: the step has no chunk, ran every running
        request, preempted none, and no waiting request can join before a request ends (so
        the steps after it are alike until then)."""
        budget, B = self.max_batch_tokens, self.block_size
        running, computed, held, prompt = (self.running, self.computed, self.held,
                                           self.ledger.prompt)
        decodes, chunks, preempted, k = [], [], False, 0
        while k < len(running) and budget:
            i = running[k]
            c = computed[i]
            n = min(prompt[i] + self.generated[i] - c, budget)
            need = -(-(c + n) // B) - held[i]
            while need > self.free_blocks and running[-1] != i:
                self._preempt(running.pop())
                preempted = True
            if need > self.free_blocks:       # it is the newest: preempt it too
                self._preempt(running.pop())
                preempted = True
                break
            self.free_blocks -= need
            held[i] += need
            budget -= n
            if i in self.decoding:
                decodes.append(i)
            else:
                chunks.append((i, n, c))
            k += 1
        steady = not chunks and not preempted and k == len(running)
        if preempted:
            return decodes, chunks, False     # no new requests in a step that preempted
        waiting = self.waiting
        while waiting and budget and len(running) < self.max_batch_size:
            i = waiting[0]
            n = min(prompt[i] + self.generated[i], budget)
            need = -(-n // B)
            if need > self.free_blocks:
                return decodes, chunks, steady and not chunks
            self._pop_waiting()
            if i not in computed:             # its first step ever
                self.ledger.prefill_start_at[i] = now
            computed[i], held[i] = 0, need
            self.free_blocks -= need
            running.append(i)
            chunks.append((i, n, 0))
            budget -= n
        return decodes, chunks, steady and not chunks

    def _run_length(self, decodes: list, contexts: list, now: float) -> int:
        """Steps of decodes only from now: to the first finish, the last step whose blocks
        can be had, and the boundary at or after the next arrival (lazy arrivals)."""
        generated, output = self.generated, self.ledger.output
        steps = min([output[i] - generated[i] for i in decodes])
        if steps > 1:
            B = self.block_size
            slots = np.asarray(contexts, dtype=np.int64)    # KV slots after the first step
            held = int((-(-slots // B)).sum())

            def extra(s: int) -> int:                      # blocks steps 2..s add
                return int((-(-(slots + (s - 1)) // B)).sum()) - held

            if extra(steps) > self.free_blocks:
                lo, hi = 1, steps                           # extra(lo) fits, extra(hi) not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if extra(mid) <= self.free_blocks else (lo, mid)
                steps = lo
        if steps > 1 and self.source is not None:
            at = self.source.next_arrival_at()
            if at < math.inf:
                j, _ = self.predictor.decode_next_boundary(len(decodes), sum(contexts),
                                                           steps, at - now)
                steps = min(steps, j)
        return steps

    def _commit(self, decodes: list, chunks: list, steps: int, now: float) -> None:
        """The step (or run of ``steps`` decode steps) ended at ``now``: tokens computed,
        tokens sampled, requests finished."""
        computed, generated, held, B = self.computed, self.generated, self.held, self.block_size
        ledger, output = self.ledger, self.ledger.output
        done = []
        for i in decodes:
            c = computed[i] = computed[i] + steps
            generated[i] += steps
            if steps > 1:
                blocks = -(-c // B)
                self.free_blocks -= blocks - held[i]
                held[i] = blocks
            if generated[i] == output[i]:
                done.append(i)
        prompt = ledger.prompt
        for i, n, _ in chunks:
            c = computed[i] = computed[i] + n
            if c == prompt[i] + generated[i]:          # its last token: one is sampled
                generated[i] += 1
                self.decoding.add(i)
                if generated[i] == 1:
                    ledger.prefill_end_at[i] = ledger.first_token_at[i] = now
                if generated[i] == output[i]:
                    done.append(i)
        if done:
            for i in done:
                ledger.finish(i, now)
                self._forget(i)
            gone = set(done)
            self.running = [i for i in self.running if i not in gone]

    def _preempt(self, i: int) -> None:
        """Free running ``i``'s blocks and queue it first, to recompute what it had."""
        self.free_blocks += self.held[i]
        self.held[i] = self.computed[i] = 0
        self.decoding.discard(i)
        self.num_preemptions += 1
        if self.fairness is None:
            self.waiting.appendleft(i)
        else:
            self._count += 1
            self._keys.insert(0, ((-1, -self._count), -self._count))
            self.waiting.insert(0, i)

    def _pop_waiting(self) -> None:
        if self.fairness is None:
            self.waiting.popleft()
            return
        del self.waiting[0]
        key = self._keys.pop(0)[0]
        if key[0] >= 0:                       # a new request, not a preempted one
            self.fairness.served(key)

    def _forget(self, i: int) -> None:
        self.free_blocks += self.held.pop(i, 0)
        self.computed.pop(i, None)
        self.generated.pop(i, None)
        self.decoding.discard(i)

    # -- faults ---------------------------------------------------------------------------
    def lose(self) -> None:
        """The instance is lost now: every request on it ends ``failed_instance_lost``, and
        so does every request routed here later."""
        now, ledger = self.env._now, self.ledger
        self.lost = True
        for i in list(self.running) + list(self.waiting):
            ledger.fail(i, Status.FAILED_INSTANCE_LOST, now)
            self._forget(i)
        self.running.clear()
        self.waiting.clear()
        self._keys.clear()
        if self._step is not None:
            self.busy_time += now - self._step[0]
            self._step = None
        self._timer.cancel()
        if self.source is not None:           # lazy arrivals still come here, to fail
            at = self.source.next_arrival_at()
            if at < math.inf:
                self._timer.set(at)

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] spent in steps (``t`` = now: the end of a run, cut or not)."""
        if self._step is None:
            return self.busy_time
        return self.busy_time + max(0.0, t - self._step[0])

    def leaks(self) -> dict:
        """What is still held (empty at the end of a run that was not cut)."""
        out = {name: len(getattr(self, name)) for name in
               ("waiting", "running", "computed", "generated", "held", "decoding")
               if getattr(self, name)}
        if self.free_blocks != self.num_blocks:
            out["blocks"] = self.num_blocks - self.free_blocks
        return out
