"""Batching and admission decisions, as pure functions over queue contents.

The simulator and the real mode's workers call the same functions, so a policy change moves
both. ``fcfs_prefill_batch`` and ``fcfs_decode_admit`` return how many requests to take from the
head of a FCFS queue (the default, and the simulator's fast path).

Prefill batching policies (``PREFILL_BATCHING``) share one signature:

    pick(order, prompt_lens, done, max_batch_size, max_batch_tokens, free_blocks, block_size)
        -> [(request, num_tokens), ...]

``order`` is the queue in the order the requests may be served (arrival order, a deque, or a
fairness policy's order, a list: ``policies.fairness``; iterate it, don't slice it), ``done``
maps a request to the prompt tokens already computed (chunked prefill; absent = 0),
``free_blocks`` the free KV blocks of the send buffer.
A request's whole prompt takes its blocks when its first tokens are scheduled, so a request
already started needs none. The returned pairs are the iteration's batch: each request and the
prompt tokens it computes now; a request leaves the queue when all its tokens are computed.

A policy declares what the simulator may assume of its picks in a ``traits`` attribute
(``BatchingTraits``); a policy without one, a user's own included, gets no assumption: the
simulator asks it for every batch. A user's policy that declares the traits of a policy here
promises to pick as it does, and the simulator takes that policy's fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

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
    room = max_batch_size - num_running              # once per decode boundary: no min/max calls
    if num_waiting < room:
        room = num_waiting
    return room if room > 0 else 0


Pick = Callable[..., list]


@dataclass(frozen=True)
class BatchingTraits:
    """What a prefill batching policy promises about its picks (its ``traits`` attribute).

    ``in_order``: it serves ``order`` as given and stops at the first request that does not
    fit (no overtaking). With whole prompts that is exactly ``fcfs_prefill_batch``'s head of
    the queue; splitting prompts, exactly ``chunked_prefill``'s pick. In arrival order (no
    fairness policy) the simulator then computes the batch itself, without the pick list.
    ``splits_prompts``: a prompt longer than the token budget is served over several
    iterations (else it needs one iteration, and a prompt over the budget is rejected).
    The defaults promise nothing: every batch is the policy's pick."""

    in_order: bool = False
    splits_prompts: bool = False


def traits_of(pick) -> BatchingTraits:
    """The traits ``pick`` declares (none declared: ``BatchingTraits()``, but a bare
    ``splits_prompts = True`` attribute still counts)."""
    traits = getattr(pick, "traits", None)
    if traits is None:
        return BatchingTraits(splits_prompts=bool(getattr(pick, "splits_prompts", False)))
    if not isinstance(traits, BatchingTraits):
        raise TypeError(f"prefill batching policy {getattr(pick, '__name__', pick)!r}: traits "
                        f"must be a policies.batching.BatchingTraits, got {traits!r}")
    return traits


def fcfs_token_budget(order: Sequence[int], prompt_lens: Sequence[int], done: Mapping[int, int],
                      max_batch_size: int, max_batch_tokens: int, free_blocks: int,
                      block_size: int) -> list[tuple[int, int]]:
    """Whole prompts in queue order under the token budget (``fcfs_prefill_batch``)."""
    take = fcfs_prefill_batch(order, prompt_lens, max_batch_size, max_batch_tokens,
                              free_blocks, block_size)
    out = []
    for i in order:
        if len(out) == take:
            break
        out.append((i, prompt_lens[i]))
    return out


def shortest_prompt_first(order: Sequence[int], prompt_lens: Sequence[int],
                          done: Mapping[int, int], max_batch_size: int, max_batch_tokens: int,
                          free_blocks: int, block_size: int) -> list[tuple[int, int]]:
    """Whole prompts, shortest first (ties in queue order), as many as fit. Cuts mean TTFT
    under load; a long prompt waits while shorter ones keep arriving (it can starve)."""
    ranked = sorted(order, key=lambda i: prompt_lens[i])          # stable: ties keep order
    return fcfs_token_budget(ranked, prompt_lens, done, max_batch_size, max_batch_tokens,
                             free_blocks, block_size)


def chunked_prefill(order: Sequence[int], prompt_lens: Sequence[int], done: Mapping[int, int],
                    max_batch_size: int, max_batch_tokens: int, free_blocks: int,
                    block_size: int) -> list[tuple[int, int]]:
    """vLLM's chunked prefill: in queue order, each request computes as many of its remaining
    prompt tokens as the iteration's token budget has left, so a long prompt is split over
    iterations and short prompts behind it start sooner. Stops at the first request whose
    blocks do not fit (no overtaking)."""
    out: list[tuple[int, int]] = []
    budget, blocks = max_batch_tokens, free_blocks
    for i in order:
        if len(out) == max_batch_size or budget == 0:
            break
        computed = done.get(i, 0)
        if computed == 0:
            need = -(-prompt_lens[i] // block_size)            # blocks_for, inlined: hot
            if need > blocks:
                break
            blocks -= need
        n = prompt_lens[i] - computed
        if n > budget:
            n = budget
        out.append((i, n))
        budget -= n
    return out


fcfs_token_budget.traits = BatchingTraits(in_order=True)
shortest_prompt_first.traits = BatchingTraits()             # reorders: the general path
chunked_prefill.traits = BatchingTraits(in_order=True, splits_prompts=True)


PREFILL_BATCHING: dict[str, Pick] = {
    "fcfs": fcfs_token_budget,
    "shortest_prompt_first": shortest_prompt_first,
    "chunked": chunked_prefill,
}
