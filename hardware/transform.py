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


def bfp_bytes(tiles: torch.Tensor, mag_bits: int) -> torch.Tensor:
    """float tiles ``[n, 1024]`` -> block-float bytes ``[n, 64 + codes]`` (FACTS.md 2)."""
    n = tiles.shape[0]
    bits = tiles.float().contiguous().view(torch.int32).reshape(n, GROUPS, FACE)
    exp = (bits >> 23) & 0xFF                                          # [n, 64, 16]
    shared = exp.amax(dim=-1, keepdim=True)                            # [n, 64, 1]
    mant = torch.where(exp > 0, (bits & 0x7FFFFF) | 0x800000, torch.zeros_like(bits))
    aligned = mant >> (shared - exp).clamp(max=31)                     # dropped bits are lost
    drop = 24 - mag_bits
    q = aligned >> drop
    rem = aligned & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int32)
    q = q.clamp(max=(1 << mag_bits) - 1)
    sign = (bits >> 31) & 1
    codes = torch.where(q > 0, (sign << mag_bits) | q, torch.zeros_like(q))
    codes = codes.to(torch.uint8).reshape(n, TILE_ELEMS)
    if mag_bits == 3:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)                 # [n, 512]
    return torch.cat([shared.reshape(n, GROUPS).to(torch.uint8), codes], dim=1)


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
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, 0, 0, nb * tt_block_size - tokens.shape[1]))
    return tokens.reshape(2, nb, tt_block_size, h, d).transpose(2, 3)  # [2, nb, H, bs, D]


def _check_layers(layers: Sequence[torch.Tensor], gpu: GpuKVSpec) -> None:
    if len(layers) != gpu.num_layers:
        raise ValueError(f"{len(layers)} layer tensors for a cache of {gpu.num_layers} layers")
    for i, layer in enumerate(layers):
        if tuple(layer.shape) != gpu.physical_shape:
            raise ValueError(f"layer {i} has shape {tuple(layer.shape)}, expected "
                             f"{gpu.physical_shape} ({gpu.order})")


def _transform(layers, req: RequestTransfer, page_order) -> torch.Tensor:
    """Pack every layer's K and V and lay pages out in ``page_order`` (or as they come)."""
    _check_layers(layers, req.gpu)
    device = layers[0].device
    tt = req.tt
    table = _as_tensor(req.block_table, device)
    stride = req.page_stride if page_order is not None else tt.page_bytes
    per_tensor = req.pages_per_tensor * stride
    out = torch.empty(req.num_tensors * per_tensor, dtype=torch.uint8, device=device)
    view = out.view(req.gpu.num_layers, 2, req.pages_per_tensor, stride)   # [L, 2, pages, stride]
    order = None if page_order is None else _as_tensor(page_order, device)
    for i, layer in enumerate(layers):
        kv = gather_tt_blocks(layer, req.gpu, table, req.num_tokens, tt.block_size)
        pages = pack(kv, tt.dtype).reshape(2, req.pages_per_tensor, tt.page_bytes)
        if order is not None:
            pages = pages.index_select(1, order)                        # step 2: bank-major
        view[i, :, :, :tt.page_bytes] = pages
        if stride > tt.page_bytes:
            view[i, :, :, tt.page_bytes:] = 0
    return out


def hawk_transform(layers: Sequence[torch.Tensor], req: RequestTransfer) -> torch.Tensor:
    """The send buffer (uint8, on the layers' device) that ``hawk_plan(req)`` reads from."""
    order, *_ = hawk_segments(req)
    return _transform(layers, req, order)


def page_order_transform(layers: Sequence[torch.Tensor], req: RequestTransfer) -> torch.Tensor:
    """Step 1 only (tilize and pack): the send buffer that ``per_page_plan(req)`` reads from."""
    return _transform(layers, req, None)


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
