"""The compute of the two worker kinds, without sockets: what a prefill and a decode worker run.

``PrefillEngine``: a queue of prompts; ``step()`` takes the FCFS head that fits the token
budget, the batch size and the free KV blocks (``policies.batching.fcfs_prefill_batch``, as the
simulator's prefill instance does), prefills it in one batch, holds each request's KV for its
pull (``kv_path.KVSource``) and returns the first tokens. Held KV occupies blocks, so a decode
side that does not pull stops new prefills: back-pressure.

``DecodeEngine``: requests whose KV has landed wait; ``step()`` admits as many as the running
batch has room for (``policies.batching.fcfs_decode_admit``: continuous batching), emits the
first token of each newly admitted request (computed by prefill), runs one decode step for the
others, and retires those that have all their tokens, freeing their blocks.

Both record busy time (seconds spent computing), from which power is estimated where no meter
is readable.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hardware.kv_layout import TTKVSpec, blocks_for
from hardware.model.cache import PagedKVCache
from hardware.serve.kv_path import TILED, BlockPool, KVSink, KVSource
from policies.batching import fcfs_decode_admit, fcfs_prefill_batch


@dataclass
class PrefillJob:
    request_id: str
    prompt: list[int]
    enqueued_at: float = field(default_factory=time.time)


class PrefillEngine:
    def __init__(self, model, num_blocks: int, max_batch_tokens: int = 2048,
                 max_batch_size: int = 16, block_size: int = 16):
        self.model = model
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.pool = BlockPool(num_blocks)
        self.source = KVSource(self.cache, self.pool)
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.queue: deque[PrefillJob] = deque()
        self.busy_s = 0.0
        self.last_lens: list[int] = []        # prompt lengths of the last batch (step logs)

    def check(self, prompt: list[int]) -> str | None:
        """Why ``prompt`` can never be prefilled here, or None."""
        need = blocks_for(len(prompt), self.cache.block_size)
        if len(prompt) > self.max_batch_tokens:
            return f"prompt of {len(prompt)} tokens over the batch budget {self.max_batch_tokens}"
        if need > self.pool.num_blocks:
            return f"prompt needs {need} KV blocks; the prefill cache has {self.pool.num_blocks}"
        return None

    def step(self) -> list[tuple[str, int, float, float]]:
        """Prefill the next batch: ``(request id, first token, start, end)`` per request."""
        jobs = list(self.queue)
        lens = [len(j.prompt) for j in jobs]
        n = fcfs_prefill_batch(range(len(jobs)), lens, self.max_batch_size,
                               self.max_batch_tokens, self.pool.num_free, self.cache.block_size)
        if n == 0:
            return []
        batch = [self.queue.popleft() for _ in range(n)]
        tables = [self.pool.alloc(j.request_id, blocks_for(len(j.prompt), self.cache.block_size))
                  for j in batch]
        self.last_lens = [len(j.prompt) for j in batch]
        start = time.time()
        logits = self.model.prefill([j.prompt for j in batch], self.cache, tables)
        first = logits.argmax(-1).tolist()
        end = time.time()
        self.busy_s += end - start
        for j in batch:
            self.source.hold(j.request_id, len(j.prompt))
        return [(j.request_id, t, start, end) for j, t in zip(batch, first)]


@dataclass
class Sequence:
    request_id: str
    num_prompt_tokens: int
    first_token: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


def make_decode_cache(model, mechanism: str, num_tokens: int, tt_dtype: str = "bfloat8_b",
                      num_banks: int = 8):
    """The decode worker's cache for ``mechanism``: tiled per-bank (GN) or paged (GG), holding
    ``num_tokens`` tokens in all."""
    from hardware.dram import DramConfig
    from hardware.serve.tiled_cache import TiledKVCache

    c = model.config
    if mechanism in TILED:
        dram = DramConfig(num_banks=num_banks, alignment=64, bank_bytes=1 << 40, name="decode")
        spec = TTKVSpec(c.num_hidden_layers, blocks_for(num_tokens, 32), c.num_key_value_heads,
                        c.head_dim, dram, dtype=tt_dtype)
        return TiledKVCache(spec)
    return PagedKVCache.for_model(model, blocks_for(num_tokens, 16), 16)


class DecodeEngine:
    def __init__(self, model, mechanism: str, transport, num_tokens: int,
                 max_request_tokens: int, max_batch_size: int = 32, tt_dtype: str = "bfloat8_b"):
        self.model = model
        self.cache = make_decode_cache(model, mechanism, num_tokens, tt_dtype)
        self.sink = KVSink(mechanism, transport, self.cache, max_request_tokens)
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.busy_s = 0.0
        self.last_contexts: list[int] = []    # tokens each request attended in the last step

    def landed(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def step(self) -> tuple[list[tuple[str, int]], list[str]]:
        """One iteration: ``([(request id, token)], [finished request ids])``."""
        out: list[tuple[str, int]] = []
        stepping = [s for s in self.running if len(s.tokens) < s.max_tokens]
        self.last_contexts = []
        if stepping:
            start = time.time()
            tables = [self.sink.pool.held[s.request_id] for s in stepping]
            positions = [s.num_prompt_tokens + len(s.tokens) - 1 for s in stepping]
            self.last_contexts = [p + 1 for p in positions]
            logits = self.model.decode([s.tokens[-1] for s in stepping], positions,
                                       self.cache, tables)
            self.busy_s += time.time() - start
            for s, t in zip(stepping, logits.argmax(-1).tolist()):
                s.tokens.append(t)
                out.append((s.request_id, t))
        for _ in range(fcfs_decode_admit(len(self.waiting), len(self.running),
                                         self.max_batch_size)):
            s = self.waiting.popleft()
            s.tokens.append(s.first_token)
            out.append((s.request_id, s.first_token))
            self.running.append(s)
        done = [s.request_id for s in self.running if len(s.tokens) >= s.max_tokens]
        self.running = [s for s in self.running if len(s.tokens) < s.max_tokens]
        for rid in done:
            self.sink.free(rid)
        return out, done

    def drop(self, request_id: str) -> None:
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        self.sink.free(request_id)

