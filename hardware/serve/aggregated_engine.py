"""The aggregated worker's compute, without sockets: one model and one paged KV cache serving
both phases of every request, scheduled as vLLM V1 schedules by default.

``schedule`` (a pure function, vLLM V1's ``Scheduler.schedule``) plans one step under a token
budget (``max_batch_tokens``: max_num_batched_tokens):

1. the running requests, oldest first: each computes ``num_tokens - num_computed`` tokens
   (1 for a decode; for the one whose prompt is being cut into chunks, the rest of its prompt
   as far as the budget allows: it is the newest running request, so its chunk comes after
   every decode);
2. then, only if nobody was preempted in this step, waiting requests in order (preempted
   ones first, then new ones by arrival), each a chunk of its prompt as long as the budget
   allows, while fewer than ``max_batch_size`` (max_num_seqs) run.

KV blocks of ``block_size`` tokens are taken on demand for the tokens a step computes. When
a running request's blocks cannot be had, the newest running request is preempted (its blocks
freed, its computed tokens forgotten: recompute), and goes to the front of the waiting queue;
a waiting request whose chunk's blocks cannot be had waits, and so do the ones behind it.

``AggregatedEngine.step`` applies the plan and runs it: the one-token chunks (decodes) in one
batched model call, the longer chunks (prompts) in another, then samples greedily for every
request whose last known token was computed (the step that finishes a prompt gives its first
token) and retires those with all their tokens. A step's instants are the worker's wall
clock: ``start`` before scheduling, ``end`` after sampling; ``busy_s`` sums the steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from hardware.kv_layout import blocks_for
from hardware.model.cache import PagedKVCache

BLOCK_TOKENS = 16                   # tokens per KV block (the prefill worker's paged cache)


@dataclass(frozen=True)
class SeqView:
    """What the scheduler sees of one request."""

    rid: str
    num_tokens: int                 # prompt + output tokens known
    num_computed: int               # of those, tokens whose K/V is in the cache
    num_blocks: int = 0             # KV blocks it holds


@dataclass(frozen=True)
class StepPlan:
    scheduled: tuple[tuple[str, int], ...]    # (request, tokens to compute), in step order
    preempted: tuple[str, ...]                # newest first
    admitted: tuple[str, ...]                 # from the waiting queue, in its order


def _need(seq: SeqView, n: int, block_size: int) -> int:
    """Blocks ``seq`` must add to hold ``n`` more computed tokens."""
    return max(0, blocks_for(seq.num_computed + n, block_size) - seq.num_blocks)


def schedule(running: Sequence[SeqView], waiting: Sequence[SeqView], *, max_batch_tokens: int,
             max_batch_size: int, free_blocks: int, block_size: int) -> StepPlan:
    """One step's plan (the module docstring has the rules); ``running`` oldest first,
    ``waiting`` in queue order."""
    budget, free, running = max_batch_tokens, free_blocks, list(running)
    scheduled: list[tuple[str, int]] = []
    preempted: list[str] = []
    i = 0
    while i < len(running) and budget > 0:
        seq = running[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = _need(seq, n, block_size)
        while need > free and running[-1] is not seq:      # the newest other gives way
            victim = running.pop()
            preempted.append(victim.rid)
            free += victim.num_blocks
        if need > free:                                    # none left but itself
            running.pop()
            preempted.append(seq.rid)
            break
        free -= need
        budget -= n
        scheduled.append((seq.rid, n))
        i += 1
    admitted: list[str] = []
    if not preempted:
        for seq in waiting:
            if budget <= 0 or len(running) + len(admitted) >= max_batch_size:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = _need(seq, n, block_size)
            if need > free:
                break
            free -= need
            budget -= n
            scheduled.append((seq.rid, n))
            admitted.append(seq.rid)
    return StepPlan(tuple(scheduled), tuple(preempted), tuple(admitted))


@dataclass
class AggSequence:
    rid: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    first_chunk_at: float | None = None       # start of the step of its first chunk
    prefilled: bool = False                   # its first token sampled

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def view(self) -> SeqView:
        return SeqView(self.rid, self.num_tokens, self.num_computed, len(self.blocks))

    def chunk(self, n: int) -> list[int]:
        c = self.num_computed
        return (self.prompt[c:c + n] if c + n <= len(self.prompt)
                else (self.prompt + self.output)[c:c + n])


@dataclass
class StepResult:
    start: float
    end: float
    items: list[tuple[str, int]]              # (request, token sampled)
    prefilled: list[tuple[str, float, float]]  # (request, first chunk's start, this end)
    finished: list[str]
    preempted: tuple[str, ...]
    decode_contexts: list[int]                # tokens each one-token chunk attends
    chunks: list[tuple[int, int]]             # (tokens, tokens before them) of longer chunks


class AggregatedEngine:
    def __init__(self, model, num_blocks: int, max_batch_tokens: int = 2048,
                 max_batch_size: int = 32, block_size: int = BLOCK_TOKENS):
        if max_batch_size < 1 or max_batch_tokens < max_batch_size or num_blocks < 1:
            raise ValueError(f"aggregated engine: max_batch_size {max_batch_size} must be "
                             f"1..max_batch_tokens {max_batch_tokens}; num_blocks {num_blocks} "
                             f">= 1")
        self.model = model
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))   # lowest ids first out
        self.seqs: dict[str, AggSequence] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []          # admission order: the newest last
        self.busy_s = 0.0
        self.num_preemptions = 0

    def check(self, prompt: list[int], max_tokens: int) -> str | None:
        """Why a request can never be served here, or None (its last token is never
        computed, so it holds at most prompt + max_tokens - 1 tokens)."""
        need = blocks_for(len(prompt) + max_tokens - 1, self.block_size)
        if need > self.num_blocks:
            return (f"{len(prompt)} prompt + {max_tokens} output tokens need {need} KV blocks; "
                    f"the cache has {self.num_blocks}")
        return None

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.seqs[rid] = AggSequence(rid, list(prompt), int(max_tokens))
        self.waiting.append(rid)

    def drop(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        self.free.extend(reversed(seq.blocks))
        if rid in self.running:
            self.running.remove(rid)
        else:
            self.waiting.remove(rid)

    @property
    def held_blocks(self) -> dict[str, int]:
        return {rid: len(s.blocks) for rid, s in self.seqs.items() if s.blocks}

    def plan(self) -> StepPlan:
        return schedule([self.seqs[r].view() for r in self.running],
                        [self.seqs[r].view() for r in self.waiting],
                        max_batch_tokens=self.max_batch_tokens,
                        max_batch_size=self.max_batch_size, free_blocks=len(self.free),
                        block_size=self.block_size)

    def _apply(self, plan: StepPlan, start: float) -> None:
        for rid in plan.preempted:
            seq = self.seqs[rid]
            self.free.extend(reversed(seq.blocks))
            seq.blocks, seq.num_computed = [], 0
            self.running.remove(rid)
            self.waiting.appendleft(rid)
            self.num_preemptions += 1
        for rid in plan.admitted:
            assert self.waiting[0] == rid
            self.running.append(self.waiting.popleft())
        for rid, n in plan.scheduled:
            seq = self.seqs[rid]
            for _ in range(blocks_for(seq.num_computed + n, self.block_size) - len(seq.blocks)):
                seq.blocks.append(self.free.pop())
            if seq.first_chunk_at is None:
                seq.first_chunk_at = start

    def _run(self, group: list[tuple[AggSequence, int]]) -> list[int]:
        """One batched model call over ``group``'s chunks; the greedy token after each."""
        if not group:
            return []
        logits = self.model.extend([s.chunk(n) for s, n in group],
                                   [s.num_computed for s, _ in group], self.cache,
                                   [s.blocks for s, _ in group])
        return logits.argmax(-1).tolist()

    def step(self) -> StepResult | None:
        """Plan, run and retire one step; None when it schedules nothing."""
        start = time.time()
        plan = self.plan()
        if not plan.scheduled:
            return None
        self._apply(plan, start)
        work = [(self.seqs[rid], n) for rid, n in plan.scheduled]
        decodes = [(s, n) for s, n in work if n == 1]
        chunks = [(s, n) for s, n in work if n > 1]
        contexts = [s.num_computed + 1 for s, _ in decodes]
        spans = [(n, s.num_computed) for s, n in chunks]
        sampled = dict(zip([s.rid for s, _ in decodes + chunks],
                           self._run(decodes) + self._run(chunks)))
        items, first, finished = [], [], []
        end = time.time()
        for seq, n in work:
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:          # a chunk short of the prompt's end
                continue
            seq.output.append(sampled[seq.rid])
            items.append((seq.rid, seq.output[-1]))
            if not seq.prefilled:
                seq.prefilled = True
                first.append((seq.rid, seq.first_chunk_at, end))
            if len(seq.output) >= seq.max_tokens:
                finished.append(seq.rid)
        for rid in finished:
            self.drop(rid)
        self.busy_s += end - start
        return StepResult(start, end, items, first, finished, plan.preempted, contexts, spans)
