"""Batching and admission decisions, as pure functions over queue contents.

The simulator and the real mode's workers call the same functions, so a policy change moves
both. Each returns how many requests to take from the head of a FCFS queue.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hardware.kv_layout import blocks_for


def fcfs_prefill_batch(queue: Iterable[int], prompt_lens: Sequence[int], max_batch_size: int,
                       max_batch_tokens: int, free_blocks: int, block_size: int) -> int:
    """vLLM-like prefill batch: the longest head of ``queue`` (request indices into
    ``prompt_lens``) whose prompts fit the token budget, the batch size and the free KV blocks
    of the send buffer. Strict FCFS: stops at the first request that does not fit."""
    taken = tokens = blocks = 0
    for i in queue:
        n = prompt_lens[i]
        need = blocks_for(n, block_size)
        if (taken == max_batch_size or tokens + n > max_batch_tokens
                or blocks + need > free_blocks):
            break
        taken, tokens, blocks = taken + 1, tokens + n, blocks + need
    return taken


def fcfs_decode_admit(num_waiting: int, num_running: int, max_batch_size: int) -> int:
    """Continuous batching: join as many waiting requests as the batch has room for."""
    return max(0, min(num_waiting, max_batch_size - num_running))
