"""How far a run of decodes goes: functions over a ``sim.engine.aggregated.AggregatedInstance``
``a`` (its step loop stays there and calls in here for a step of decodes only).

A run ends at the first finish (``a._finishing``), at the last step whose KV blocks can be
had (every decoding request starts a block where its ``base + it`` is a multiple of the block
size: ``a._residues`` counts them by ``base`` modulo it), or, with lazy arrivals, at the first
boundary at or after the next arrival (``a._next_at``). They read ``a.it``, ``a.decoding``,
``a.free_blocks``, ``a.block_size``, ``a.source`` and ``a.predictor`` and change nothing.
"""

from __future__ import annotations


def growth(a, first: int, steps: int) -> int:
    """Blocks the decoding requests start in decode steps ``first`` .. + steps - 1 (the step
    after ``it`` computes token ``base + it + 1``: a new block where base + it is a multiple
    of the block size): every request once per ``block_size`` steps, and for the rest, those
    whose residue is ``-(first - 1 + s) % block_size`` at step s: a run of residues going
    down from ``-(first - 1) % block_size``, wrapping at 0."""
    B, residues = a.block_size, a._residues
    full, rest = divmod(steps, B)
    blocks = full * len(a.decoding)
    if rest:
        top = -(first - 1) % B + 1                # residues top - rest .. top - 1
        low = top - rest
        blocks += (sum(residues[low:top]) if low >= 0 else
                   sum(residues[:top]) + sum(residues[B + low:]))
    return blocks


def run_length(a, decodes: int, context: int, now: float) -> tuple[int, float, bool]:
    """``(steps, seconds, cut)`` of the run of decodes from ``now``: to the first finish,
    the last step whose blocks can be had, and the boundary at or after the next arrival
    (lazy arrivals; then ``cut``: the arrival cuts the run). ``decodes``: the requests
    decoding, ``context``: their first step's total context."""
    it, free = a.it, a.free_blocks
    steps = a._finishing[0][0] - it
    # each decoding request starts at most one block per block_size steps
    if steps > 1 and -(-(steps - 1) // a.block_size) * decodes > free \
            and growth(a, it + 2, steps - 1) > free:
        lo, hi = 1, steps                         # lo steps fit, hi do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if growth(a, it + 2, mid - 1) <= free else (lo, mid)
        steps = lo
    decode_time = a.predictor.decode_time
    duration = decode_time(decodes, context, steps)
    at = a._next_at
    # an arrival past the run's end cuts nothing (decode_next_boundary's j is ``steps``)
    if steps > 1 and a.source is not None and at - now <= duration:
        j, _ = a.predictor.decode_next_boundary(decodes, context, steps, at - now)
        if j < steps:
            return j, decode_time(decodes, context, j), True
    return steps, duration, False
