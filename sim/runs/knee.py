"""The search for a knee by simulation: bracket it, then bisect.

The knee is defined over a sweep's points in ``traces.metrics.knee`` (the highest rate whose
SLO attainment meets the target). Where simulating a grid of rates is too dear (``hawk plan``,
``hawk validate``), the knee is searched instead: ``meets(rate) -> bool`` simulates one rate
and says whether its attainment meets the target; the caller builds it.

- ``bracket_knee``: from a start rate, doubling while the rate meets the target, or halving
  while it misses, until one rate meets and twice it misses.
- ``bisect_knee``: ``steps`` bisections of [a rate that meets, a rate that misses]; the
  midpoints are geometric, so the bracket shrinks by a ratio (hi / lo to its square root per
  step) and the knee is known to a relative precision at any scale. A lower end of 0 (no rate
  known to meet) halves the upper end.
- ``grid_knee``: the knee on a grid of rates (multiples of ``step``) from a sweep's rows: the
  highest swept rate meeting the target, a binary search over the grid rates between it and
  the next swept rate, then ``bisect_knee`` between it and the next grid rate (the paper's
  grid: ``sim.paper.knees``).
- ``search_knee``: both. The rate returned is the highest rate found to meet the target (the
  lower end of the last bracket, never a rate that missed); it is within ``hi / lo`` of the
  crossing. Both searches assume attainment falls as the rate rises: they find *a* crossing,
  which a non-monotone attainment may place below the highest passing rate.
"""

from __future__ import annotations

import math
from typing import Callable

Meets = Callable[[float], bool]


def bisect_knee(meets: Meets, lo: float, hi: float, steps: int) -> tuple[float, float]:
    """(lo, hi) after ``steps`` bisections: ``lo`` meets the target (0: no rate known to),
    ``hi`` misses. ``steps`` simulations."""
    if not 0 <= lo < hi < math.inf:
        raise ValueError(f"a knee bracket needs 0 <= lo < hi < inf, got [{lo}, {hi}]")
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo, hi


def bracket_knee(meets: Meets, rate: float, max_factor: float = 1000.0) -> tuple[float, float]:
    """(lo, hi = 2 lo): ``lo`` meets the target and ``hi`` misses, doubling from ``rate`` when
    it meets, halving when it misses. (inf, inf) when ``max_factor`` x ``rate`` still meets;
    (nan, nan) when ``rate`` / ``max_factor`` still misses."""
    if not 0 < rate < math.inf:
        raise ValueError(f"a knee search starts at a rate > 0, got {rate}")
    if meets(rate):
        lo, hi = rate, 2 * rate
        while meets(hi):
            if hi > max_factor * rate:
                return math.inf, math.inf
            lo, hi = hi, 2 * hi
        return lo, hi
    lo, hi = rate / 2, rate
    while not meets(lo):
        if lo < rate / max_factor:
            return math.nan, math.nan
        lo, hi = lo / 2, lo
    return lo, hi


def search_knee(meets: Meets, rate: float, steps: int, max_factor: float = 1000.0) -> float:
    """The highest rate found to meet the target: bracketed from ``rate``, then ``steps``
    bisections (``hi / lo`` ends at most ``2 ** (2 ** -steps)``). Infinity when
    ``max_factor`` x ``rate`` still meets it, NaN when ``rate`` / ``max_factor`` misses."""
    lo, hi = bracket_knee(meets, rate, max_factor)
    if not math.isfinite(lo):
        return lo
    return bisect_knee(meets, lo, hi, steps)[0]


def grid_index(rate: float, step: float) -> int:
    """``rate`` as a multiple of the grid ``step``; a rate off the grid is refused."""
    k = round(rate / step)
    if k < 1 or abs(k * step - rate) > 1e-9:
        raise ValueError(f"rate {rate:g} req/s is not on the grid (multiples of {step:g} req/s)")
    return k


def grid_rate(k: int, step: float) -> float:
    return round(k * step, 10)


def grid_knee(meets: Meets, rows: list[dict], target: float, step: float,
              bisection_steps: int) -> dict:
    """``{"grid": knee on the grid, "bisected": bisected knee, "bracket": [lo, hi]}`` from
    ``rows`` (``rate`` on the grid, mean ``slo_attainment``) and ``meets(rate)``; at most
    ``log2(gap / step) + bisection_steps`` simulations. No row meets ``target``: NaN (never
    reaches it); every row does: None (beyond the rows: missing)."""
    points = sorted((r["rate"], r["slo_attainment"]) for r in rows)
    passing = [k for k, (_, value) in enumerate(points) if value >= target]
    if not passing:
        return {"grid": math.nan, "bisected": math.nan, "bracket": None}
    if passing[-1] == len(points) - 1:
        return {"grid": None, "bisected": None, "bracket": None}
    lo = grid_index(points[passing[-1]][0], step)
    hi = grid_index(points[passing[-1] + 1][0], step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if meets(grid_rate(mid, step)) else (lo, mid)
    grid, above = grid_rate(lo, step), grid_rate(hi, step)
    if bisection_steps == 0:
        return {"grid": grid, "bisected": grid, "bracket": [grid, above]}
    low, high = bisect_knee(meets, grid, above, bisection_steps)
    return {"grid": grid, "bisected": low, "bracket": [low, high]}
