"""The KV transfer mechanisms end to end on real bytes, as the paper names them (Figure 9).

Each mechanism is a prefill-side sender (what goes into the send buffer) and a decode-side sink
(where the bytes land and what the receiver does after), run through Algorithm 1
(``hardware.protocol``) on any transport:

- ``GG-Host``: GPU -> host copy of the request's tokens, send to the peer's host buffer,
  host -> GPU copy, scatter into the peer's paged GPU cache.
- ``GN-Host``: the same into an NPU: host buffer, host -> device copy, then the re-layout
  (tilize, pack, interleave over DRAM banks) on the NPU side.
- ``GG-Direct``: the request's GPU blocks straight into the peer's paged GPU cache (one write
  per layer and K/V: runs of adjacent blocks merged, as Mooncake's connector does).
- ``GN-Direct``: the tokens straight into one contiguous NPU buffer, then the re-layout there
  (the design the paper rejects for its uneven bank load).
- ``GN-HAWK``: the transfer-aware transformation on the GPU, then the HAWK plan writes straight
  into the per-bank buffers; nothing left to do on the NPU.

The NPU side is host memory standing in for DRAM banks; its re-layout uses the numpy tile code
(``hardware.tiles``), independent of the torch transformation, so agreement is a real check.
Final bytes: the whole bank buffers (GN) or the request's valid tokens in the paged cache (GG;
block-granular copies also carry the unused tail slots of the last block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hardware.dram import DramConfig, page_location
from hardware.kv_layout import GpuKVSpec, TTKVSpec, gather_tokens, scatter_tokens, to_tt_blocks
from hardware.mechanism_specs import REAL_MECHANISMS
from hardware.transfer_plan import TransferPlan
from hardware.mechanism_plans import RequestTransfer, hawk_plan
from hardware.tiles import bf16_to_f32, pack
from hardware.transport.base import Region, Transport

MECHANISMS = REAL_MECHANISMS        # the names hardware.mechanism_specs marks real
MIB = 1 << 20


def make_request(size_bytes: int, num_layers: int = 4, num_kv_heads: int = 8,
                 head_size: int = 128, num_banks: int = 8, tt_dtype: str = "bfloat16",
                 seed: int = 0) -> RequestTransfer:
    """A request whose KV cache (bf16 tokens, all layers, K and V) is about ``size_bytes``.

    GPU blocks are a seeded permutation (scattered, as in a busy cache); the NPU receives into
    TT blocks ``0..n-1`` of a cache sized to the request.
    """
    per_token = 2 * num_layers * num_kv_heads * head_size * 2
    num_tokens = max(1, int(size_bytes) // per_token)
    gpu_blocks = -(-num_tokens // 16)
    gpu = GpuKVSpec(num_layers, gpu_blocks + 2, num_kv_heads, head_size)
    dram = DramConfig(num_banks=num_banks, alignment=64, bank_bytes=1 << 40, name="bench")
    tt_blocks = -(-num_tokens // 32)
    tt = TTKVSpec(num_layers, tt_blocks, num_kv_heads, head_size, dram, dtype=tt_dtype)
    table = np.random.default_rng(seed).permutation(gpu.num_blocks)[:gpu_blocks]
    return RequestTransfer(gpu, tt, table, np.arange(tt_blocks), num_tokens)


def make_layers(req: RequestTransfer, seed: int = 0, device: str = "cpu"):
    from hardware.transform import make_gpu_cache
    import torch
    return make_gpu_cache(req.gpu, torch.Generator().manual_seed(seed), device=device)


# -- prefill side ----------------------------------------------------------------------------
def send_payload(mechanism: str, layers, req: RequestTransfer):
    """The bytes the prefill side puts in its send buffer for ``mechanism`` (uint8 tensor)."""
    import torch
    from hardware.transform import gather_tokens as gather_tokens_t, hawk_transform

    if mechanism == "GN-HAWK":
        return hawk_transform(layers, req)
    if mechanism == "GG-Direct":
        table = torch.as_tensor(req.block_table, device=layers[0].device)
        blocks = torch.stack([layer.index_select(1, table) for layer in layers])  # [L, 2, n, ...]
        return blocks.contiguous().view(torch.uint8).reshape(-1)
    tokens = gather_tokens_t(layers, req)                                  # [L*2*T*H*D*e] u8
    if mechanism.endswith("-Host"):
        return tokens.to("cpu", copy=True)                                 # device -> host
    if mechanism == "GN-Direct":
        return tokens
    raise ValueError(f"mechanism {mechanism!r}: allowed {', '.join(MECHANISMS)}")


class MechanismSource:
    """Prefill-side source: the request ``"<mechanism>/<anything>"`` is prepared per mechanism."""

    def __init__(self, layers, req: RequestTransfer) -> None:
        self.layers, self.req = layers, req

    def __call__(self, request_id: str, dest: dict):
        from hardware.protocol import Prepared
        mechanism = request_id.split("/")[0]
        if mechanism not in MECHANISMS:
            raise KeyError(request_id)
        return Prepared(send_payload(mechanism, self.layers, self.req),
                        {"mechanism": mechanism, "num_tokens": self.req.num_tokens})


# -- decode side -----------------------------------------------------------------------------
def contiguous_plan(kind: str, req: RequestTransfer, tensor_bytes: int) -> TransferPlan:
    """One write per (layer, K/V) into one contiguous destination region."""
    n = req.num_tensors
    offsets = np.arange(n, dtype=np.int64) * tensor_bytes
    return TransferPlan(kind, offsets, np.zeros(n), offsets, np.full(n, tensor_bytes),
                        n * tensor_bytes, (n * tensor_bytes,))


def tokens_view(buf: np.ndarray, req: RequestTransfer) -> np.ndarray:
    """Token bytes ``[L*2*T*H*D*e]`` as ``[L, 2, T, H, D]`` float32."""
    g = req.gpu
    shape = (g.num_layers, 2, req.num_tokens, g.num_kv_heads, g.head_size)
    if g.dtype == "bfloat16":
        return bf16_to_f32(buf.view("<u2")).reshape(shape)
    return buf.view("<f2" if g.dtype == "float16" else "<f4").astype(np.float32).reshape(shape)


def relayout_to_banks(tokens: np.ndarray, req: RequestTransfer, banks) -> None:
    """The NPU-side re-layout: ``[L, 2, T, H, D]`` -> tilized, packed pages in their banks."""
    tt = req.tt
    pages = tt.block_pages(req.tt_blocks)
    cols = np.arange(tt.page_bytes)
    for layer in range(tt.num_layers):
        for kv in (0, 1):
            packed, _ = pack(to_tt_blocks(tokens[layer, kv], tt.block_size), tt.dtype)
            packed = packed.reshape(-1, tt.page_bytes)                     # [pages, page_bytes]
            bank, off = page_location(pages, tt.page_bytes, tt.dram, tt.tensor_base(layer, kv))
            for b in np.unique(bank):
                sel = bank == b
                banks[b][off[sel, None] + cols] = packed[sel]


class MechanismSink:
    """Decode-side receive buffers for one mechanism and one request shape (a ``Sink``)."""

    def __init__(self, mechanism: str, transport: Transport, req: RequestTransfer) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {mechanism!r}: allowed {', '.join(MECHANISMS)}")
        self.mechanism, self.transport, self.req = mechanism, transport, req
        g, self.held = req.gpu, set()
        self.to_npu = mechanism.startswith("GN")
        self.banks = [np.zeros(s, np.uint8) for s in req.tt.region_sizes] if self.to_npu else []
        self.pool = (np.zeros(g.num_layers * g.layer_bytes, np.uint8) if not self.to_npu
                     else None)                                             # peer GPU cache
        if mechanism == "GN-HAWK":
            self._registered = [transport.register_buffer(b) for b in self.banks]
            self.regions = list(self._registered)
        elif mechanism == "GG-Direct":
            self._registered = [transport.register_buffer(self.pool)]
            self.regions = self._pool_regions(self._registered[0])
        else:                                        # a host buffer or one contiguous buffer
            self.staging = np.zeros(req.token_bytes, np.uint8)
            self._registered = [transport.register_buffer(self.staging)]
            self.regions = list(self._registered)

    def _pool_regions(self, whole: Region) -> list[Region]:
        """The paged cache's per-layer K and V tensors, as vLLM registers them."""
        g = self.req.gpu
        size = g.num_blocks * g.block_bytes
        return [Region(whole.address + g.block_offsets(t // 2, t % 2, [0])[0].item(), size,
                       whole.key, whole.owner) for t in range(self.req.num_tensors)]

    def reserve(self, request_id: str) -> dict:
        self.held.add(request_id)
        return {"mechanism": self.mechanism}

    def plan(self, request_id: str, dest: dict, meta: dict) -> TransferPlan:
        req = self.req
        if self.mechanism == "GN-HAWK":
            return hawk_plan(req)
        if self.mechanism == "GG-Direct":
            n = req.block_table.size * req.gpu.block_bytes              # dst blocks 0..n-1
            plan = contiguous_plan("per_gpu_block_merged", req, n)
            return TransferPlan(plan.kind, plan.src_offset, np.arange(req.num_tensors),
                                np.zeros(req.num_tensors), plan.nbytes, plan.src_size,
                                tuple(r.nbytes for r in self.regions))
        return contiguous_plan(self.mechanism, req, req.token_bytes // req.num_tensors)

    def complete(self, request_id: str, meta: dict) -> None:
        """D6-D7: what the receiver does before the KV cache is usable."""
        if self.mechanism in ("GN-HAWK", "GG-Direct"):
            return
        staged = self.staging.copy() if self.mechanism.endswith("-Host") else self.staging
        if self.to_npu:                                               # host -> device, re-layout
            relayout_to_banks(tokens_view(staged, self.req), self.req, self.banks)
            return
        g = self.req.gpu
        tokens = staged.view(np.uint16 if g.elem_bytes == 2 else np.uint32)
        tokens = tokens.reshape(g.num_layers, 2, self.req.num_tokens, g.num_kv_heads,
                                g.head_size)
        layers = self.pool.view(tokens.dtype).reshape(g.num_layers, *g.physical_shape)
        for i in range(g.num_layers):
            scatter_tokens(layers[i], g, np.arange(self.req.block_table.size), tokens[i])

    def release(self, request_id: str) -> None:
        self.held.discard(request_id)

    def final_bytes(self) -> bytes:
        """What the decode side holds: every bank (GN) or the request's valid tokens (GG)."""
        if self.to_npu:
            return b"".join(b.tobytes() for b in self.banks)
        g = self.req.gpu
        layers = self.pool.view(np.uint16 if g.elem_bytes == 2 else np.uint32)
        layers = layers.reshape(g.num_layers, *g.physical_shape)
        table = np.arange(self.req.block_table.size)
        return b"".join(np.ascontiguousarray(gather_tokens(layers[i], g, table,
                                                           self.req.num_tokens)).tobytes()
                        for i in range(g.num_layers))

    def close(self) -> None:
        for r in self._registered:
            self.transport.release(r)


def expected_bytes(layers, req: RequestTransfer, to_npu: bool) -> bytes:
    """The layout code's own answer: per-page plan over the page-ordered transform (GN), or the
    request's tokens gathered from the prefill cache (GG)."""
    from hardware.mechanism_plans import apply_plan, per_page_plan
    from hardware.transform import gather_tokens as gather_tokens_t, page_order_transform

    if not to_npu:
        return gather_tokens_t(layers, req).cpu().numpy().tobytes()
    banks = [np.zeros(s, np.uint8) for s in req.tt.region_sizes]
    src = page_order_transform(layers, req).cpu()
    apply_plan(per_page_plan(req), src.numpy(), banks)
    return b"".join(b.tobytes() for b in banks)


@dataclass(frozen=True)
class Landing:
    mechanism: str
    latency_s: float            # D1 to the KV cache usable in the decode side's pool
    num_writes: int
    nbytes: int
