"""Latency predictors: how long a prefill batch or a run of decode iterations takes.

Two predictors share one interface:

- ``RooflinePredictor``: one roofline per step with three terms, compute, memory and
  tensor-parallel communication, from the device and model catalogs and the named efficiency
  factors of a profile file (``sim/profiles/*.toml``). Compute and memory traffic overlap (the
  kernels stream weights while they multiply): their max. The all-reduces do not: vLLM and
  tt-metal issue each one after its row-parallel matmul on the same stream, so it adds.
  Communication is priced once, by the all-reduce term at ``allreduce_bus_gb_s``; the compute
  efficiency is the kernels' own (a published figure for the device), never a factor that
  also absorbs communication.
  A decode step = fixed per-step costs (``step_overhead_s``: scheduling, sampling, dispatch;
  the all-reduces' latency) + max(compute, weights read once + every request's KV read at
  ``decode_attention_efficiency`` of bandwidth), so its time grows with the batch and with
  each request's context.
- ``TablePredictor`` (``sim.models.table``): interpolates measured points (prefill time
  vs batch tokens, decode step vs batch size and context), for calibration against the
  real mode.

Decode fast-forward needs the time of ``k`` iterations of a fixed batch whose total context
grows by ``batch`` tokens per iteration: ``decode_time(batch, context, k)``, and the inverse,
``decode_steps_within(batch, context, k, elapsed)``. The roofline answers both in closed form;
the table predictor with a vectorised cumulative sum. ``decode_step_time`` is the oracle.

An aggregated engine (``sim.engine.aggregated``) runs prompt chunks and decodes in one step:
``mixed_step_time(prefill_chunks, decode_contexts)``, equal to ``prefill_time([n])`` for one
fresh chunk and to ``decode_step_time`` for decodes alone.
"""

from __future__ import annotations

import math
from math import ceil, sqrt
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Sequence

import numpy as np

from hardware.catalog import DeviceSpec, ModelSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Efficiency:
    """Named efficiency factors of one device (a profile file's table)."""

    prefill_compute_efficiency: float
    prefill_memory_efficiency: float
    decode_compute_efficiency: float
    decode_memory_efficiency: float
    step_overhead_s: float
    allreduce_latency_s: float
    allreduce_bus_gb_s: float = 0.0          # ring all-reduce bus bandwidth; 0: the catalog's
                                             # tp_link_gb_s
    decode_attention_efficiency: float = 0.0  # KV reads in decode attention; 0: as the weights
                                             # (decode_memory_efficiency)

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if name in ("allreduce_bus_gb_s", "decode_attention_efficiency"):
                if not (isinstance(value, (int, float)) and 0.0 <= value <= 1e4):
                    raise ValueError(f"profile: {name} = {value} must be >= 0 (0: the default)")
                if name.endswith("efficiency") and value > 1.0:
                    raise ValueError(f"profile: {name} = {value} must be in (0, 1]")
                continue
            if name.endswith("efficiency") and not 0.0 < value <= 1.0:
                raise ValueError(f"profile: {name} = {value} must be in (0, 1]")
            if not name.endswith("efficiency") and not 0.0 <= value <= 10.0:
                raise ValueError(f"profile: {name} = {value} must be in [0, 10] seconds")


@lru_cache(maxsize=None)
def load_profile_table(name: str = "paper") -> dict:
    """The raw tables of profile ``name`` (``sim/profiles/<name>.toml``) or of a TOML path."""
    if name.endswith(".toml"):
        with open(name, "rb") as f:
            return tomllib.load(f)
    path = resources.files("sim").joinpath("profiles", f"{name}.toml")
    if not path.is_file():
        raise ValueError(f"unknown profile {name!r}")
    return tomllib.loads(path.read_text())


def load_profile(name: str = "paper") -> dict[str, Efficiency]:
    """Efficiency factors per device key: the ``[efficiency.<device>]`` tables of a profile."""
    table = load_profile_table(name).get("efficiency", {})
    fields = Efficiency.__dataclass_fields__
    return {key: Efficiency(**{k: v for k, v in value.items() if k in fields})
            for key, value in table.items()}


