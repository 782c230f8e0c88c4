"""Decode-side KV memory pools: where a pulled request's KV cache may land, per DRAM bank.

One interface (the decode instance calls it; "who calls what, when"):

- ``try_reserve(request, num_prompt_tokens, num_output_tokens)`` before pulling a request:
  ``"ok"`` (reserved), ``"wait"`` (not enough free memory now: the request waits, which is
  back-pressure) or ``"oom"`` (enough memory is free in total but the layout cannot be served:
  the request fails as ``failed_out_of_memory``; nothing stays reserved).
- ``relayout_done(request)`` once the KV cache has been re-laid out into its final place (frees
  a single buffer's staging space; a no-op for the other pools, whose ``stages`` is False, so
  callers may skip it).
- ``release(request)`` when the request finishes (or fails after reserving).
- ``fits_ever(num_prompt_tokens, num_output_tokens)``: could an empty pool ever hold it;
  ``fits_ever_many`` answers the same for arrays of lengths (a whole trace at once).
- ``stats()``: per-bank occupancy, imbalance (fullest bank over the mean), peak, counters.

Pools, all in KV blocks of ``block_size`` tokens (prompt + output reserved whole). A request
of n tokens needs ``blocks_for(n)`` of them, or ``kv_blocks(n)`` where a pool is given that
rule (a model with sliding-window layers: ``hardware.catalog.ModelSpec.kv_blocks``):

- ``BlockPool``: today's behaviour (a GPU paged cache; no banks).
- ``HawkPool``: HAWK's layout-aware design (docs/paper.md 4.2). Per-bank receive buffers are the
  NPU's interleaved paged cache itself: every block puts one slot in every bank, so banks fill
  evenly and a reservation only ever waits.
- ``SingleBufferPool``: the rejected design. Each request's raw KV lands in one linear buffer
  of the chip's address space, which runs through bank 0, then bank 1, ... (``hardware.
  allocator.ContiguousAllocator``), until ``relayout_done`` moves it into interleaved blocks,
  which need a free slot at the same place in *every* bank. Staging loads the low banks
  unevenly; interleaved slots left free in the other banks cannot be used, and staging runs
  must be contiguous, so memory fragments until a reservation fails with free room left.

One chip stands for the instance: with tensor parallelism every chip holds the same share of
every block, so all chips fill alike. A slot is one block's share of one bank.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from hardware.kv_layout import blocks_for
from policies.admission import pick_victim

OK, WAIT, OOM = "ok", "wait", "oom"


class BlockPool:
    """``capacity_blocks`` blocks; a request reserves blocks for prompt + output at once.
    Invariant: ``sum(held.values()) + free_blocks == capacity_blocks`` (checked by
    ``sim.engine.decode_state.check_block_pool``)."""

    stages = False        # whether ``relayout_done`` frees anything (a staging buffer)

    def __init__(self, capacity_blocks: int, block_size: int, kv_blocks=None):
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError(f"capacity_blocks {capacity_blocks} and block_size {block_size} "
                             f"must be >= 1")
        self.capacity_blocks, self.block_size = int(capacity_blocks), int(block_size)
        self.kv_blocks = kv_blocks        # num_tokens -> blocks (None: blocks_for)
        self.free_blocks = self.capacity_blocks
        self.held: dict = {}
        self.peak_blocks = 0
        self.num_waits = 0

    def blocks_needed(self, num_prompt_tokens: int, num_output_tokens: int) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks(num_prompt_tokens + num_output_tokens)
        return blocks_for(num_prompt_tokens + num_output_tokens, self.block_size)

    def fits_ever(self, num_prompt_tokens: int, num_output_tokens: int) -> bool:
        return bool(self.fits_ever_many(num_prompt_tokens, num_output_tokens))

    def fits_ever_many(self, num_prompt_tokens, num_output_tokens) -> np.ndarray:
        prompt = np.asarray(num_prompt_tokens, dtype=np.int64)
        return self.blocks_needed(prompt, num_output_tokens) <= self.capacity_blocks

    def try_reserve(self, request, num_prompt_tokens: int, num_output_tokens: int) -> str:
        if request in self.held:
            raise ValueError(f"request {request!r} already holds a reservation")
        need = -(-(num_prompt_tokens + num_output_tokens) // self.block_size)   # blocks_for
        if self.kv_blocks is not None:
            need = int(self.kv_blocks(num_prompt_tokens + num_output_tokens))
        if need > self.free_blocks:
            self.num_waits += 1
            return WAIT
        self.free_blocks -= need
        self.held[request] = need
        if self.capacity_blocks - self.free_blocks > self.peak_blocks:
            self.peak_blocks = self.capacity_blocks - self.free_blocks
        return OK

    def relayout_done(self, request) -> None:
        if request not in self.held:
            raise ValueError(f"request {request!r} holds no reservation")

    def release(self, request) -> None:
        if request not in self.held:
            raise ValueError(f"request {request!r} holds no reservation")
        self.free_blocks += self.held.pop(request)

    def stats(self) -> dict:
        used = self.capacity_blocks - self.free_blocks
        return {"kind": "block", "num_banks": 1, "bank_occupancy": [used / self.capacity_blocks],
                "imbalance": 1.0, "occupancy": used / self.capacity_blocks,
                "peak_occupancy": self.peak_blocks / self.capacity_blocks,
                "num_requests": len(self.held), "num_waits": self.num_waits, "num_oom": 0}


class _BankGrid:
    """``used[bank, slot]``: one chip's banks, each ``slots_per_bank`` block-shares deep."""

    def __init__(self, num_banks: int, slots_per_bank: int, block_size: int, kv_blocks=None):
        if num_banks < 1 or slots_per_bank < 1 or block_size < 1:
            raise ValueError(f"num_banks {num_banks}, slots_per_bank {slots_per_bank} and "
                             f"block_size {block_size} must be >= 1")
        self.num_banks, self.slots_per_bank = int(num_banks), int(slots_per_bank)
        self.block_size, self.kv_blocks = int(block_size), kv_blocks
        self.used = np.zeros((self.num_banks, self.slots_per_bank), dtype=bool)
        self.blocks: dict = {}          # request -> slot columns of its interleaved blocks
        self.peak = np.zeros(self.num_banks)
        self.num_waits = self.num_oom = 0

    def blocks_needed(self, num_prompt_tokens: int, num_output_tokens: int) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks(num_prompt_tokens + num_output_tokens)
        return blocks_for(num_prompt_tokens + num_output_tokens, self.block_size)

    def _take_columns(self, need: int) -> np.ndarray | None:
        """Lowest ``need`` slot columns free in every bank, marked used; None if too few."""
        free = np.flatnonzero(~self.used.any(axis=0))
        if free.size < need:
            return None
        cols = free[:need]
        self.used[:, cols] = True
        return cols

    def _note_peak(self) -> None:
        np.maximum(self.peak, self.used.mean(axis=1), out=self.peak)

    def release(self, request) -> None:
        if request not in self.blocks:
            raise ValueError(f"request {request!r} holds no reservation")
        self.used[:, self.blocks.pop(request)] = False

    def stats(self) -> dict:
        occ = self.used.mean(axis=1)
        return {"num_banks": self.num_banks, "bank_occupancy": occ.tolist(),
                "imbalance": float(occ.max() / occ.mean()) if occ.sum() else 1.0,
                "occupancy": float(occ.mean()), "peak_occupancy": float(self.peak.mean()),
                "peak_bank_occupancy": self.peak.tolist(),
                "interleaved_free_slots": int((~self.used.any(axis=0)).sum()),
                "num_requests": len(self.blocks), "num_waits": self.num_waits,
                "num_oom": self.num_oom}


