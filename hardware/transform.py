"""The transfer-aware transformation (HAWK, PAPER.md 4.3) in PyTorch, on the cache's own device.

Per layer, K and V together, on the prefill GPU (or CPU when there is none):
  gather the request's GPU blocks -> concatenate tokens -> pad to the TT block size ->
  ``[nb, H, bs, D]`` -> step 1: tilize and pack (bfloat16 / bfloat8_b / bfloat4_b / float32,
  byte-exact with ``hardware.tiles``) -> step 2: regroup the page-ordered tiles by destination
  bank, so each bank's pages are one contiguous segment of the send buffer.
The send buffer's layout is the source side of ``hardware.plans.hawk_plan`` for the same
request. Only device-agnostic torch ops are used, so a CUDA cache is transformed on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hardware.kv_layout import GpuKVSpec
from hardware.plans import RequestTransfer, hawk_segments
from hardware.tiles import FACE, GROUPS, TILE, TILE_ELEMS, tile_format

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tilize(x: torch.Tensor) -> torch.Tensor:
    """``[..., H, W]`` -> ``[n_tiles, 1024]`` in tile element order, zero-padded."""
    *lead, h, w = x.shape
    hp, wp = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    x = x.reshape(-1, h, w)                                            # [L, H, W]
    if (hp, wp) != (h, w):
        x = torch.nn.functional.pad(x, (0, wp - w, 0, hp - h))         # [L, Hp, Wp]
    t = x.reshape(x.shape[0], hp // TILE, 2, FACE, wp // TILE, 2, FACE)  # (L, tr, fr, r, tc, fc, c)
    return t.permute(0, 1, 4, 2, 5, 3, 6).reshape(-1, TILE_ELEMS)    # (L, tr, tc, fr, fc, r, c)


def bf16_bytes(tiles: torch.Tensor) -> torch.Tensor:
    """float tiles ``[n, 1024]`` -> bfloat16 bytes ``[n, 2048]`` (nearest even, NaN -> 0x7FC0)."""
    bf = tiles if tiles.dtype == torch.bfloat16 else tiles.float().to(torch.bfloat16)
    bits = bf.contiguous().view(torch.int16)
    bits = torch.where(torch.isnan(bf), torch.full_like(bits, 0x7FC0), bits)
    return bits.view(torch.uint8).reshape(tiles.shape[0], -1)


def bfp_bytes(tiles: torch.Tensor, mag_bits: int, chunk: int = 256) -> torch.Tensor:
    """float tiles ``[n, 1024]`` -> block-float bytes ``[n, 64 + codes]`` (FACTS.md 2).

    Works ``chunk`` tiles at a time so that the dozen passes stay in cache on a CPU.
    """
    n = tiles.shape[0]
    out = torch.empty((n, GROUPS + TILE_ELEMS * (mag_bits + 1) // 8), dtype=torch.uint8,
                      device=tiles.device)
    for lo in range(0, n, chunk):
        _bfp_chunk(tiles[lo:lo + chunk], mag_bits, out[lo:lo + chunk])
    return out


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0 ** k`` (float32) for integer ``k`` in -126..127, built from its bits."""
    return ((k + 127) << 23).view(torch.float32)


