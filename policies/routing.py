"""Routing: which instance gets a request. Pure functions of the instances' loads.

``route(loads, counter) -> index``: ``loads`` holds each candidate instance's outstanding work
(tokens queued or in flight), ``counter`` is how many requests were routed before (a per-run
count kept by the caller, so the functions stay pure). Adding a policy is one function and one
entry in ``ROUTING``.
"""

from __future__ import annotations

from typing import Callable, Sequence


def round_robin(loads: Sequence[float], counter: int) -> int:
    return counter % len(loads)


def least_loaded(loads: Sequence[float], counter: int) -> int:
    """The instance with the least outstanding work; ties go to the lowest index."""
    best = 0
    for i in range(1, len(loads)):
        if loads[i] < loads[best]:
            best = i
    return best


ROUTING: dict[str, Callable[[Sequence[float], int], int]] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
}
