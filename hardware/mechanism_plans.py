"""Each mechanism's transfer plan for one request's KV cache on one TP rank: one builder per
mechanism (``PLAN_BUILDERS``), and the request they all take (``RequestTransfer``).

Each builder returns a ``hardware.transfer_plan.TransferPlan`` for the same request, so the
mechanisms can be compared write for write:

- ``hawk``: the GPU tilizes, packs and regroups pages by destination bank (hardware.transform);
  one write per (layer, K/V, run of adjacent destination blocks, bank).
- ``per_page``: tilized and packed on the GPU, then one write per tile page.
- ``per_gpu_block``: vLLM's NIXL connector, one write per GPU block into a peer's paged cache
  (``merge=True``: Mooncake's connector, runs of adjacent blocks merged).
- ``single_buffer``: the request's tokens, as they are, into one contiguous NPU buffer, then a
  re-layout on the NPU; the buffer loads banks unevenly (``extra["staging_bank_bytes"]``).
- ``host_staged``: device to host, send, host to device, then a re-layout on the NPU.

Source buffers: ``hawk`` reads the send buffer of ``hardware.transform.hawk_transform``,
``per_page`` that of ``page_order_transform``; ``per_gpu_block`` reads the GPU cache layers laid
end to end; ``single_buffer`` and ``host_staged`` read the request's ``[L, 2, T, H, D]`` tokens
packed contiguously in the GPU dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hardware.dram import bank_shares, contiguous_runs, page_location
from hardware.kv_layout import GpuKVSpec, TTKVSpec, check_block_table
from hardware.transfer_plan import TransferPlan


@dataclass(frozen=True)
class RequestTransfer:
    """One request's KV cache moving from one GPU rank to one NPU chip."""

    gpu: GpuKVSpec
    tt: TTKVSpec
    block_table: np.ndarray      # [ceil(T / gpu.block_size)] GPU block ids, token order
    tt_blocks: np.ndarray        # [ceil(T / tt.block_size)] destination TT block ids
    num_tokens: int

    def __post_init__(self) -> None:
        g, t = self.gpu, self.tt
        for name, a, b in (("num_layers", g.num_layers, t.num_layers),
                           ("num_kv_heads", g.num_kv_heads, t.num_kv_heads),
                           ("head size", g.head_size, t.head_dim)):
            if a != b:
                raise ValueError(f"GPU and TT caches differ in {name}: {a} vs {b}")
        table = check_block_table(self.block_table, self.num_tokens, g.block_size, g.num_blocks)
        tt_table = check_block_table(self.tt_blocks, self.num_tokens, t.block_size,
                                     t.max_num_blocks, what="TT block table")
        object.__setattr__(self, "block_table", table)
        object.__setattr__(self, "tt_blocks", tt_table)

    @property
    def num_tensors(self) -> int:
        return 2 * self.gpu.num_layers

    @property
    def token_bytes(self) -> int:
        """Bytes of the request's tokens in the GPU dtype, all layers, K and V (no padding)."""
        g = self.gpu
        return self.num_tensors * self.num_tokens * g.num_kv_heads * g.head_size * g.elem_bytes

    @property
    def page_stride(self) -> int:
        return self.tt.dram.aligned(self.tt.page_bytes)

    @property
    def pages_per_tensor(self) -> int:
        return self.tt_blocks.size * self.tt.pages_per_block


def _tile(template, num_tensors, src_step, dst_base) -> dict:
    """Repeat a one-tensor write template over tensors: columns for ``TransferPlan``."""
    src, region, dst, nbytes = (np.asarray(c, dtype=np.int64) for c in template)
    t = np.arange(num_tensors, dtype=np.int64)[:, None]
    return dict(src_offset=(t * src_step + src).reshape(-1),
                dst_region=np.broadcast_to(region, (num_tensors, region.size)).reshape(-1),
                dst_offset=(np.asarray(dst_base, dtype=np.int64)[:, None] + dst).reshape(-1),
                nbytes=np.broadcast_to(nbytes, (num_tensors, nbytes.size)).reshape(-1))


