"""The table predictor: latencies interpolated from measured points (``sim.models.predictor``'s
interface), for a profile calibrated against the real mode (``sim.models.profile_dir``).

Prefill time vs total batch tokens, one piecewise-linear line per batch size in sequences;
decode step time vs total context, one line per batch size, linear between batch sizes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from sim.models.predictor import BATCH_PADDINGS, Predictor


class TablePredictor(Predictor):
    """Interpolates measured latencies.

    Prefill time vs total batch tokens, one piecewise-linear line per batch size in sequences
    (``num_seqs``; one line when every point is a single prompt), linear between lines.
    Decode step time vs total context, one line per batch size, linear between batch sizes.
    Both are extrapolated linearly by their end segments. On a regular grid this is the
    bilinear interpolation of the grid. ``seen`` keeps the span of every axis the run asked
    for, so ``extrapolated()`` can say where a run left the measured ranges.
    With ``batch_padding = "longest"`` (the measured engine pads), a prefill batch is looked
    up at num_seqs x its longest prompt; the decode instance asks for batch x the longest
    context itself (``decode_step_times`` takes the total it is given).
    """

    def __init__(self, prefill_tokens, prefill_s, decode_batches, decode_contexts, decode_s,
                 batch_padding: str = "none"):
        grid = np.asarray(decode_s, dtype=np.float64)
        batches = np.asarray(decode_batches, dtype=np.float64)
        contexts = np.asarray(decode_contexts, dtype=np.float64)
        if grid.shape != (len(batches), len(contexts)):
            raise ValueError(f"decode_s has shape {grid.shape}, expected "
                             f"({len(batches)}, {len(contexts)})")
        tokens = np.asarray(prefill_tokens, dtype=np.float64)
        if len(tokens) < 2 or np.any(np.diff(tokens) <= 0):
            raise ValueError("prefill_tokens must hold >= 2 strictly increasing points")
        if len(contexts) < 1 or np.any(np.diff(contexts) <= 0):
            raise ValueError("decode_contexts must hold strictly increasing points")
        self._init({1.0: (tokens, np.asarray(prefill_s, dtype=np.float64))},
                   {float(b): (contexts, row) for b, row in zip(batches, grid)}, batch_padding)

    @classmethod
    def from_points(cls, prefill: np.ndarray, decode: np.ndarray,
                    batch_padding: str = "none") -> "TablePredictor":
        """From measured rows: ``prefill`` [n, 3] of (num_seqs, batch_tokens, seconds),
        ``decode`` [m, 3] of (batch, total_context, seconds), in any order."""
        self = cls.__new__(cls)
        self._init(_groups(np.asarray(prefill, dtype=np.float64), "prefill num_seqs",
                           "batch_tokens"),
                   _groups(np.asarray(decode, dtype=np.float64), "decode batch",
                           "total_context"), batch_padding)
        return self

    def _init(self, prefill: dict, decode: dict, batch_padding: str) -> None:
        if batch_padding not in BATCH_PADDINGS:
            raise ValueError(f"batch_padding {batch_padding!r}: one of {BATCH_PADDINGS}")
        self.batch_padding = batch_padding
        self.prefill_factor = self.decode_factor = 1.0
        self._prefill, self._decode = _Lines(prefill), _Lines(decode)
        self.ranges = {"prefill_num_seqs": self._prefill.group_range,
                       "prefill_batch_tokens": self._prefill.x_range,
                       "decode_batch": self._decode.group_range,
                       "decode_total_context": self._decode.x_range}
        self.seen: dict[str, list[float]] = {}

    def _see(self, axis: str, low: float, high: float) -> None:
        span = self.seen.get(axis)
        if span is None:
            self.seen[axis] = [low, high]
        else:
            span[0], span[1] = min(span[0], low), max(span[1], high)

    def extrapolated(self) -> dict[str, dict]:
        """Axes the run asked for outside the measured range: {axis: {"measured": [lo, hi],
        "used": [lo, hi]}} (empty when every query fell inside)."""
        out = {}
        for axis, (low, high) in self.seen.items():
            mlow, mhigh = self.ranges[axis]
            if low < mlow or high > mhigh:
                out[axis] = {"measured": [mlow, mhigh], "used": [low, high]}
        return out

    def with_loop_factors(self, prefill: float, decode: float) -> "TablePredictor":
        """Times the serving loop's: every prefill batch ``prefill`` x the table's, every
        decode step ``decode`` x (a measured profile's loop.csv; 1, 1: the engine alone)."""
        for name, value in (("prefill", prefill), ("decode", decode)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} loop factor {value!r}: need a number > 0")
        self.prefill_factor, self.decode_factor = float(prefill), float(decode)
        return self

    def step_cost(self, phase: str, batch: int, longest: float, total: float) -> float:
        """The table's time (no loop factor) for one prefill batch or decode step of ``batch``
        sequences, the longest ``longest`` tokens and all ``total``, padded as the engine
        pads; nothing is recorded in ``seen``."""
        x = batch * longest if self.batch_padding == "longest" else total
        lines = self._prefill if phase == "prefill" else self._decode
        return float(lines(float(batch), np.array([float(x)]))[0])

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        n = float(len(prompt_lens))
        x = n * max(prompt_lens) if self.batch_padding == "longest" else float(sum(prompt_lens))
        self._see("prefill_batch_tokens", x, x)
        self._see("prefill_num_seqs", n, n)
        return self.prefill_factor * float(self._prefill(n, np.array([x]))[0])

    def decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        contexts = np.asarray(contexts, dtype=np.float64)
        if len(contexts):
            self._see("decode_batch", float(batch), float(batch))
            self._see("decode_total_context", float(contexts.min()), float(contexts.max()))
        times = self._decode(float(batch), contexts)
        return times * self.decode_factor if self.decode_factor != 1.0 else times

    def mixed_step_time(self, prefill_chunks: Sequence[tuple[int, int]],
                        decode_contexts: Sequence[int]) -> float:
        """An approximation from the measured phases alone (the table has no mixed points):
        the prefill batch of the chunks' tokens plus the decode step of the sequences, less
        one fixed cost of a step (the weights read and the overhead, taken as the decode
        line's time of one sequence at context 0), and never less than either part. The
        context a chunk attends to is not priced (the prefill points are fresh prompts)."""
        batch = len(decode_contexts)
        decode = (self.decode_step_time(batch, int(sum(decode_contexts))) if batch else 0.0)
        if not prefill_chunks:
            return decode
        prefill = self.prefill_time([n for n, _ in prefill_chunks])
        if not batch:
            return prefill
        fixed = self.decode_factor * float(self._decode(1.0, np.array([0.0]))[0])
        return max(prefill + decode - fixed, prefill, decode)

    @classmethod
    def sample(cls, predictor: Predictor, prefill_tokens, decode_batches,
               decode_contexts) -> "TablePredictor":
        """A table measured from another predictor (for tests and calibration examples)."""
        prefill = [predictor.prefill_time([int(t)]) for t in prefill_tokens]
        grid = [[predictor.decode_step_time(int(b), int(c)) for c in decode_contexts]
                for b in decode_batches]
        return cls(prefill_tokens, prefill, decode_batches, decode_contexts, grid)


def _groups(rows: np.ndarray, group: str, x: str) -> dict:
    """Rows (g, x, y) as {g: (xs, ys)} with xs strictly increasing; ValueError names the axis."""
    if rows.ndim != 2 or rows.shape[1] != 3 or len(rows) == 0:
        raise ValueError(f"{group}: expected rows of (group, {x}, seconds), got shape "
                         f"{rows.shape}")
    out = {}
    for g in np.unique(rows[:, 0]):
        part = rows[rows[:, 0] == g]
        part = part[np.argsort(part[:, 1], kind="stable")]
        if np.any(np.diff(part[:, 1]) <= 0):
            raise ValueError(f"{group} {g:g}: {x} repeats a point")
        out[float(g)] = (part[:, 1], part[:, 2])
    return out


def _line(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys), extrapolated by the end segments (one point: flat).

    Outside the points a step's time never falls as its work grows: an end segment that
    slopes down (noise between two measured points) extrapolates flat (``_Lines`` floors
    what lies below the points at the fastest measured step)."""
    if len(xs) == 1:
        return np.full(len(x), ys[0])
    y = np.interp(x, xs, ys)
    low, high = x < xs[0], x > xs[-1]
    if low.any():
        slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
        y[low] = ys[0] + (x[low] - xs[0]) * slope
    if high.any():
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        y[high] = ys[-1] + (x[high] - xs[-1]) * slope
    return y


class _Lines:
    """y(g, x): a line in x per group g, linear in g between the two nearest groups (the end
    pair outside them)."""

    def __init__(self, groups: dict):
        self.keys = np.array(sorted(groups), dtype=np.float64)
        self.lines = [groups[k] for k in sorted(groups)]
        xs = np.concatenate([xs for xs, _ in self.lines])
        self.group_range = (float(self.keys[0]), float(self.keys[-1]))
        self.x_range = (float(xs.min()), float(xs.max()))
        # no step takes less than the fastest one measured: a noisy table's end segments,
        # extrapolated, would otherwise price a step at less than that (even below zero)
        self.floor = float(min(ys.min() for _, ys in self.lines))

    def __call__(self, g: float, x: np.ndarray) -> np.ndarray:
        return np.maximum(self._unfloored(g, x), self.floor)

    def _unfloored(self, g: float, x: np.ndarray) -> np.ndarray:
        keys, lines = self.keys, self.lines
        if len(keys) == 1:
            return _line(x, *lines[0])
        k = min(max(int(np.searchsorted(keys, g, side="right")) - 1, 0), len(keys) - 2)
        g0, g1 = keys[k], keys[k + 1]
        y0 = _line(x, *lines[k])
        if g == g0:
            return y0
        y1 = _line(x, *lines[k + 1])
        if g0 <= g <= g1:
            return y0 + (g - g0) * (y1 - y0) / (g1 - g0)
        # outside the groups: along the end pair, never falling as the batch grows
        slope = np.maximum((y1 - y0) / (g1 - g0), 0.0)
        return y0 + (g - g0) * slope if g < g0 else y1 + (g - g1) * slope