class HawkPool(BlockPool):
    """Layout-aware per-bank buffers: each block is one slot in every bank; never fails.

    Every block puts the same share in each of ``num_banks`` banks, so the banks fill evenly
    and which slots a request gets does not matter: counting blocks is exact, and per-bank
    occupancy is the pool's occupancy in every bank."""

    def __init__(self, num_banks: int, slots_per_bank: int, block_size: int, kv_blocks=None):
        if num_banks < 1:
            raise ValueError(f"num_banks {num_banks} must be >= 1")
        super().__init__(slots_per_bank, block_size, kv_blocks)
        self.num_banks, self.slots_per_bank = int(num_banks), int(slots_per_bank)

    def stats(self) -> dict:
        used = (self.capacity_blocks - self.free_blocks) / self.capacity_blocks
        peak = self.peak_blocks / self.capacity_blocks
        return {"kind": "hawk", "num_banks": self.num_banks,
                "bank_occupancy": [used] * self.num_banks, "imbalance": 1.0,
                "occupancy": used, "peak_occupancy": peak,
                "peak_bank_occupancy": [peak] * self.num_banks,
                "interleaved_free_slots": self.free_blocks, "num_requests": len(self.held),
                "num_waits": self.num_waits, "num_oom": 0}


class SingleBufferPool(_BankGrid):
    """One linear staging buffer per request (bank 0 first), re-laid out into interleaved blocks.

    ``staging_slots_per_token``: slots of one bank a prompt token's raw KV takes in the linear
    buffer (GPU-layout bytes per token per chip over the bytes of one slot).
    """

    stages = True

    def __init__(self, num_banks: int, slots_per_bank: int, block_size: int,
                 staging_slots_per_token: float, kv_blocks=None):
        super().__init__(num_banks, slots_per_bank, block_size, kv_blocks)
        if not staging_slots_per_token > 0:
            raise ValueError(f"staging_slots_per_token {staging_slots_per_token} must be > 0")
        self.staging_slots_per_token = float(staging_slots_per_token)
        self.staging: dict = {}         # request -> (first linear slot, count)

    def staging_needed(self, num_prompt_tokens):
        """Linear slots a prompt's raw KV takes (an int or an integer array)."""
        slots = np.ceil(np.multiply(num_prompt_tokens, self.staging_slots_per_token))
        return np.maximum(1, slots).astype(np.int64)

    def fits_ever(self, num_prompt_tokens: int, num_output_tokens: int) -> bool:
        return bool(self.fits_ever_many(num_prompt_tokens, num_output_tokens))

    def fits_ever_many(self, num_prompt_tokens, num_output_tokens) -> np.ndarray:
        prompt = np.asarray(num_prompt_tokens, dtype=np.int64)
        blocks = self.blocks_needed(prompt, num_output_tokens)
        staging = self.staging_needed(prompt)
        return (blocks * self.num_banks + staging <= self.used.size) & (
            blocks + -(-staging // self.num_banks) <= self.slots_per_bank)

    def try_reserve(self, request, num_prompt_tokens: int, num_output_tokens: int) -> str:
        if request in self.blocks:
            raise ValueError(f"request {request!r} already holds a reservation")
        blocks = self.blocks_needed(num_prompt_tokens, num_output_tokens)
        staging = int(self.staging_needed(num_prompt_tokens))
        if blocks * self.num_banks + staging > int((~self.used).sum()):
            self.num_waits += 1
            return WAIT
        start = self._first_fit(staging)
        if start is not None:
            self.used.reshape(-1)[start:start + staging] = True
            cols = self._take_columns(blocks)
            if cols is not None:
                self.staging[request] = (start, staging)
                self.blocks[request] = cols
                self._note_peak()
                return OK
            self.used.reshape(-1)[start:start + staging] = False
        self.num_oom += 1
        return OOM

    def _first_fit(self, count: int) -> int | None:
        """Start of the first run of ``count`` free slots in linear (bank-major) order."""
        free = ~self.used.reshape(-1)
        edges = np.diff(np.concatenate([[0], free.astype(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fit = np.flatnonzero(ends - starts >= count)
        return int(starts[fit[0]]) if fit.size else None

    def relayout_done(self, request) -> None:
        if request not in self.blocks:
            raise ValueError(f"request {request!r} holds no reservation")
        if request in self.staging:
            start, count = self.staging.pop(request)
            self.used.reshape(-1)[start:start + count] = False

    def release(self, request) -> None:
        if request in self.blocks:
            self.relayout_done(request)
        super().release(request)

    def stats(self) -> dict:
        return {"kind": "single_buffer", "num_staging": len(self.staging), **super().stats()}


class GrowingKV:
    """On-demand blocks of one decode instance's running requests, kept in closed form.

    Running requests advance in lockstep: request ``i`` holds KV for ``base[i] + t`` tokens in
    step ``t`` of the instance, so it holds ``ceil((base[i] + t) / B)`` blocks then (``B`` the
    block size), of which the pool reserved ``pool.held[i]`` at its pull; the rest is its
    growth, taken from the pool's free blocks without a call per block. Writing
    ``base = B q + rho`` and ``t = B T + tau``, the sum over requests is
    ``sum(q) + n T + #(rho + tau >= 1) + #(rho + tau > B)``: the residues ``rho``, kept
    sorted, answer it by bisection, for any step from the newest join on. An upper bound,
    ``(sum(base) + n (t + B - 1)) // B``, settles most questions in O(1). ``base`` keeps
    admission order (the most recent is the one preempted). Invariants (checked by
    ``sim.engine.decode_state.check_growing_kv``): the sums and residues are ``base``'s.
    """

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.base: dict = {}          # request -> base (tokens at step t: base + t)
        self.sum_base = 0
        self.sum_q = 0                # sum of base // B
        self.residues: list[int] = []   # base % B of each request, sorted (a multiset)
        self.reserved = 0             # blocks the running requests reserved at their pull
        self.newest = 0               # the step of the latest join
        self._step: int | None = None # growth(_step) == _growth, kept through joins and leaves
        self._growth = 0

    def join(self, request, base: int, t: int) -> None:
        self.base[request] = base
        self.sum_base += base
        q, rho = divmod(base, self.block_size)
        self.sum_q += q
        insort(self.residues, rho)
        self.reserved += self.pool.held[request]
        self.newest = t
        if self._step != t:           # in its join step a request holds its reservation
            self._step = None

    def leave(self, request) -> int:
        base = self.base.pop(request)
        self.sum_base -= base
        q, rho = divmod(base, self.block_size)
        self.sum_q -= q
        residues = self.residues
        del residues[bisect_left(residues, rho)]
        held = self.pool.held[request]
        self.reserved -= held
        if self._step is not None:    # less its growth in that step (a comparison, not max())
            grown = -(-(base + self._step) // self.block_size) - held
            if grown > 0:
                self._growth -= grown
        return base

    def growth_upper(self, t: int) -> int:
        n = len(self.base)
        return (self.sum_base + n * (t + self.block_size - 1)) // self.block_size - self.reserved

    def short(self, t: int) -> bool:
        """Whether step ``t`` (from the newest join on) takes more growth than the pool has
        free: the O(1) bound (``growth_upper``, inlined: one call instead of two) settles
        most, else ``growth``."""
        free, b = self.pool.free_blocks, self.block_size
        if (self.sum_base + len(self.base) * (t + b - 1)) // b - self.reserved <= free:
            return False
        return self.growth(t) > free

    def growth(self, t: int) -> int:
        """Blocks held beyond the reservations in step ``t`` (exact; the last step asked is
        remembered, and kept up to date as requests join in it or leave)."""
        if t == self._step:
            return self._growth
        b = self.block_size
        if t < self.newest:                # before a request joined: it holds its reservation
            held = self.pool.held
            g = sum(max(0, -(-(x + t) // b) - held[i]) for i, x in self.base.items())
        else:
            residues, (T, tau) = self.residues, divmod(t, b)
            n = len(residues)
            at_least_one = n - bisect_right(residues, 0) if tau == 0 else n
            g = (self.sum_q + n * T + at_least_one + n - bisect_right(residues, b - tau)
                 - self.reserved)
        self._step, self._growth = t, g
        return g

    def steps_fitting(self, t: int, max_steps: int) -> int:
        """Steps t, t+1, ... (at most ``max_steps``) whose blocks fit: request ``i`` takes a
        block at step ``t + r_i + 1``, ``r_i = -(base_i + t) mod B``, then every ``B`` steps
        (``policies.admission.steps_until_full``, on residues kept sorted as requests join)."""
        if not self.base or self.growth_upper(t + max_steps - 1) <= self.pool.free_blocks:
            return max_steps
        return self.steps_short(t, max_steps)

    def steps_short(self, t: int, max_steps: int) -> int:
        """``steps_fitting`` where the bound says step ``t + max_steps - 1`` may be short."""
        spare = self.pool.free_blocks - self.growth(t)
        if spare < 0:
            return 0
        b, residues = self.block_size, self.residues
        n = len(residues)
        rounds, rest = divmod(spare, n)
        # A request with residue rho has slack r = (s - rho) % b: those with rho <= s first
        # (r = s - rho), then the others (r = s - rho + b), each by rho descending. The
        # first block that does not fit is taken by the request of the (rest+1)-th smallest
        # slack (bisection instead of counting requests per slack: O(log n), not O(b)).
        s = -t % b
        below = bisect_right(residues, s)
        if rest < below:
            r = s - residues[below - 1 - rest]
        else:
            r = s - residues[n - 1 - (rest - below)] + b
        return min(max_steps, rounds * b + r + 1)

    def make_room(self, t: int) -> list:
        """Requests to preempt, most recent first, so that step ``t`` gets its blocks; each
        has left (``leave``); the caller releases their reservations. [(request, base)]
        (The caller asks when the O(1) bound says step ``t`` may be short.)"""
        if not self.base:
            return []
        over, b, held = self.growth(t) - self.pool.free_blocks, self.block_size, self.pool.held
        victims = []
        while over > 0 and self.base:
            v = pick_victim(self.base)
            blocks, h = -(-(self.base[v] + t) // b), held[v]
            over -= blocks if blocks > h else h     # its growth and reservation (no max())
            victims.append((v, self.leave(v)))
        return victims


def make_pool(pool: str, capacity_blocks: int, block_size: int, num_banks: int = 0,
              staging_slots_per_token: float = 0.0, kv_blocks=None):
    """The pool a mechanism names (``sim.models.transfer.Mechanism.pool``) for a decode
    instance; ``kv_blocks``: a request's blocks by its tokens (None: ``blocks_for``)."""
    if pool == "block" or num_banks < 1:
        return BlockPool(capacity_blocks, block_size, kv_blocks)
    if pool == "hawk":
        return HawkPool(num_banks, capacity_blocks, block_size, kv_blocks)
    if pool == "single_buffer":
        return SingleBufferPool(num_banks, capacity_blocks, block_size, staging_slots_per_token,
                                kv_blocks)
    raise ValueError(f"unknown pool {pool!r}; choose 'block', 'hawk' or 'single_buffer'")


def pool_for(config, capacity_blocks: int):
    """The decode pool of a ``RunConfig``: its mechanism's kind, one chip's banks. A model
    with sliding-window layers reserves ``ModelSpec.kv_blocks`` per request where requests
    reserve up front; on-demand growth (``GrowingKV``) counts every layer's blocks."""
    from hardware import catalog
    from policies.admission import ADMISSION
    from sim.models.transfer import mechanism

    cl = config.cluster
    mech = mechanism(cl.link.mechanism)
    model, dev = catalog.model(cl.model), catalog.device(cl.decode.device)
    slot_bytes = model.kv_bytes_per_token(cl.decode.kv_dtype) * cl.decode.block_size / max(
        dev.dram_channels, 1)
    staging = model.kv_bytes_per_token(cl.prefill.kv_dtype) / slot_bytes
    kv_blocks = None
    up_front = mech.pool == "single_buffer" or not ADMISSION[cl.decode.admission].on_demand
    if model.window and up_front:
        block = cl.decode.block_size
        kv_blocks = lambda num_tokens: model.kv_blocks(num_tokens, block)  # noqa: E731
    return make_pool(mech.pool, capacity_blocks, cl.decode.block_size, dev.dram_channels, staging,
                     kv_blocks)
