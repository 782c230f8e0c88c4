"""Routing: which instance gets a request. Pure functions of what the instances hold.

``route(loads, free_blocks, counter) -> index``: ``loads`` holds each candidate instance's
outstanding work (prompt tokens queued on a prefill instance, requests assigned to a decode
instance), ``free_blocks`` its free KV blocks (a prefill instance's send buffer, a decode
instance's pool), ``counter`` how many requests were routed before (a per-run count kept by the
caller, so the functions stay pure and a run is deterministic). Ties go to the lowest index.
Adding a policy is one function and one entry in ``ROUTING``; a user's own is named by import
path (``--policy routing=mymodule:route``, see ``policies``).
"""

from __future__ import annotations

from typing import Callable, Sequence

Route = Callable[[Sequence[float], Sequence[int], int], int]


def round_robin(loads: Sequence[float], free_blocks: Sequence[int], counter: int) -> int:
    """Instances in turn, whatever they hold."""
    return counter % len(loads)


def least_work(loads: Sequence[float], free_blocks: Sequence[int], counter: int) -> int:
    """The instance with the least outstanding work."""
    best = 0
    for i in range(1, len(loads)):
        if loads[i] < loads[best]:
            best = i
    return best


def kv_aware(loads: Sequence[float], free_blocks: Sequence[int], counter: int) -> int:
    """The instance with the most free KV blocks (a request routed there waits least for
    memory); among equals, the least outstanding work."""
    best = 0
    for i in range(1, len(loads)):
        if (free_blocks[i], -loads[i]) > (free_blocks[best], -loads[best]):
            best = i
    return best


def power_of_two(loads: Sequence[float], free_blocks: Sequence[int], counter: int) -> int:
    """Two instances drawn at random, the less loaded of them (Mitzenmacher's power of two
    choices: nearly least-work balance while looking at two instances only); ties go to the
    first draw. The draw is a
    hash of ``counter`` (SplitMix64), so it needs no generator and is the same in every run."""
    n = len(loads)
    if n == 1:
        return 0
    h = _splitmix64(counter)
    a = h % n
    b = (a + 1 + (h >> 32) % (n - 1)) % n          # a second, different instance
    return b if loads[b] < loads[a] else a         # ties: the first draw, so equal loads
                                                   # spread evenly


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


ROUTING: dict[str, Route] = {
    "round_robin": round_robin,
    "least_work": least_work,
    "least_loaded": least_work,       # the name older configs use
    "kv_aware": kv_aware,
    "power_of_two": power_of_two,
}


# -- between pools (``[cluster] kind = "both"``) ------------------------------------------
# The same signature, over the two pools of a mixed cluster, index 0 the aggregated pool and
# 1 the P/D pool: ``loads`` holds each pool's requests in flight per device it holds (so a
# pool of more or faster-to-fill hardware takes more), ``free_blocks`` its free KV blocks.

def pool_share(share: float) -> Route:
    """A fixed share of the requests to pool 0 (the aggregated one), the rest to pool 1,
    spread evenly: request ``counter`` goes to pool 0 when ``floor((counter + 1) share)``
    passes ``floor(counter share)`` (``share`` 0.5: every other one, from the second)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"pool share {share!r} must lie in [0, 1]")

    def route(loads: Sequence[float], free_blocks: Sequence[int], counter: int) -> int:
        return 0 if int((counter + 1) * share) > int(counter * share) else 1

    return route


#: pool routing by name: a policy of ``ROUTING``'s shape, or a factory of one from the
#: aggregated pool's share (``cluster.aggregated_share``)
POOL_ROUTING: dict[str, Callable] = {
    "least_loaded": least_work,       # fewest requests in flight per device
    "share": pool_share,
}