#: How an engine lays out a batch: ``none``, each sequence costs its own tokens (a batch is
#: priced by its summed prompt tokens, a decode step by its total context); ``longest``, every
#: sequence is padded to the batch's longest (a prefill batch costs num_seqs x its longest
#: prompt, a decode step batch x its longest context: the real workers' batched model).
BATCH_PADDINGS = ("none", "longest")


class Predictor:
    """Interface. Subclasses give ``prefill_time`` and ``decode_step_time``; the decode sums
    default to a vectorised cumulative sum over ``decode_step_times``. ``batch_padding``
    (``BATCH_PADDINGS``) tells the decode instance what total context to ask a step for: the
    summed one, or batch x the longest (that total also grows by ``batch`` per step)."""

    batch_padding = "none"

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        raise NotImplementedError

    def decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        """Step time for each total context in ``contexts`` (vectorised)."""
        raise NotImplementedError

    def mixed_step_time(self, prefill_chunks: Sequence[tuple[int, int]],
                        decode_contexts: Sequence[int]) -> float:
        """One step of an aggregated engine (``sim.engine.aggregated``): prompt chunks
        ``(num_tokens, num_context_before)`` and decode sequences of these contexts (the
        tokens each one's step attends to, its new one included) in the same forward pass.
        A step of decodes only must equal ``decode_step_time(len, sum)``, and one chunk with
        no context before ``prefill_time([num_tokens])``, exactly."""
        raise NotImplementedError

    def mixed_step(self, prefill_chunks: Sequence[tuple[int, int]],
                   decode_contexts: Sequence[int]) -> tuple[float, bool]:
        """(``mixed_step_time``, whether the step is compute-bound): a step with a prompt
        chunk is taken to be, one of decodes only not (a table has no roofline to ask)."""
        return (self.mixed_step_time(prefill_chunks, decode_contexts), bool(prefill_chunks))

    def decode_step_time(self, batch: int, context: int) -> float:
        return float(self.decode_step_times(batch, np.array([context], dtype=np.float64))[0])

    def decode_time(self, batch: int, context: int, steps: int) -> float:
        """Time of ``steps`` iterations starting at total ``context``, growing by ``batch``."""
        return float(self._cumulative(batch, context, steps)[-1]) if steps > 0 else 0.0

    def decode_steps_within(self, batch: int, context: int, steps: int, elapsed: float) -> int:
        """Largest j <= steps whose first j iterations end no later than ``elapsed``."""
        cum = self._cumulative(batch, context, steps)
        return int(np.searchsorted(cum, elapsed, side="right"))

    def decode_next_boundary(self, batch: int, context: int, steps: int,
                             elapsed: float) -> tuple[int, float]:
        """The first iteration boundary at or after ``elapsed`` past the run's start: (j, time
        of j iterations), 1 <= j <= steps (``steps`` when ``elapsed`` lies past the end). The
        run's first iteration has begun at its start, so a change there waits for j = 1."""
        cum = self._cumulative(batch, context, steps)
        j = min(max(int(np.searchsorted(cum, elapsed, side="left")) + 1, 1), steps)
        return j, float(cum[j - 1])

    def _cumulative(self, batch: int, context: int, steps: int) -> np.ndarray:
        contexts = context + batch * np.arange(steps, dtype=np.float64)
        return np.cumsum(self.decode_step_times(batch, contexts))