def _bfp_chunk(tiles: torch.Tensor, mag_bits: int, out: torch.Tensor) -> None:
    """Encode in float arithmetic, exactly as the integer recipe of ``hardware.tiles``.

    With ``E`` the group's exponent field, ``floor(|x| * 2^(150 - E))`` is the aligned 24-bit
    significand (bits shifted out dropped); scaling by a power of two is exact, done in two
    factors to stay in float range. Rounding half to even is ``torch.round``.
    """
    n = tiles.shape[0]
    x = tiles.float().reshape(n, GROUPS, FACE)                          # [n, 64, 16]
    a = x.abs()
    top = torch.maximum(a[..., :8], a[..., 8:])                         # tree max: [n, 64, 8]
    for width in (4, 2, 1):
        top = torch.maximum(top[..., :width], top[..., width:])        # ... down to [n, 64, 1]
    shared = top.view(torch.int32) >> 23                                # exponent field E
    k = torch.where(shared > 0, 150 - shared, -252)                    # E = 0: every code is 0
    a.mul_(_pow2(k // 2)).mul_(_pow2(k - k // 2))                      # aligned significand
    a.floor_().mul_(2.0 ** (mag_bits - 24)).round_().clamp_(max=(1 << mag_bits) - 1)
    if bool(((shared > 0) & (shared < 25)).any()):                    # denormals could count
        a.mul_(x.abs() >= 2.0 ** -126)
    q = a.to(torch.int32)                                               # magnitude
    sign = (x.view(torch.int32) >> (31 - mag_bits)) & (1 << mag_bits)   # sign bit at code top
    codes = (q | sign * q.clamp(max=1)).to(torch.uint8).reshape(n, TILE_ELEMS)   # 0 keeps no sign
    if mag_bits == 3:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)                 # [n, 512]
    out[:, :GROUPS] = shared.reshape(n, GROUPS).to(torch.uint8)
    out[:, GROUPS:] = codes


def pack_tiles(tiles: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """``[n, 1024]`` tiles -> ``[n, tile_bytes]`` uint8 in format ``dtype_name``."""
    fmt = tile_format(dtype_name)
    if fmt.is_block_float:
        return bfp_bytes(tiles, fmt.mag_bits)
    if fmt.name == "bfloat16":
        return bf16_bytes(tiles)
    return tiles.float().contiguous().view(torch.uint8).reshape(tiles.shape[0], -1)


def pack(x: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """Torch twin of ``hardware.tiles.pack``: ``[..., H, W]`` -> ``[n_tiles, tile_bytes]``."""
    tile_format(dtype_name)
    return pack_tiles(tilize(x), dtype_name)


def _as_tensor(x, device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.int64, device=device)


def gather_tt_blocks(layer: torch.Tensor, gpu: GpuKVSpec, block_table: torch.Tensor,
                     num_tokens: int, tt_block_size: int) -> torch.Tensor:
    """One layer's GPU cache -> the request's K and V as TT blocks ``[2, nb, H, bs, D]``."""
    blocks = layer.index_select(1, block_table)                        # [2, n, bs, H, D] (NHD)
    if gpu.order == "HND":
        blocks = blocks.transpose(2, 3)                                # [2, n, bs, H, D]
    h, d = gpu.num_kv_heads, gpu.head_size
    tokens = blocks.reshape(2, -1, h, d)[:, :num_tokens]               # [2, T, H, D]
    nb = -(-num_tokens // tt_block_size)
    if nb * tt_block_size != tokens.shape[1]:
        extra = nb * tt_block_size - tokens.shape[1]
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, 0, 0, extra))   # zero tokens
    return tokens.reshape(2, nb, tt_block_size, h, d).transpose(2, 3)  # [2, nb, H, bs, D]


def _check_layers(layers: Sequence[torch.Tensor], gpu: GpuKVSpec) -> None:
    if len(layers) != gpu.num_layers:
        raise ValueError(f"{len(layers)} layer tensors for a cache of {gpu.num_layers} layers")
    for i, layer in enumerate(layers):
        if tuple(layer.shape) != gpu.physical_shape:
            raise ValueError(f"layer {i} has shape {tuple(layer.shape)}, expected "
                             f"{gpu.physical_shape} ({gpu.order})")


def source_units(req: RequestTransfer, page_order=None):
    """Where each tile row piece of the send buffer comes from, for any one layer.

    The layer is read as ``[n, U]`` units of ``U = gcd(head_size, 16)`` elements (a unit never
    straddles a face row or a head). Returns ``(U, index, pad)``: ``index`` ``[2 * pages *
    1024/U]`` int64 gives the source unit of each unit of the layer's output, tiles in
    ``page_order`` (request page numbers; default: as they come) and elements in tile order;
    ``pad`` lists the output units that are tile padding (tokens past the request, or columns
    past the head), which must read as zero.
    """
    g, tt = req.gpu, req.tt
    u = math.gcd(g.head_size, FACE)
    order = np.arange(req.pages_per_tensor) if page_order is None else np.asarray(page_order)
    tiles_w = -(-tt.head_dim // TILE)
    block, local = np.divmod(order, tt.pages_per_block)                 # [S]
    h, rest = np.divmod(local, (tt.block_size // TILE) * tiles_w)
    tr, tc = np.divmod(rest, tiles_w)
    e = np.arange(0, TILE_ELEMS, u)                                     # [1024/U] in tile order
    f, rc = np.divmod(e, FACE * FACE)
    r, c = np.divmod(rc, FACE)
    row = (f // 2) * FACE + r                                          # row in the tile
    col = (f % 2) * FACE + c                                           # column in the tile
    token = (block * tt.block_size + tr * TILE)[:, None] + row         # [S, 1024/U]
    column = (tc * TILE)[:, None] + col
    pad = (token >= req.num_tokens) | (column >= g.head_size)
    token = np.where(pad, 0, token)
    gblock = req.block_table[token // g.block_size]
    offset = token % g.block_size
    head = np.broadcast_to(h[:, None], token.shape)
    kv = np.arange(2)[:, None, None]
    nhd = ((kv * g.num_blocks + gblock) * g.block_size + offset) * g.num_kv_heads + head
    hnd = ((kv * g.num_blocks + gblock) * g.num_kv_heads + head) * g.block_size + offset
    elem = (nhd if g.order == "NHD" else hnd) * g.head_size + np.where(pad, 0, column)
    pad = np.broadcast_to(pad, elem.shape)
    return u, (elem // u).reshape(-1), np.flatnonzero(pad.reshape(-1))


@dataclass(frozen=True)
class GatherIndex:
    """One request's gather, computed once on the host (like its plan) and reused per layer."""

    unit_elems: int          # elements per gathered unit
    index: np.ndarray        # [units per layer] source unit of each output unit
    pad: np.ndarray          # [p] output units that are tile padding
    stride: int              # bytes per page in the send buffer
    page_bytes: int


def prepare(req: RequestTransfer, kind: str = "hawk") -> GatherIndex:
    """The gather for ``hawk`` (pages regrouped by bank) or ``per_page`` (pages as they come)."""
    if kind not in ("hawk", "per_page"):
        raise ValueError(f"transform kind {kind!r}; allowed: 'hawk', 'per_page'")
    order = hawk_segments(req)[0] if kind == "hawk" else None
    u, index, pad = source_units(req, order)
    stride = req.page_stride if kind == "hawk" else req.tt.page_bytes
    return GatherIndex(u, index, pad, stride, req.tt.page_bytes)


def _unit_view(t: torch.Tensor, unit_bytes: int) -> torch.Tensor:
    """``t`` as ``[n, w]`` of the widest integer that divides a unit (faster gathers)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if unit_bytes % size == 0:
            return t.reshape(-1).view(dtype).view(-1, unit_bytes // size)
    return t.reshape(-1).view(torch.uint8).view(-1, unit_bytes)


def _transform(layers, req: RequestTransfer, gather: GatherIndex, out=None) -> torch.Tensor:
    """Gather every layer's K and V straight into tile order and send order, then pack.

    Both data-movement steps (tilize; regroup by bank) are one ``index_select`` of source
    units per layer; packing works per tile, so it commutes with the regrouping. A bfloat16
    cache sent as bfloat16 is gathered directly into the send buffer (bits pass unchanged).
    """
    _check_layers(layers, req.gpu)
    device, tt, dtype = layers[0].device, req.tt, layers[0].dtype
    pages, stride = 2 * req.pages_per_tensor, gather.stride
    size = req.gpu.num_layers * pages * stride
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.numel() != size or out.device != device:
        raise ValueError(f"send buffer must be {size} uint8 bytes on {device}, got "
                         f"{out.numel()} {out.dtype} on {out.device}")
    view = out.view(req.gpu.num_layers, pages, stride)                  # [L, 2 * S, stride]
    if stride > tt.page_bytes:
        view[:, :, tt.page_bytes:] = 0
    index, pad = _as_tensor(gather.index, device), _as_tensor(gather.pad, device)
    unit_bytes = gather.unit_elems * layers[0].element_size()
    direct = tt.dtype == "bfloat16" and dtype == torch.bfloat16 and stride == tt.page_bytes
    units = None if direct else torch.empty(index.numel() * gather.unit_elems, dtype=dtype,
                                            device=device)
    for i, layer in enumerate(layers):
        target = _unit_view(view[i] if direct else units, unit_bytes)
        torch.index_select(_unit_view(layer.contiguous(), unit_bytes), 0, index, out=target)
        if pad.numel():
            target.index_fill_(0, pad, 0)                               # tile padding reads 0
        if not direct:
            view[i, :, :tt.page_bytes] = pack_tiles(units.view(pages, TILE_ELEMS), tt.dtype)
    return out


def _transform_stepwise(layers, req: RequestTransfer, page_order, stride: int) -> torch.Tensor:
    """The paper's steps one at a time (the reference for ``_transform``): gather tokens, pad
    to TT blocks, tilize and pack, then regroup pages by bank."""
    _check_layers(layers, req.gpu)
    device, tt = layers[0].device, req.tt
    table = _as_tensor(req.block_table, device)
    out = torch.zeros(req.gpu.num_layers, 2, req.pages_per_tensor, stride, dtype=torch.uint8,
                      device=device)
    for i, layer in enumerate(layers):
        kv = gather_tt_blocks(layer, req.gpu, table, req.num_tokens, tt.block_size)
        pages = pack(kv, tt.dtype).reshape(2, req.pages_per_tensor, tt.page_bytes)
        if page_order is not None:
            pages = pages.index_select(1, _as_tensor(page_order, device))
        out[i, :, :, :tt.page_bytes] = pages
    return out.view(-1)


def hawk_transform(layers: Sequence[torch.Tensor], req: RequestTransfer, out=None,
                   gather: GatherIndex | None = None) -> torch.Tensor:
    """The send buffer (uint8, on the layers' device) that ``hawk_plan(req)`` reads from.

    ``out``: a preallocated send buffer to fill (e.g. a slice of a registered RDMA region);
    ``gather``: ``prepare(req)``, to reuse it across calls.
    """
    return _transform(layers, req, gather or prepare(req, "hawk"), out)


def page_order_transform(layers: Sequence[torch.Tensor], req: RequestTransfer, out=None,
                         gather: GatherIndex | None = None) -> torch.Tensor:
    """Step 1 only (tilize and pack): the send buffer that ``per_page_plan(req)`` reads from."""
    return _transform(layers, req, gather or prepare(req, "per_page"), out)


def gather_tokens(layers: Sequence[torch.Tensor], req: RequestTransfer) -> torch.Tensor:
    """The request's tokens packed as ``[L, 2, T, H, D]`` in the GPU dtype, as uint8 bytes.

    The source buffer of ``single_buffer_plan`` and ``host_staged_plan``.
    """
    _check_layers(layers, req.gpu)
    table = _as_tensor(req.block_table, layers[0].device)
    parts = []
    for layer in layers:
        blocks = layer.index_select(1, table)
        if req.gpu.order == "HND":
            blocks = blocks.transpose(2, 3)
        parts.append(blocks.reshape(2, -1, req.gpu.num_kv_heads, req.gpu.head_size)
                     [:, :req.num_tokens])
    return torch.stack(parts).contiguous().view(torch.uint8).reshape(-1)


def apply_plan(plan, src: torch.Tensor, regions: Sequence[torch.Tensor]) -> None:
    """Execute ``plan`` with torch copies (any device): ``src`` and ``regions`` are uint8."""
    plan.check_bounds(src.numel(), [r.numel() for r in regions])
    for s, r, d, n in zip(plan.src_offset.tolist(), plan.dst_region.tolist(),
                          plan.dst_offset.tolist(), plan.nbytes.tolist()):
        regions[r][d:d + n].copy_(src[s:s + n])


def make_gpu_cache(gpu: GpuKVSpec, generator: torch.Generator | None = None,
                   device="cpu") -> list[torch.Tensor]:
    """Random layers of a GPU paged cache (normal values) in ``gpu.dtype`` on ``device``."""
    dtype = TORCH_DTYPES[gpu.dtype]
    return [torch.randn(gpu.physical_shape, generator=generator).to(device=device, dtype=dtype)
            for _ in range(gpu.num_layers)]
