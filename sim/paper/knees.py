"""Knees as the paper reads them: on its rate grid, and bisected between two of its rates.

The paper's serving figures (HAWK section 6, docs/paper.md: the Chatbot and Summarization
SLO-attainment, P90 TTFT and P90 TPOT figures) sample the request rate every 0.05 req/s:
every rate they name lies on that grid (knees 0.40, 0.60 and 0.65 req/s, the TPOT gap
"narrows at 0.80 req/s"), and Summarization's "difference 7.69%" between GN-HAWK's knee and
GG-Direct's is one 0.05 req/s step over 0.65 (0.05 / 0.65 = 7.69%). The grid's ends are not
given (docs/paper.md section 7); the profile's sweep rates are points of it.

- The **grid knee** is what the paper reports: the highest grid rate whose attainment (the
  mean over seeds) meets the target, found among the swept rates and, where the next swept
  rate is more than one step above it, by a binary search over the grid rates between them.
- The **bisected knee** refines it between the grid knee and the next grid rate
  (``sim.runs.knee.bisect_knee``: the highest rate found to meet the target).
- No swept rate meets the target: both are NaN, measured "never reaches". Every swept rate
  meets it: both are None, a missing value (the knee lies beyond the sweep), which every check
  reads as a failure.
"""

from __future__ import annotations

from typing import Callable

#: the paper's rate grid step (req/s): its serving figures, as above
PAPER_RATE_STEP = 0.05
#: bisections between the grid knee and the next grid rate: 0.05 / 4 = 0.0125 req/s, a quarter
#: of the knee tolerance (sim.paper.checks)
BISECTION_STEPS = 2


def grid_index(rate: float) -> int:
    """``rate`` as a multiple of the paper's grid step; a rate off it is refused."""
    from sim.runs.knee import grid_index as index

    try:
        return index(rate, PAPER_RATE_STEP)
    except ValueError:
        raise ValueError(f"rate {rate:g} req/s is not on the paper's grid (multiples of "
                         f"{PAPER_RATE_STEP:g} req/s)") from None


def refine_knee(meets: Callable[[float], bool], rows: list[dict], target: float = 0.9,
                bisection_steps: int = BISECTION_STEPS) -> dict:
    """``sim.runs.knee.grid_knee`` on the paper's grid: ``{"grid", "bisected", "bracket"}``
    from a sweep's ``rows`` (``rate``, mean ``slo_attainment``) and ``meets(rate)``, which
    simulates one rate; ``bisection_steps=0`` keeps the grid knee."""
    from sim.runs.knee import grid_knee

    return grid_knee(meets, rows, target, PAPER_RATE_STEP, bisection_steps)