class RooflinePredictor(Predictor):
    """Roofline timing of one instance: ``tp`` devices of ``device`` serving ``model``."""

    def __init__(self, model: ModelSpec, device: DeviceSpec, tp: int, efficiency: Efficiency,
                 weight_format: str = "bfloat16", kv_dtype: str = "bfloat16"):
        self.model, self.device, self.tp, self.eff = model, device, tp, efficiency
        peak = device.peak_tflops * 1e12 * tp
        bandwidth = device.memory_bandwidth_gb_s * 1e9 * tp
        m = model
        attn_flops_per_ctx = 4.0 * m.num_layers * m.num_heads * m.head_dim   # QK^T and AV
        self._weights = m.weight_bytes_read_per_step(weight_format)
        self._kv_per_token = m.kv_bytes_per_token(kv_dtype)
        self._lm_head_flops = 2.0 * m.embedding_params
        self._body_flops_per_token = 2.0 * (m.linear_params - m.embedding_params)
        self._attn_flops_per_ctx = attn_flops_per_ctx
        self._prefill_flops_rate = peak * efficiency.prefill_compute_efficiency
        self._prefill_bytes_rate = bandwidth * efficiency.prefill_memory_efficiency
        self._decode_flops_rate = peak * efficiency.decode_compute_efficiency
        self._decode_bytes_rate = bandwidth * efficiency.decode_memory_efficiency
        self._attn_bytes_rate = bandwidth * (efficiency.decode_attention_efficiency
                                             or efficiency.decode_memory_efficiency)
        self._link = (efficiency.allreduce_bus_gb_s or device.tp_link_gb_s) * 1e9
        self._lines: dict[int, tuple[float, float, float, float, float]] = {}
        # batch -> (const, m0, m1, m1 * batch, a, 2a, 4a with a = m1 * batch / 2) when the
        # memory line wins every step at any context >= 0 (m0 >= c0 and m1 >= c1: rounding is
        # monotonic, so the same holds for the computed floats), else None: the decode sums
        # take it with one lookup and no comparison of the lines (the same floats).
        self._memory_bound: dict[int, tuple | None] = {}
        self._single: dict[int, float] = {}           # prefill time of one prompt, by length
        self._chunk_roofs: dict[int, tuple] = {}      # mixed_step's one new prompt, by length
        # allreduce_time's factors, each the same float its expression starts with
        self._ring_share = 2.0 * (tp - 1) / tp
        self._num_allreduces = 2 * model.num_layers

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces per layer of ``tokens`` x hidden bf16 activations: each moves
        2 (tp - 1) / tp of the message at the bus bandwidth, plus its latency."""
        if self.tp == 1:
            return 0.0
        message = tokens * self.model.hidden_size * 2.0
        ring = self._ring_share * message / self._link
        return self._num_allreduces * (self.eff.allreduce_latency_s + ring)

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        if len(prompt_lens) == 1:                      # the common batch at moderate load
            n = prompt_lens[0]
            t = self._single.get(n)
            if t is None:
                t = self._single[n] = self._prefill_time(n, n * (n + 1), 1)
            return t
        # causal attention: n (n + 1) / 2 pairs per prompt (each product is even: exact)
        return self._prefill_time(sum(prompt_lens), sum([n * (n + 1) for n in prompt_lens]),
                                  len(prompt_lens))

    def _prefill_time(self, tokens: int, twice_pairs: int, num_prompts: int) -> float:
        """A batch of ``num_prompts`` prompts, ``tokens`` in all, with ``twice_pairs`` / 2
        causal attention pairs."""
        total = float(tokens)
        flops = (self._body_flops_per_token * total + self._lm_head_flops * num_prompts
                 + self._attn_flops_per_ctx * float(twice_pairs // 2))
        nbytes = self._weights + self._kv_per_token * total
        compute, memory = flops / self._prefill_flops_rate, nbytes / self._prefill_bytes_rate
        roof = memory if memory > compute else compute                  # max(), no call
        if self.tp > 1:
            roof += self.allreduce_time(int(tokens))
        return roof + self.eff.step_overhead_s

    def mixed_step_time(self, prefill_chunks: Sequence[tuple[int, int]],
                        decode_contexts: Sequence[int]) -> float:
        """One forward pass of prompt chunks and decode sequences: the weights read once;
        the linear layers' FLOPs of every token (the chunks' at the prefill compute
        efficiency, the decode tokens' at the decode one, as each phase alone is priced);
        each chunk's causal attention over its context and its own tokens, each chunk writing
        its tokens' KV and reading its context's; each decode sequence's KV read; one
        all-reduce of all the step's tokens; one step overhead. With a chunk in the step the
        weights are read at the prefill memory efficiency."""
        return self.mixed_step(prefill_chunks, decode_contexts)[0]

    def mixed_step(self, prefill_chunks: Sequence[tuple[int, int]],
                   decode_contexts: Sequence[int]) -> tuple[float, bool]:
        """(``mixed_step_time``, whether its roofline's compute term exceeds its memory
        term); decodes alone: the decode step's time, memory-bound."""
        batch = len(decode_contexts)
        if not prefill_chunks:
            return (self.decode_step_time(batch, int(sum(decode_contexts))) if batch
                    else 0.0), False
        if len(prefill_chunks) == 1 and prefill_chunks[0][1] == 0:   # often: a new prompt
            n = prefill_chunks[0][0]
            roof = self._chunk_roofs.get(n)
            if roof is None:
                roof = self._chunk_roofs[n] = self._chunks_roof(prefill_chunks)
        else:
            roof = self._chunks_roof(prefill_chunks)
        tokens, compute, memory = roof
        if batch:
            _, c0, c1, _, m1 = self._decode_lines(batch)
            context = float(sum(decode_contexts))
            compute += c0 + c1 * context
            memory += m1 * context
        roof = memory if memory > compute else compute
        if self.tp > 1:
            roof += self.allreduce_time(int(tokens) + batch)
        return roof + self.eff.step_overhead_s, compute >= memory

    def _chunks_roof(self, prefill_chunks: Sequence[tuple[int, int]]) -> tuple:
        """(tokens, compute s, memory s) of a step's prompt chunks alone."""
        tokens = sum([n for n, _ in prefill_chunks])
        # causal pairs of a chunk of n tokens after c: n c + n (n + 1) / 2 (twice: even)
        twice_pairs = sum([n * (2 * c + n + 1) for n, c in prefill_chunks])
        context_read = sum([c for _, c in prefill_chunks])
        total = float(tokens)
        flops = (self._body_flops_per_token * total + self._lm_head_flops * len(prefill_chunks)
                 + self._attn_flops_per_ctx * float(twice_pairs // 2))
        nbytes = self._weights + self._kv_per_token * (total + context_read)
        return tokens, flops / self._prefill_flops_rate, nbytes / self._prefill_bytes_rate

    def _decode_lines(self, batch: int) -> tuple[float, float, float, float, float]:
        """Step time = const + max(c0 + c1 * context, m0 + m1 * context), cached per batch."""
        lines = self._lines.get(batch)
        if lines is None:
            lines = self._lines[batch] = self._compute_lines(batch)
            # memory-bound at context 0 with the steeper line: at every context >= 0
            self._memory_bound[batch] = (self._memory_line_from(batch, 0)
                                         if lines[4] >= lines[2] else None)
        return lines

    def _memory_line_from(self, batch: int, context: int) -> tuple | None:
        """``_memory_bound``'s tuple when the memory line wins every step from ``context``
        on (pm >= pc and qm >= qc), else None."""
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        pc, qc, pm, qm = c0 + c1 * context, c1 * batch, m0 + m1 * context, m1 * batch
        if pm >= pc and qm >= qc:
            a = qm / 2.0
            return const, m0, m1, qm, a, 2.0 * a, 4.0 * a
        return None

    def _compute_lines(self, batch: int) -> tuple[float, float, float, float, float]:
        c0 = (self._body_flops_per_token + self._lm_head_flops) * batch / self._decode_flops_rate
        c1 = self._attn_flops_per_ctx / self._decode_flops_rate
        m0 = self._weights / self._decode_bytes_rate
        m1 = self._kv_per_token / self._attn_bytes_rate
        const = self.allreduce_time(batch) + self.eff.step_overhead_s
        return const, c0, c1, m0, m1

    def decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        return const + np.maximum(c0 + c1 * contexts, m0 + m1 * contexts)

    def decode_step_time(self, batch: int, context: int) -> float:
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        return const + max(c0 + c1 * context, m0 + m1 * context)

    def decode_time(self, batch: int, context: int, steps: int) -> float:
        memory = self._memory_bound.get(batch)
        if memory is not None and context >= 0:      # the usual case: the branch below, short
            const, m0, m1, qm, _, _, _ = memory
            return steps * const + (steps * (m0 + m1 * context) + qm * steps * (steps - 1) / 2.0)
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        p2, q2, last = m0 + m1 * context, m1 * batch, steps - 1
        p1, q1 = c0 + c1 * context, c1 * batch
        if p2 >= p1 and (q2 >= q1 or p2 + q2 * last >= p1 + q1 * last):   # memory-bound
            return steps * const + (steps * p2 + q2 * steps * last / 2.0)
        return steps * const + _sum_max_lines(p1, q1, p2, q2, steps)

    def decode_steps_within(self, batch: int, context: int, steps: int, elapsed: float) -> int:
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        # Step i costs const + max of two lines in i; estimate j from the line that wins at
        # the start (exact while it keeps winning), then correct against the closed form.
        p, q = max((c0 + c1 * context, c1 * batch), (m0 + m1 * context, m1 * batch))
        a, b = q / 2.0, const + p - q / 2.0            # S(j) = a j^2 + b j on that line
        root = (-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a) if a > 0 else elapsed / b
        j = min(max(int(root), 0), steps)
        lo, hi = 0, steps + 1                           # S(lo) <= elapsed < S(hi)
        if self.decode_time(batch, context, j) <= elapsed:
            lo = j
            if j == steps or self.decode_time(batch, context, j + 1) > elapsed:
                return j                                # the usual case: two evaluations
            lo = j + 1
        else:
            hi = j
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_time(batch, context, mid) <= elapsed:
                lo = mid
            else:
                hi = mid
        return lo


    def decode_next_boundary(self, batch: int, context: int, steps: int,
                             elapsed: float) -> tuple[int, float]:
        if elapsed <= 0:
            return 1, self.decode_time(batch, context, 1)
        memory = self._memory_bound.get(batch)
        if memory is None or context < 0:
            memory = self._memory_line_from(batch, context)
        if memory is not None:                 # memory-bound at every step (the usual case)
            const, m0, m1, qm, a, a2, a4 = memory
            pm = m0 + m1 * context
            b = const + pm - a                          # S(j) = a j^2 + b j
            root = (-b + sqrt(b * b + a4 * elapsed)) / a2 if a > 0 else elapsed / b
            j = ceil(root)
            j = 1 if j < 1 else steps if j > steps else j
            last = j - 1
            t = j * const + (j * pm + qm * j * last / 2.0)     # as decode_time sums it
            # the boundary before, summed the same way (a difference could round below it)
            if t >= elapsed and (j == 1 or last * const + (
                    last * pm + qm * last * (last - 1) / 2.0) < elapsed):
                return j, t
        else:
            const, c0, c1, m0, m1 = self._decode_lines(batch)
            pc, qc, pm, qm = c0 + c1 * context, c1 * batch, m0 + m1 * context, m1 * batch
            p, q = (pc, qc) if (pc, qc) > (pm, qm) else (pm, qm)
            a, b = q / 2.0, const + p - q / 2.0        # S(j) on the line winning at first
            root = (-b + sqrt(b * b + 4.0 * a * elapsed)) / (2.0 * a) if a > 0 else elapsed / b
            j = min(max(ceil(root), 1), steps)
            t = self.decode_time(batch, context, j)
            if t >= elapsed and (j == 1 or self.decode_time(batch, context, j - 1) < elapsed):
                return j, t
        j = min(self.decode_steps_within(batch, context, steps, elapsed), steps)
        t = self.decode_time(batch, context, j)
        if t < elapsed and j < steps:
            j += 1
            t = self.decode_time(batch, context, j)
        return j, t


def _sum_arith(p: float, q: float, lo: int, hi: int) -> float:
    """sum_{i=lo}^{hi-1} (p + q i)."""
    n = hi - lo
    return n * p + q * n * (lo + hi - 1) / 2.0 if n > 0 else 0.0


def _sum_max_lines(p1: float, q1: float, p2: float, q2: float, k: int) -> float:
    """sum_{i=0}^{k-1} max(p1 + q1 i, p2 + q2 i) in closed form."""
    last = k - 1
    if p1 >= p2 and p1 + q1 * last >= p2 + q2 * last:   # line 1 wins throughout
        return k * p1 + q1 * k * last / 2.0
    if p2 >= p1 and p2 + q2 * last >= p1 + q1 * last:
        return k * p2 + q2 * k * last / 2.0
    if q1 == q2:
        return _sum_arith(max(p1, p2), q1, 0, k)
    cross = (p2 - p1) / (q1 - q2)           # line 1 >= line 2 on one side of this point
    if q1 > q2:                              # line 1 wins for i >= cross
        m = min(max(math.ceil(cross), 0), k)
        return _sum_arith(p2, q2, 0, m) + _sum_arith(p1, q1, m, k)
    m = min(max(math.floor(cross) + 1, 0), k)    # line 1 wins for i <= cross
    return _sum_arith(p1, q1, 0, m) + _sum_arith(p2, q2, m, k)
