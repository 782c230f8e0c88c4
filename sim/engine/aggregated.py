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

A step that computes a request's last uncomputed token samples its next one: the step that
finishes a prompt gives the first token (TTFT: that step's end), each decode step one more.
A step's time is the predictor's ``mixed_step_time(prefill chunks, decode contexts)``.

Fast-forward: a step of decodes only, with no waiting request that could join before the
next finish, repeats alike until a request finishes, the blocks run short or a request
arrives: one run, one timer (``decode_time``), cut at the first boundary at or after an
arrival (``decode_next_boundary``); one arriving at a boundary's instant joins the step that
starts there (``sim.engine.router``). The instance also commits steps ahead of the clock
where nothing can reach it before they end (``_start``; routed, the run an arrival cuts ends
at once when its boundary comes before the next arrival: ``kick``), its timers set as they
would have been at those instants. ``fast_forward=False``: every step a timer, the oracle.

Bookkeeping is O(1) per step, not per running request: every decoding request computes one
token per step, so its computed tokens are ``base + it`` and it ends at a known step (a
sorted list); the blocks a step starts are counted by ``base`` modulo the block size.

Prefix caching (``prefix``, a ``sim.engine.prefix_cache.PrefixCache`` set by the pool, or
None): a request admitted from the queue starts with its cached tokens computed (vLLM's
``num_computed_tokens``), so its first chunk is the rest, attending to them.

Records: ``prefill_start_at`` is the start of the step of its first chunk, ``prefill_end_at``
= ``first_token_at`` the end of the step that first finished its prompt; no KV moves
(``transfer_*_at`` NaN, ``kv_bytes`` 0); ``prefill_instance`` = ``decode_instance`` = this
instance's index.
"""

from __future__ import annotations

import bisect
import math

from sim.engine.aggregated_runs import growth, run_length
from sim.engine.timers import MovableTimer, timeout_instant
from sim.engine.waiting import WaitingQueue
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
        tenant = getattr(ledger.trace, "tenant", None)
        self.waiting = WaitingQueue(fairness, tenant)   # preempted first, then new ones
        self.running: list[int] = []          # admission order: the newest last
        # A decoding request computes one token per step, so its num_computed_tokens is
        # base + it (``it``: steps taken); it ends at step prompt + output - 1 - base.
        self.it = 0
        self.decoding: dict[int, int] = {}    # request -> base
        self._finishing: list = []            # (step it ends at, request), sorted
        self._residues = [0] * block_size     # decoding requests by base % block_size
        self._base_sum = 0
        self.computed: dict[int, int] = {}    # running, still prefilling -> tokens computed
        self.generated: dict[int, int] = {}   # not decoding -> output tokens sampled so far
        self._preempted: set[int] = set()     # waiting to recompute
        self._step: tuple | None = None       # (start, decodes, chunks, steps, context)
        self._timer = MovableTimer(env, self._on_timer)
        self.source = None                    # lazy arrivals (sim.engine.router), or None
        self.lost = False
        self.on_lost = None                   # called once lost (the router's), or None
        self.busy_time = 0.0
        self.num_steps = 0                    # engine steps taken
        self.num_wakeups = 0                  # timer firings
        self.num_preemptions = 0
        self.log: list | None = None          # (start, end, decodes, chunks, steps) per run
        self._logged: tuple = ()              # the decodes of the step in progress, logged
        self.ahead = False                    # commit ahead of the clock, up to ``horizon``
        self.horizon = None                   # its arrivals (next_arrival_at()), if ahead
        self._ahead_end = 0.0                 # the end of the latest run committed ahead
        self._next_at = -math.inf             # lazy arrivals: the next one not yet admitted
        self.prefix = None                    # its prefix cache, or None

    # -- what the router sees -------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests assigned here and not yet ended."""
        return len(self.waiting.items) + len(self.running)

    def enqueue(self, i: int) -> None:
        """The router assigns arrived request ``i`` here."""
        ledger = self.ledger
        ledger.prefill_instance[i] = ledger.decode_instance[i] = self.record_index
        if self.lost:
            ledger.fail(i, Status.FAILED_INSTANCE_LOST, self.env._now)
            return
        self.generated[i] = 0
        self.waiting.add(i, ledger.prompt[i])

    def kick(self) -> None:
        """A request was enqueued: start a step if idle, else cut a run of decodes at its
        next boundary (the request is considered there). Ahead of the clock, when that
        boundary comes before the next arrival and no other event is due until then, the run
        ends there and the next step starts at once, as the timer's firing would have done
        (every event, e.g. a streamed record's write-out, keeps its order)."""
        step = self._step
        if step is None:
            self._timer.cancel()
            self._start(self.env._now)
            return
        start, decodes, chunks, steps, context = step
        if steps > 1:
            now = self.env._now
            j, t = self.predictor.decode_next_boundary(decodes, context, steps, now - start)
            if j < steps:
                self._step = (start, decodes, chunks, j, context)
                end = timeout_instant(now, start + t)     # where its timer would fire
                # no event and no arrival comes before the boundary: nothing in between
                if (self.ahead and self._timer.first_until(end)
                        and end < self.horizon.next_arrival_at()):
                    self._end_step(end)
                    self._ahead_end = end
                    self._start(end)
                    if self._step is None:            # idle: its firing stays, inert, where
                        self._timer.set(start + t)    # the boundary's would have been (the
                        self._timer.cancel()          # run's last instant is the same)
                else:
                    self._timer.set(start + t)

    # -- the step loop --------------------------------------------------------------------
    def _on_timer(self) -> None:
        self.num_wakeups += 1
        now = self.env._now
        if self._step is not None:
            self._end_step(now)
        self._start(now)

    def _end_step(self, now: float) -> None:
        """The step (or run) in progress ends at ``now``."""
        start, decodes, chunks, steps, _ = self._step
        self._step = None
        self.busy_time += now - start
        self.num_steps += steps
        if self.log is not None:
            self.log.append((start, now, self._logged, tuple(chunks), steps))
        self._commit(chunks, steps, now)

    def _start(self, now: float) -> None:
        """Schedule the step starting ``now`` (or sleep until the next arrival).

        Ahead of the clock (``ahead``): nothing outside the instance changes it or looks at
        it before the next arrival (``horizon``). Routed arrivals: a step that ends before
        then is committed at once and the step after it planned from its end. Lazy ones (the
        instance admits them itself): a step with prompt chunks, or a run of decodes that
        the next arrival cuts. Either way the instance runs at most about one arrival ahead;
        the rest are timers."""
        source, decoding = self.source, self.decoding
        clock = now          # the clock's instant when the step was due: timers are set from it
        log, ahead_on, ff, schedule = self.log, self.ahead, self.fast_forward, self._schedule
        # routed: the next arrival is routed after this returns (no event runs meanwhile)
        horizon_at = (self.horizon.next_arrival_at() if ahead_on and source is None
                      else math.inf)
        while True:
            if source is not None and now >= self._next_at:
                self._next_at = source.admit_until(now)
            chunks, steady = schedule(now)
            decodes = len(decoding)
            if not decodes and not chunks:
                at = self._next_at if source is not None else math.inf
                if at < math.inf:
                    self._timer.set(at, clock)
                return
            it = self.it + 1
            context = self._base_sum + decodes * it   # KVs and new tokens
            cut = False
            if chunks or not (steady and ff):
                duration = self.predictor.mixed_step_time(
                    [(n, c) for _, n, c in chunks], [b + it for b in decoding.values()])
                steps = 1
            else:
                steps, duration, cut = run_length(self, decodes, context, now)
            if not duration >= 0:
                raise ValueError(f"aggregated instance {self.index}: a step priced at "
                                 f"{duration} s; a predictor's time must be >= 0")
            if log is not None:
                self._logged = tuple(i for i in self.running if i in decoding)
            ahead = ahead_on and (cut or not steady or bool(chunks) if source is not None
                                  else now + duration < horizon_at)
            if not ahead:
                self._step = (now, decodes, chunks, steps, context)
                self._timer.set(now + duration, clock)
                return
            end = self._ahead_end = now + duration
            self.busy_time += duration
            self.num_steps += steps
            if log is not None:
                log.append((now, end, self._logged, tuple(chunks), steps))
            self._commit(chunks, steps, end)
            now = end

    def _schedule(self, now: float) -> tuple[list, bool]:
        """Allocate the step's blocks: every decoding request's next token, then the prompt
        chunks, returned as (request, tokens, computed before). ``steady``: the step has no
        chunk, preempted none, and no waiting request can join before a request ends (so
        the steps after it are alike until then)."""
        B, computed = self.block_size, self.computed
        budget = self.max_batch_tokens - len(self.decoding)
        need = self._residues[-self.it % B]       # decodes that start a block
        chunks = []
        if computed:                              # (at most the newest: it was cut)
            prompt, generated = self.ledger.prompt, self.generated
            for i, c in computed.items():
                if budget <= 0:
                    break
                n = min(prompt[i] + generated[i] - c, budget)
                need += -(-(c + n) // B) + (-c // B)
                chunks.append((i, n, c))
                budget -= n
        if need > self.free_blocks:
            return self._schedule_short(), False
        self.free_blocks -= need
        if budget <= 0 or not self.waiting.items or len(self.running) >= self.max_batch_size:
            return chunks, not chunks
        return self._admit(now, chunks, budget)

    def _admit(self, now: float, chunks: list, budget: int) -> tuple[list, bool]:
        """New (and preempted) requests from the head of the queue, while the budget, the
        sequences and the blocks allow: a head that cannot have its blocks stops the rest."""
        B, prompt, running, waiting = (self.block_size, self.ledger.prompt, self.running,
                                       self.waiting)
        items = waiting.items                     # its head first
        while items and budget and len(running) < self.max_batch_size:
            i = items[0]
            h = 0 if self.prefix is None else self.prefix.peek(i, prompt[i] + self.generated[i])
            n = min(prompt[i] + self.generated[i] - h, budget)
            need = -(-(h + n) // B)
            if need > self.free_blocks:
                return chunks, not chunks         # it waits for blocks a finish frees
            waiting.pop()
            if self.prefix is not None:
                self.prefix.admit(i, prompt[i] + self.generated[i])
            if i in self._preempted:
                self._preempted.discard(i)
            else:                                 # its first step ever
                self.ledger.prefill_start_at[i] = now
            self.computed[i] = h
            self.free_blocks -= need
            running.append(i)
            chunks.append((i, n, h))
            budget -= n
        return chunks, not chunks

    def _schedule_short(self) -> list:
        """The step is short of blocks: running requests, oldest first, take theirs, and
        while one cannot, the newest running request is preempted (vLLM V1). No waiting
        request joins a step that preempted."""
        B, running, it = self.block_size, self.running, self.it
        budget, chunks, k = self.max_batch_tokens, [], 0
        while k < len(running):
            i = running[k]
            base = self.decoding.get(i)
            if base is not None:
                c, n = base + it, 1
            else:
                c = self.computed[i]
                n = min(self.ledger.prompt[i] + self.generated[i] - c, budget)
            need = -(-(c + n) // B) + (-c // B)
            while need > self.free_blocks:
                victim = running.pop()
                self._preempt(victim)
                if victim == i:
                    return chunks
            self.free_blocks -= need
            budget -= n
            if base is None:
                chunks.append((i, n, c))
            k += 1
        return chunks

    def _commit(self, chunks: list, steps: int, now: float) -> None:
        """The step (or run of ``steps`` decode steps) ended at ``now``: tokens computed,
        tokens sampled, requests finished."""
        it = self.it
        if steps > 1:
            self.free_blocks -= growth(self, it + 2, steps - 1)
        it = self.it = it + steps
        finishing, ended = self._finishing, []
        if finishing and finishing[0][0] == it:   # _undecode, inlined: often one a run
            B, decoding, residues = self.block_size, self.decoding, self._residues
            while finishing and finishing[0][0] == it:
                i = finishing.pop(0)[1]
                base = decoding.pop(i)
                residues[base % B] -= 1
                self._base_sum -= base
                self.free_blocks += -(-(base + it) // B)
                ended.append(i)
        if chunks:
            self._sample(chunks, it, now, ended)
        if ended:
            ledger, prefix = self.ledger, self.prefix
            for i in ended:
                ledger.finish(i, now)
                if prefix is not None:
                    prefix.release(i)
            if len(ended) == 1:
                self.running.remove(ended[0])
            else:
                gone = set(ended)
                self.running = [i for i in self.running if i not in gone]

    def _sample(self, chunks: list, it: int, now: float, ended: list) -> None:
        """The step's prompt chunks are computed: a chunk that computes its request's last
        token samples one; the request decodes from then on, or ends (into ``ended``)."""
        ledger = self.ledger
        prompt, output, generated = ledger.prompt, ledger.output, self.generated
        for i, n, _ in chunks:
            c = self.computed[i] = self.computed[i] + n
            if c != prompt[i] + generated[i]:
                continue                          # a chunk short of its last token
            g = generated[i] = generated[i] + 1   # its last token: one is sampled
            if g == 1:
                ledger.prefill_end_at[i] = ledger.first_token_at[i] = now
            del self.computed[i]
            if g == output[i]:
                self.free_blocks += -(-c // self.block_size)
                del generated[i]
                ended.append(i)
                continue
            del generated[i]                      # from now on base + it tells it
            base = self.decoding[i] = c - it
            bisect.insort(self._finishing, (prompt[i] + output[i] - 1 - base, i))
            self._residues[base % self.block_size] += 1
            self._base_sum += base

    def _undecode(self, i: int) -> int:
        """Decoding ``i`` stops (it ends or is preempted): its blocks are freed. Returns the
        tokens it had computed."""
        base = self.decoding.pop(i)
        self._residues[base % self.block_size] -= 1
        self._base_sum -= base
        c = base + self.it
        self.free_blocks += -(-c // self.block_size)
        return c

    def _preempt(self, i: int) -> None:
        """Free running ``i``'s blocks and queue it first, to recompute what it had."""
        if i in self.decoding:
            base = self.decoding[i]
            finishing = self._finishing
            del finishing[bisect.bisect_left(finishing, (
                self.ledger.prompt[i] + self.ledger.output[i] - 1 - base, i))]
            c = self._undecode(i)
            self.generated[i] = c - self.ledger.prompt[i] + 1
        else:
            self.free_blocks += -(-self.computed.pop(i) // self.block_size)
        if self.prefix is not None:
            self.prefix.release(i)
        self._preempted.add(i)
        self.num_preemptions += 1
        self.waiting.add_first(i)

    # -- faults ---------------------------------------------------------------------------
    def lose(self) -> None:
        """The instance is lost now: every request on it ends ``failed_instance_lost``, and
        so does every request routed here later."""
        now, ledger = self.env._now, self.ledger
        self.lost = True
        for i in list(self.running) + list(self.waiting):
            ledger.fail(i, Status.FAILED_INSTANCE_LOST, now)
        for i in list(self.decoding):
            self._undecode(i)
        for c in self.computed.values():
            self.free_blocks += -(-c // self.block_size)
        for i in self.running if self.prefix is not None else ():
            self.prefix.release(i)
        for name in ("running", "waiting", "_finishing", "computed", "generated",
                     "_preempted"):
            getattr(self, name).clear()
        if self._step is not None:
            self.busy_time += now - self._step[0]
            self._step = None
        self._timer.cancel()
        if self.source is not None:           # lazy arrivals still come here, to fail
            at = self.source.next_arrival_at()
            if at < math.inf:
                self._timer.set(at)
        if self.on_lost is not None:
            self.on_lost()

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] in steps (``t`` = now: the end of a run, cut or not); a cut run
        takes back what was committed ahead past ``t``."""
        live = max(0.0, t - self._step[0]) if self._step is not None else 0.0
        return self.busy_time - max(0.0, self._ahead_end - t) + live

    def leaks(self) -> dict:
        """What is still held (empty at the end of a run that was not cut)."""
        out = {name: len(getattr(self, name)) for name in
               ("waiting", "running", "computed", "generated", "decoding", "_finishing",
                "_preempted") if getattr(self, name)}
        if self.free_blocks != self.num_blocks:
            out["blocks"] = self.num_blocks - self.free_blocks
        if any(self._residues) or self._base_sum:
            out["residues"] = sum(self._residues)
        if self.prefix is not None and self.prefix.leaks():
            out["prefix_cache"] = self.prefix.leaks()
        return out
