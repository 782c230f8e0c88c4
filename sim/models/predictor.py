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
  each request's context. A model's sliding-window layers attend to, and read the KV of, at
  most their window of each sequence's context (``ModelSpec.attended_tokens``, a batch's
  sequences taken at its mean context; ``attended_pairs`` for a prompt's causal pairs).
  Grounded terms (``sim.models.efficiency``; each defaults to leave the above unchanged): a
  prompt step's own fixed cost, its attention's own FLOPs rate, host work per decode sequence,
  a latency per ring step of each all-reduce, a share of the all-reduces hidden under the
  roofline, and ``sim.models.rooflines.HostBoundRoofline`` for an engine whose host work runs
  ahead of the devices: a step takes max(host, device) rather than their sum
  (``sim.models.rooflines.roofline`` picks the class from the efficiency). Both engines price steps through the same methods
  (``prefill_time``, ``decode_step_time``, ``mixed_step_time``), so every term reaches both.
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
from typing import Sequence

import numpy as np

from hardware.catalog import DeviceSpec, ModelSpec
from sim.models.efficiency import Efficiency, load_profile, load_profile_table  # noqa: F401

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
        attn_flops_per_ctx = m.attention_flops_per_context_token          # QK^T and AV
        self._weights = m.weight_bytes_read_per_step(weight_format)
        self._weight_format = weight_format
        # KV bytes one step reads per token of context, over all tp devices (MLA's latent is
        # read whole by each)
        self._kv_per_token = m.kv_bytes_per_token(kv_dtype) * (tp if m.kv_replicated else 1)
        self._lm_head_flops = 2.0 * m.embedding_params
        self._body_flops_per_token = 2.0 * (m.linear_params - m.embedding_params)
        self._attn_flops_per_ctx = attn_flops_per_ctx
        # sliding-window layers (0: none): attention and KV reads over ``attended_tokens``
        self._window = m.window
        self._prefill_flops_rate = peak * efficiency.prefill_compute_efficiency
        self._prefill_bytes_rate = bandwidth * efficiency.prefill_memory_efficiency
        self._decode_flops_rate = peak * efficiency.decode_compute_efficiency
        self._decode_bytes_rate = bandwidth * efficiency.decode_memory_efficiency
        self._attn_bytes_rate = bandwidth * (efficiency.decode_attention_efficiency
                                             or efficiency.decode_memory_efficiency)
        self._link = (efficiency.allreduce_bus_gb_s or device.tp_link_gb_s) * 1e9
        attn_eff = efficiency.prefill_attention_efficiency
        self._prefill_attn_rate = None if attn_eff is None else peak * attn_eff
        self._prefill_overhead = efficiency.prefill_overhead_s
        # per all-reduce: its own latency + one hop latency per ring step (+ 0.0: the same float)
        self._allreduce_latency = (efficiency.allreduce_latency_s
                                   + 2.0 * (tp - 1) * efficiency.allreduce_hop_latency_s)
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

    def decode_weight_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of ``batch`` sequences reads: all of them for a dense
        model; a MoE model's experts as its tokens route, expected under uniform routing
        (``ModelSpec.weight_bytes_read_per_step``). A prefill batch reads every expert."""
        if not self.model.num_experts:
            return self._weights
        return self.model.weight_bytes_read_per_step(self._weight_format, batch)

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces per layer of ``tokens`` x hidden bf16 activations: each moves
        2 (tp - 1) / tp of the message at the bus bandwidth, plus its latency and one hop
        latency per ring step."""
        if self.tp == 1:
            return 0.0
        message = tokens * self.model.hidden_size * 2.0
        ring = self._ring_share * message / self._link
        return self._num_allreduces * (self._allreduce_latency + ring)

    def _with_allreduce(self, roof: float, tokens: int) -> float:
        """The roofline plus the step's all-reduces, less the share hidden under the roofline
        (``allreduce_overlap``; 0: they add, as issued on the compute stream)."""
        if self.tp == 1:
            return roof
        comm = self.allreduce_time(tokens)
        overlap = self.eff.allreduce_overlap
        if overlap:
            return roof + comm - overlap * (comm if comm < roof else roof)
        return roof + comm

    def _prefill_compute(self, linear_flops: float, attn_flops: float) -> float:
        """Seconds of a prompt batch's FLOPs: the linear layers' and the causal attention's,
        one rate for both unless ``prefill_attention_efficiency`` gives attention its own."""
        if self._prefill_attn_rate is None:
            return (linear_flops + attn_flops) / self._prefill_flops_rate
        return linear_flops / self._prefill_flops_rate + attn_flops / self._prefill_attn_rate

    def prefill_time(self, prompt_lens: Sequence[int]) -> float:
        if len(prompt_lens) == 1:                      # the common batch at moderate load
            n = prompt_lens[0]
            t = self._single.get(n)
            if t is None:
                t = self._single[n] = self._prefill_time(n, self._pairs([(n, 0)]), 1)
            return t
        return self._prefill_time(sum(prompt_lens), self._pairs([(n, 0) for n in prompt_lens]),
                                  len(prompt_lens))

    def _pairs(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Causal attention pairs of prompt chunks ``(num_tokens, num_context_before)``: n c +
        n (n + 1) / 2 each (twice that is even: exact), past a sliding window
        ``ModelSpec.attended_pairs``."""
        if self._window:
            return sum([self.model.attended_pairs(n, c) for n, c in chunks])
        return float(sum([n * (2 * c + n + 1) for n, c in chunks]) // 2)

    def _prefill_time(self, tokens: int, pairs: float, num_prompts: int) -> float:
        """A batch of ``num_prompts`` prompts, ``tokens`` in all, with ``pairs`` causal
        attention pairs."""
        total = float(tokens)
        compute = self._prefill_compute(
            self._body_flops_per_token * total + self._lm_head_flops * num_prompts,
            self._attn_flops_per_ctx * pairs)
        memory = (self._weights + self._kv_per_token * total) / self._prefill_bytes_rate
        roof = memory if memory > compute else compute                  # max(), no call
        return self._step(self._with_allreduce(roof, int(tokens)), self._prefill_overhead)

    def _step(self, device: float, host: float) -> float:
        """A step of ``device`` seconds on the devices and ``host`` seconds of host work: they
        add (the host prepares, then launches and waits)."""
        return device + host

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
        overhead = self._prefill_overhead
        if batch:
            _, c0, c1, _, m1 = self._decode_lines(batch)
            context = float(sum(decode_contexts))
            if self._window:
                context = self.model.attended_tokens(context, batch)
            compute += c0 + c1 * context
            memory += m1 * context
            overhead += self.eff.decode_per_seq_s * batch
        roof = memory if memory > compute else compute
        return (self._step(self._with_allreduce(roof, int(tokens) + batch), overhead),
                compute >= memory)

    def _chunks_roof(self, prefill_chunks: Sequence[tuple[int, int]]) -> tuple:
        """(tokens, compute s, memory s) of a step's prompt chunks alone."""
        tokens = sum([n for n, _ in prefill_chunks])
        context_read = sum([c for _, c in prefill_chunks])
        if self._window:
            context_read = sum([self.model.attended_tokens(c) for _, c in prefill_chunks])
        total = float(tokens)
        compute = self._prefill_compute(
            self._body_flops_per_token * total + self._lm_head_flops * len(prefill_chunks),
            self._attn_flops_per_ctx * self._pairs(prefill_chunks))
        nbytes = self._weights + self._kv_per_token * (total + context_read)
        return tokens, compute, nbytes / self._prefill_bytes_rate

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
        m0 = self.decode_weight_bytes(batch) / self._decode_bytes_rate
        m1 = self._kv_per_token / self._attn_bytes_rate
        comm = self.allreduce_time(batch)
        if self.eff.allreduce_overlap:        # hidden under the step, at most its weight read
            comm -= self.eff.allreduce_overlap * (comm if comm < m0 else m0)
        return self._decode_const(comm, batch), c0, c1, m0, m1

    def _decode_host(self, batch: int) -> float:
        """Host seconds of a decode step of ``batch`` sequences (+ 0.0 when there is no
        per-sequence cost: the same float)."""
        return self.eff.step_overhead_s + self.eff.decode_per_seq_s * batch

    def _decode_const(self, comm: float, batch: int) -> float:
        """A decode step's part that does not depend on its context: all-reduces and host."""
        return comm + self._decode_host(batch)

    def decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        if self._window:
            contexts = self.model.attended_tokens(contexts, batch)
        return const + np.maximum(c0 + c1 * contexts, m0 + m1 * contexts)

    def decode_step_time(self, batch: int, context: int) -> float:
        const, c0, c1, m0, m1 = self._decode_lines(batch)
        if self._window:
            context = self.model.attended_tokens(context, batch)
        return const + max(c0 + c1 * context, m0 + m1 * context)

    # Past a sliding window a step's attended context stops growing with its total context:
    # the decode sums below, closed forms of two lines, give way to the cumulative sum.
    def decode_time(self, batch: int, context: int, steps: int) -> float:
        if self._window:
            return Predictor.decode_time(self, batch, context, steps)
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
        if self._window:
            return Predictor.decode_steps_within(self, batch, context, steps, elapsed)
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
        if self._window:
            return Predictor.decode_next_boundary(self, batch, context, steps, elapsed)
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