def _tt_bases(req: RequestTransfer) -> np.ndarray:
    return np.array([req.tt.tensor_base(t // 2, t % 2) for t in range(req.num_tensors)])


def hawk_segments(req: RequestTransfer):
    """One tensor's segments: ``(page_order, bank, first_slot, count)`` per (run, bank).

    ``page_order`` ([pages]) lists the request's pages (numbered within the request, in
    block-table order) in send-buffer order: run by run, bank by bank, slot by slot.
    """
    ppb, n = req.tt.pages_per_block, req.tt.dram.num_banks
    order, banks, slots, counts, done = [], [], [], [], 0
    for start, length in contiguous_runs(req.tt_blocks):
        p0, p1 = start * ppb, (start + length) * ppb
        first, count, slot = bank_shares(p0, p1, n)
        for k in np.flatnonzero(count):
            order.append(first[k] + n * np.arange(count[k]) - p0 + done)
            banks.append(k), slots.append(slot[k]), counts.append(count[k])
        done += p1 - p0
    return (np.concatenate(order), np.array(banks), np.array(slots), np.array(counts))


def hawk_plan(req: RequestTransfer) -> TransferPlan:
    """One write per (tensor, run of adjacent TT blocks, bank) from the regrouped send buffer."""
    _, bank, slot, count = hawk_segments(req)
    stride = req.page_stride
    nbytes = count * stride
    src = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    tensor_bytes = req.pages_per_tensor * stride
    cols = _tile((src, bank, slot * stride, nbytes), req.num_tensors, tensor_bytes, _tt_bases(req))
    return TransferPlan("hawk", src_size=req.num_tensors * tensor_bytes,
                        region_sizes=req.tt.region_sizes, **cols,
                        extra=_transform_extra(req, req.num_tensors * tensor_bytes,
                                               num_runs=len(contiguous_runs(req.tt_blocks))))


def per_page_plan(req: RequestTransfer) -> TransferPlan:
    """One write per tile page, from the page-ordered (not regrouped) send buffer."""
    page = req.tt.page_bytes
    pages = req.tt.block_pages(req.tt_blocks)
    bank, dst = page_location(pages, page, req.tt.dram)
    src = np.arange(pages.size, dtype=np.int64) * page
    cols = _tile((src, bank, dst, np.full(pages.size, page)), req.num_tensors,
                 pages.size * page, _tt_bases(req))
    return TransferPlan("per_page", src_size=req.num_tensors * pages.size * page,
                        region_sizes=req.tt.region_sizes, **cols,
                        extra=_transform_extra(req, req.num_tensors * pages.size * page))


def _transform_extra(req: RequestTransfer, out_bytes: int, **more) -> dict:
    g = req.gpu
    return dict(transform="gpu", transform_in_bytes=req.num_tensors * req.block_table.size
                * g.block_bytes, transform_out_bytes=int(out_bytes), relayout_bytes=0,
                host_copies=0, **more)


def per_gpu_block_plan(req: RequestTransfer, dst_table=None, merge: bool = False) -> TransferPlan:
    """One write per GPU block into a peer GPU's paged cache of the same shape.

    Regions are the peer's per-layer K and V tensors (as vLLM registers them); ``dst_table``
    defaults to blocks ``0..n-1``. ``merge`` joins blocks adjacent on both sides (Mooncake).
    """
    g, table = req.gpu, req.block_table
    dst_table = np.arange(table.size) if dst_table is None else check_block_table(
        dst_table, req.num_tokens, g.block_size, g.num_blocks, what="destination block table")
    src = g.block_offsets(0, 0, table)
    dst = dst_table * g.block_bytes
    size = np.full(table.size, g.block_bytes, dtype=np.int64)
    if merge:
        joined = (np.diff(table) == 1) & (np.diff(dst_table) == 1)
        starts = np.concatenate([[0], np.flatnonzero(~joined) + 1])
        size = np.diff(np.append(starts, table.size)) * g.block_bytes
        src, dst = src[starts], dst[starts]
    num = req.num_tensors
    t = np.arange(num, dtype=np.int64)[:, None]
    src_t = (t // 2) * g.layer_bytes + (t % 2) * g.num_blocks * g.block_bytes + src
    return TransferPlan(
        "per_gpu_block_merged" if merge else "per_gpu_block",
        src_offset=src_t.reshape(-1), dst_region=np.repeat(np.arange(num), src.size),
        dst_offset=np.tile(dst, num), nbytes=np.tile(size, num),
        src_size=g.num_layers * g.layer_bytes,
        region_sizes=(g.num_blocks * g.block_bytes,) * num,
        extra=dict(transform="none", relayout_bytes=0, host_copies=0, merged=merge))


def _tensor_chunks(req: RequestTransfer, base: int, bank_bytes: int):
    """Per-tensor contiguous ranges of the linear staging buffer, cut at bank boundaries."""
    tensor = req.token_bytes // req.num_tensors
    starts, ends = [], []
    for t in range(req.num_tensors):
        lo, hi = base + t * tensor, base + (t + 1) * tensor
        cuts = np.arange((lo // bank_bytes + 1) * bank_bytes, hi, bank_bytes)
        starts.append(np.concatenate([[lo], cuts])), ends.append(np.concatenate([cuts, [hi]]))
    return np.concatenate(starts), np.concatenate(ends)


def single_buffer_plan(req: RequestTransfer, base: int = 0) -> TransferPlan:
    """The tokens as they are into one linear NPU buffer at ``base``, then re-laid out there.

    The buffer's addresses fill bank 0, then bank 1, ...; writes are cut at bank boundaries.
    """
    dram = req.tt.dram
    if base < 0 or base + req.token_bytes > dram.num_banks * dram.bank_bytes:
        raise ValueError(f"staging buffer [{base}, {base + req.token_bytes}) outside the "
                         f"{dram.num_banks * dram.bank_bytes} bytes of DRAM")
    lo, hi = _tensor_chunks(req, base, dram.bank_bytes)
    region, offset = lo // dram.bank_bytes, lo % dram.bank_bytes
    plan_cols = dict(src_offset=lo - base, dst_region=region, dst_offset=offset, nbytes=hi - lo)
    per_bank = np.bincount(region, weights=hi - lo, minlength=dram.num_banks).astype(np.int64)
    out = req.num_tensors * req.pages_per_tensor * req.tt.page_bytes
    return TransferPlan("single_buffer", src_size=req.token_bytes,
                        region_sizes=(dram.bank_bytes,) * dram.num_banks, **plan_cols,
                        extra=dict(transform="npu", relayout_bytes=req.token_bytes,
                                   relayout_out_bytes=out, host_copies=0,
                                   staging_bank_bytes=per_bank.tolist(),
                                   staging_imbalance=float(per_bank.max() / per_bank.mean())))


def host_staged_plan(req: RequestTransfer) -> TransferPlan:
    """Device to host, one send per tensor into the peer host's buffer, host to device, relayout."""
    tensor = req.token_bytes // req.num_tensors
    offsets = np.arange(req.num_tensors, dtype=np.int64) * tensor
    out = req.num_tensors * req.pages_per_tensor * req.tt.page_bytes
    return TransferPlan("host_staged", src_offset=offsets, dst_region=np.zeros_like(offsets),
                        dst_offset=offsets, nbytes=np.full_like(offsets, tensor),
                        src_size=req.token_bytes, region_sizes=(req.token_bytes,),
                        extra=dict(transform="npu", relayout_bytes=req.token_bytes,
                                   relayout_out_bytes=out, host_copies=2,
                                   d2h_bytes=req.token_bytes, h2d_bytes=req.token_bytes))


PLAN_BUILDERS = {
    "hawk": hawk_plan,
    "per_page": per_page_plan,
    "per_gpu_block": per_gpu_block_plan,
    "per_gpu_block_merged": lambda req: per_gpu_block_plan(req, merge=True),
    "single_buffer": single_buffer_plan,
    "host_staged": host_staged_plan,
}


def all_plans(req: RequestTransfer) -> dict[str, TransferPlan]:
    """Every mechanism's plan for the same request, by kind."""
    return {kind: build(req) for kind, build in PLAN_BUILDERS.items()}


def check_disjoint(plan: TransferPlan) -> None:
    """Raise ``ValueError`` if two writes of ``plan`` overlap in a destination region."""
    order = np.lexsort((plan.dst_offset, plan.dst_region))
    region, start = plan.dst_region[order], plan.dst_offset[order]
    end = start + plan.nbytes[order]
    clash = (region[1:] == region[:-1]) & (start[1:] < end[:-1])
    if clash.any():
        i = int(np.flatnonzero(clash)[0])
        raise ValueError(f"plan {plan.kind!r}: writes {order[i]} and {order[i + 1]} overlap in "
                         f"region {region[i]} at byte {start[i + 1]}")


def apply_plan(plan: TransferPlan, src, regions) -> None:
    """Execute ``plan`` in memory: copy its writes from ``src`` into the ``regions`` (uint8)."""
    src = np.asarray(src).reshape(-1).view(np.uint8)
    plan.check_bounds(src.size, [len(r) for r in regions])
    for s, r, d, n in zip(plan.src_offset, plan.dst_region, plan.dst_offset, plan.nbytes):
        regions[r][d:d + n] = src[s:s + n]
