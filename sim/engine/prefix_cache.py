"""A prefix cache per instance: KV blocks kept by their prefix hash, LRU eviction of free ones.

As vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_manager.py``,
``block_pool.py``) keeps them: a block holds ``block_tokens`` tokens of some prompt and is
named by its hash (the trace's ``hash_ids``, which name a block and the whole prefix before
it). A block referenced by a request on the instance (``ref_count`` > 0) is never evicted.
When the last request holding it ends, it joins the *free* list at the tail and stays
cached: a later prompt with the same prefix hits it (and takes it off the list) until a new
block needs its room, which evicts the list's head, the least recently freed. A request's
blocks are freed in reverse order, so its tail blocks are evicted before its head (vLLM's
``single_type_kv_cache_manager.py``: "Free blocks in reverse order so that the tail blocks
are freed first"). A hit is whole blocks within the first ``num_tokens - 1`` tokens
(``kv_cache_manager.py``: ``max_cache_hit_length = request.num_tokens - 1``).

A disaggregated decode instance may keep one too: it admits a request when it pulls its KV
cache and pulls only the tokens past the hit (vLLM's P/D connectors count the blocks the
decode side has computed before asking the prefill side for the rest).

The protocol, for the instance that owns a cache:

- ``admit(i, num_tokens)`` when request ``i`` is first scheduled (a prefill batch or an
  aggregated step takes it): its leading cached blocks are a hit and are held; its other
  blocks are cached now and held too (vLLM caches a block when it is allocated for the step
  that computes it, so a request scheduled later hits it). Returns the tokens hit: whole
  blocks within the first ``num_tokens - 1`` tokens (vLLM's ``get_computed_blocks`` looks
  no further, so the last token is always computed and a partial last block never hits).
- ``release(i)`` when the request's KV leaves the instance (it ends, is preempted, or the
  decode side has pulled it): its blocks' references drop, and blocks left unreferenced go
  to the free list.

Capacity is in blocks of ``block_tokens``: the instance's KV memory in tokens divided by
``block_tokens``. This is a simplification of the engine's own block pool, named here
because it matters: the engine still allocates every request all its blocks (a shared block
is counted once per request holding it, as if it were a copy), so prefix caching saves
compute, and memory only through the time saved. When every cached block is held, a new
block is not cached (it is computed, and not hittable later).

Counters: ``num_query_tokens`` (prompt tokens of requests admitted) and ``num_hit_tokens``
(of them, found cached); their ratio is the hit rate summaries report, the same ratio as
vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries`` counters.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, hash_ids, block_tokens: int, capacity_blocks: int):
        if block_tokens < 1 or capacity_blocks < 0:
            raise ValueError(f"prefix cache of {capacity_blocks} blocks of {block_tokens} "
                             f"tokens; need block_tokens >= 1 and capacity_blocks >= 0")
        self.hash_ids = hash_ids                # request index -> tuple of block hashes
        self.block_tokens, self.capacity = block_tokens, capacity_blocks
        self.ref_count: dict[int, int] = {}     # every cached block -> requests holding it
        self.free: OrderedDict[int, None] = OrderedDict()   # unheld cached blocks, LRU first
        self.held: dict[int, list[int]] = {}    # request -> the cached blocks it holds
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    def lookup(self, hashes) -> int:
        """Leading blocks of ``hashes`` that are cached."""
        ref_count, k = self.ref_count, 0
        for h in hashes:
            if h not in ref_count:
                break
            k += 1
        return k

    def peek(self, i: int, num_tokens: int) -> int:
        """The tokens ``admit(i, num_tokens)`` would hit now, holding nothing."""
        hit = self.lookup(self.hash_ids[i][:-(-num_tokens // self.block_tokens)])
        return min(hit, (num_tokens - 1) // self.block_tokens) * self.block_tokens

    def admit(self, i: int, num_tokens: int) -> int:
        """Request ``i`` (``num_tokens`` to compute) is scheduled: hold its cached prefix,
        cache the rest of its blocks; the tokens hit (see the module docstring)."""
        hashes = self.hash_ids[i][:-(-num_tokens // self.block_tokens)]
        hit = self.lookup(hashes)
        held = []
        for h in hashes:
            if self._hold(h):
                held.append(h)
        self.held[i] = held
        tokens = min(hit, (num_tokens - 1) // self.block_tokens) * self.block_tokens
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += tokens
        return tokens

    def _hold(self, h: int) -> bool:
        """Take a reference on block ``h``, caching it if it is not (evicting the LRU free
        block when full); False when it cannot be cached (every cached block is held)."""
        count = self.ref_count.get(h)
        if count is None:
            if len(self.ref_count) >= self.capacity:
                if not self.free:
                    return False
                victim, _ = self.free.popitem(last=False)
                del self.ref_count[victim]
                self.num_evictions += 1
            count = 0
        elif count == 0:
            del self.free[h]
        self.ref_count[h] = count + 1
        return True

    def release(self, i: int) -> None:
        """Request ``i``'s KV leaves the instance: drop its references, tail blocks first."""
        held = self.held.pop(i, None)
        if held is None:
            return
        ref_count, free = self.ref_count, self.free
        for h in reversed(held):
            count = ref_count[h] - 1
            ref_count[h] = count
            if count == 0:
                free[h] = None

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def stats(self) -> dict:
        return {"query_tokens": self.num_query_tokens, "hit_tokens": self.num_hit_tokens,
                "evictions": self.num_evictions, "cached_blocks": len(self.ref_count)}

    def leaks(self) -> dict:
        """What is still held (empty once every request admitted has been released)."""
        out = {}
        if self.held:
            out["requests"] = len(self.held)
        pinned = sum(1 for c in self.ref_count.values() if c)
        if pinned:
            out["held_blocks"] = pinned
        return out


def make_cache(trace, block_tokens_capacity: int) -> PrefixCache:
    """A cache for an instance whose KV memory holds ``block_tokens_capacity`` tokens, in the
    trace's hash blocks; a trace without hashes gets one that never hits."""
    hashes = getattr(trace, "hash_ids", None)
    block = getattr(trace, "hash_block_size", 512)
    if hashes is None:
        hashes = [()] * len(trace)
    else:
        hashes = hashes.tolist()
    return PrefixCache(hashes, block, block_tokens_capacity // block)


def totals(caches) -> dict:
    """The caches' counters summed (a run's ``stats["prefix_cache"]``; cells add theirs)."""
    return {"hit_tokens": sum(c.num_hit_tokens for c in caches),
            "query_tokens": sum(c.num_query_tokens for c in caches),
            "evictions": sum(c.num_evictions for c in caches)}


def summary_of(total: dict, side: str = "") -> dict:
    """The run's prefix-cache keys from ``totals``: tokens hit over prompt tokens admitted
    (``side`` "decode_": a decode side's, the tokens it did not pull)."""
    query, hit = total["query_tokens"], total["hit_tokens"]
    return {f"{side}prefix_cache_hit_rate": hit / query if query else 0.0,
            f"{side}prefix_cache_hit_tokens": hit, f"{side}prefix_cache_query_tokens": query,
            f"{side}prefix_cache_evictions": total["evictions"]}
