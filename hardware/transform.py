"""The transfer-aware transformation (docs/paper.md 4.3) in PyTorch, on the cache's own device.

Per layer, K and V together, on the prefill GPU (or CPU when there is none):
  gather the request's GPU blocks -> concatenate tokens -> pad to the TT block size ->
  ``[nb, H, bs, D]`` -> step 1: tilize and pack (bfloat16 / bfloat8_b / bfloat4_b / float32,
  byte-exact with ``hardware.tiles``) -> step 2: regroup the page-ordered tiles by destination
  bank, so each bank's pages are one contiguous segment of the send buffer.
The send buffer's layout is the source side of ``hardware.mechanism_plans.hawk_plan`` for the same
request. Only device-agnostic torch ops are used, so a CUDA cache is transformed on the GPU.

How it runs (head size a multiple of 32): one ``index_select`` of 16-token pieces (long
contiguous copies) builds the request's tokens. Where the send rows hold the values as they are
(bfloat16 from a bfloat16 cache, float32) and contiguous, one ``index_select`` of face rows (16
elements, 32 bytes in bfloat16) per tensor tilizes them and regroups them by bank at once: the
index, built with the plan, lists each send row's face rows. With padded rows, one strided
``copy_`` tilizes them and, where a run's send rows are affine in the tile coordinates (a run
that starts at bank 0 and fills whole bank rows), regroups them in the same copy; else whole
pages are reordered after it. Block floats go a batch of TT blocks at a time: one strided copy
tilizes the batch into a small float32 buffer (widening bfloat16 as it goes), and packing
writes each tile straight into its send row through a strided view, so there is no separate
regroup pass. Where the rows are not affine, tiles are packed in page order and whole pages
reordered with one ``index_select``. The gather index (``prepare``, built once per request)
lives in ``hardware.gather_index``; packing (tile formats, the short block-float recipe and
its integer fallback) in ``hardware.tile_torch``.
``_transform_stepwise`` is the paper's steps one by one.

On the CPU the fused C++ kernel of ``hardware.layout_kernel`` (built on first use) replaces all
of the above where it applies: it reads each send row's tile rows straight from the layer
(``TileGather.sources``) and writes the packed row once, byte for byte the same. Where it
cannot be built, or with ``HAWK_TRANSFORM_KERNEL=0``, the eager torch path runs.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from hardware import layout_kernel
from hardware.gather_index import GatherIndex, TileGather, UnitGather, prepare
from hardware.kv_layout import GpuKVSpec, blocks_for
from hardware.mechanism_plans import RequestTransfer
from hardware.tile_torch import NARROW_FLOATS, Scratch, pack, pack_rows, pack_tiles
from hardware.tiles import FACE, TILE, TILE_ELEMS, tile_format

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PACK_BATCH_TILES = 512     # tiles tilized and packed at a time (float32: 2 MiB of scratch)


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
    nb = blocks_for(num_tokens, tt_block_size)
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


def _unit_view(t: torch.Tensor, unit_bytes: int) -> torch.Tensor:
    """``t`` as ``[n, w]`` of the widest integer that divides a unit (faster gathers)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if unit_bytes % size == 0:
            return t.reshape(-1).view(dtype).view(-1, unit_bytes // size)
    return t.reshape(-1).view(torch.uint8).view(-1, unit_bytes)


def _direct_dtype(dtype_name: str, cache_dtype: torch.dtype, view: torch.Tensor):
    """The dtype whose values a copy can write straight into the send rows, or None."""
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype_name)
    if target is torch.bfloat16 and cache_dtype != torch.bfloat16:
        return None                                 # a narrowing cast: pack_tiles rounds it
    size = 4 if target is torch.float32 else 2
    if target is None or view.shape[-1] % size or view.storage_offset() % size:
        return None
    return target


def _tile_source(tokens: torch.Tensor, order: str, nb: int, heads: int, tr: int, tw: int):
    """The token buffer as ``[2, nb, H, TR, TW, 2, 2, 16, 16]``: tiles in page order."""
    if order == "NHD":
        t = tokens.view(2, nb, tr, 2, FACE, heads, tw, 2, FACE)      # (kv, b, tr, fr, r, h, tc, fc, c)
        return t.permute(0, 1, 5, 2, 6, 3, 7, 4, 8)
    t = tokens.view(2, nb, tr, 2, heads, FACE, tw, 2, FACE)          # (kv, b, tr, fr, h, r, tc, fc, c)
    return t.permute(0, 1, 4, 2, 6, 3, 7, 5, 8)


def _zero_tail(tokens: torch.Tensor, order: str, num_tokens: int, heads: int) -> None:
    """Zero the token buffer's tokens past the request (the last TT block's padding)."""
    if order == "NHD":
        tokens[:, num_tokens:] = 0
        return
    t = tokens.view(2, tokens.shape[1] // FACE, heads, FACE, -1)      # [2, pieces, H, 16, D]
    full, part = divmod(num_tokens, FACE)
    if part:
        t[:, full, :, part:] = 0
    t[:, full + (part > 0):] = 0


def _run_rows(rows: torch.Tensor, run, b0: int, b1: int, tile_dims: tuple, inner: tuple,
              inner_strides: tuple) -> torch.Tensor:
    """The send ``rows`` of TT blocks ``b0..b1`` of ``run`` as ``[2, b1 - b0, H, TR, TW] +
    inner``: ``run`` is ``(first, end, row, row strides over (block, head, tile row, tile
    column))`` and ``rows`` holds K's rows, then V's."""
    lo, _, base, strides = run
    per_tensor, step = rows.shape[0] // 2, rows.stride(0)
    size = (2, b1 - b0) + tuple(tile_dims) + inner
    stride = (per_tensor * step,) + tuple(s * step for s in strides) + inner_strides
    first = base + (b0 - lo) * strides[0]
    return rows.as_strided(size, stride, rows.storage_offset() + first * step)


def _place(src: torch.Tensor, rows: torch.Tensor, tg: TileGather) -> None:
    """Copy the tiles ``src`` [2, nb, H, TR, TW, 2, 2, 16, 16] into their send ``rows``."""
    if tg.runs is None:                                                 # tilize, then reorder
        tiles = src.reshape(-1, TILE_ELEMS)
        order = _as_tensor(tg.rows, tiles.device)
        if rows.dtype == tiles.dtype and rows.shape[1] == TILE_ELEMS:
            torch.index_select(tiles, 0, order, out=rows)
        else:
            rows[:, :TILE_ELEMS] = tiles.index_select(0, order)
        return
    for run in tg.runs:                                                 # one strided copy a run
        lo, hi = run[:2]
        _run_rows(rows, run, lo, hi, src.shape[2:5], (2, 2, FACE, FACE),
                  (512, 256, FACE, 1)).copy_(src[:, lo:hi])


def _pack_blocks(src: torch.Tensor, rows: torch.Tensor, tg: TileGather, dtype_name: str,
                 work: torch.Tensor, scratch, narrow: bool) -> None:
    """Tilize and pack the tiles ``src`` [2, nb, H, TR, TW, 2, 2, 16, 16] into their send
    ``rows`` [2 * S, page_bytes], a batch of TT blocks at a time: one strided copy into
    ``work`` (widening bfloat16 / float16 to float32 when ``narrow``), then packing straight
    into the batch's send rows. Unaligned banks (no ``runs``): pack in page order, then
    reorder whole pages."""
    tile_dims = tuple(src.shape[2:5])                                   # (H, TR, TW)
    per_block = 2 * math.prod(tile_dims)                                # K and V tiles
    batch = max(1, work.shape[0] // per_block)                          # TT blocks a batch
    runs, target = tg.runs, rows
    if runs is None:
        heads, tr, tw = tile_dims
        runs = ((0, src.shape[1], 0, (per_block // 2, tr * tw, tw, 1)),)
        target = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    for run in runs:
        lo, hi = run[:2]
        for b0 in range(lo, hi, batch):
            b1 = min(hi, b0 + batch)
            x = work[:(b1 - b0) * per_block]                            # [n, 1024]
            x.view((2, b1 - b0) + tuple(src.shape[2:])).copy_(src[:, b0:b1])
            out = _run_rows(target, run, b0, b1, tile_dims, (rows.shape[1],), (1,))
            pack_rows(x, dtype_name, out, scratch, narrow)
    if tg.runs is None:
        rows.copy_(target.index_select(0, _as_tensor(tg.rows, rows.device)))


def _tile_layers(layers, req: RequestTransfer, tg: TileGather, view: torch.Tensor) -> None:
    """Per layer: gather the request's 16-token pieces (long contiguous copies), then either
    tilize them into the send rows with one strided copy (the rows hold the values as they
    are) or tilize and pack ``PACK_BATCH_TILES`` tiles at a time (``_pack_blocks``)."""
    g, tt = req.gpu, req.tt
    device, dtype = layers[0].device, layers[0].dtype
    nb = req.tt_blocks.size
    tokens = torch.empty(2, nb * tt.block_size, g.num_kv_heads * g.head_size, dtype=dtype,
                         device=device)                                 # [2, T padded, H * D]
    src = _tile_source(tokens, g.order, nb, g.num_kv_heads, tt.block_size // TILE,
                       g.head_size // TILE)
    index = _as_tensor(tg.index, device)
    direct = _direct_dtype(tt.dtype, dtype, view)
    block_float = tile_format(tt.dtype).is_block_float
    narrow = block_float and dtype in NARROW_FLOATS                     # packed from float32
    work = None
    if not direct:
        tiles = min(view.shape[1], max(PACK_BATCH_TILES, 2 * math.prod(src.shape[2:5])))
        work = torch.empty(tiles, TILE_ELEMS, dtype=torch.float32 if narrow else dtype,
                           device=device)
    scratch = Scratch(work.shape[0], device) if block_float and not direct else None
    units = None
    if direct == dtype and tg.units is not None:
        units = torch.as_tensor(tg.units, device=device)
        unit_bytes = FACE * tokens.element_size()
    for i, layer in enumerate(layers):
        torch.index_select(layer.reshape(-1, tg.unit_elems), 0, index,
                           out=tokens.view(-1, tg.unit_elems))
        if tokens.shape[1] > req.num_tokens:
            _zero_tail(tokens, g.order, req.num_tokens, g.num_kv_heads)
        if units is not None:                                           # one gather of face rows
            rows = view[i].view(2, -1)                                  # [2, S * page_bytes]
            for kv in (0, 1):
                torch.index_select(_unit_view(tokens[kv], unit_bytes), 0, units,
                                   out=_unit_view(rows[kv], unit_bytes))
        elif direct:
            _place(src, view[i].view(direct).view(view.shape[1], -1), tg)
        else:
            _pack_blocks(src, view[i, :, :tt.page_bytes], tg, tt.dtype, work, scratch, narrow)


def _unit_layers(layers, req: RequestTransfer, ug: UnitGather, view: torch.Tensor) -> None:
    """Per layer: gather source units straight into tile order and send order, then pack.

    Both data-movement steps (tilize; regroup by bank) are one ``index_select`` of source
    units; packing works per tile, so it commutes with the regrouping. A bfloat16 cache sent
    as bfloat16 is gathered directly into the send buffer (bits pass unchanged).
    """
    device, tt, dtype = layers[0].device, req.tt, layers[0].dtype
    pages, stride = view.shape[1], view.shape[2]
    index, pad = _as_tensor(ug.index, device), _as_tensor(ug.pad, device)
    unit_bytes = ug.unit_elems * layers[0].element_size()
    direct = tt.dtype == "bfloat16" and dtype == torch.bfloat16 and stride == tt.page_bytes
    units = None if direct else torch.empty(index.numel() * ug.unit_elems, dtype=dtype,
                                            device=device)
    for i, layer in enumerate(layers):
        target = _unit_view(view[i] if direct else units, unit_bytes)
        torch.index_select(_unit_view(layer.contiguous(), unit_bytes), 0, index, out=target)
        if pad.numel():
            target.index_fill_(0, pad, 0)                               # tile padding reads 0
        if not direct:
            view[i, :, :tt.page_bytes] = pack_tiles(units.view(pages, TILE_ELEMS), tt.dtype)


def uses_kernel(layers, req: RequestTransfer, gather: GatherIndex, kernel=None) -> bool:
    """Whether the transformation runs the fused CPU kernel (``kernel``: None picks it where
    it applies and builds, False never, True requires it and raises where it cannot run)."""
    if kernel is False:
        return False
    fits = layout_kernel.applies(layers[0], req.tt.dtype, gather)
    if kernel is None:
        return fits and layout_kernel.available()
    if not fits:
        raise ValueError(f"the fused kernel does not pack {req.tt.dtype} from a "
                         f"{layers[0].dtype} cache on {layers[0].device} with this gather")
    if not layout_kernel.available():
        raise RuntimeError(f"the fused kernel could not be built (or {layout_kernel.ENV_VAR}"
                           f"=0); see the debug log of hardware.layout_kernel")
    return True


def _kernel_layers(layers, req: RequestTransfer, tg: TileGather, view: torch.Tensor) -> None:
    """Per layer: one call of the fused kernel fills its K and V send rows."""
    sources = torch.from_numpy(tg.sources)                              # [2 * S, 32] int64
    send_rows = torch.from_numpy(tg.send_rows)                          # [2 * S] int64
    for i, layer in enumerate(layers):
        layout_kernel.pack_layer(layer, sources, send_rows, view[i, :, :req.tt.page_bytes],
                                 req.tt.dtype)


def _transform(layers, req: RequestTransfer, gather: GatherIndex, out=None,
               kernel=None) -> torch.Tensor:
    """Fill the send buffer: every layer's K and V in tile order and send order, packed."""
    _check_layers(layers, req.gpu)
    device, tt = layers[0].device, req.tt
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
    layers = [layer.contiguous() for layer in layers]
    if uses_kernel(layers, req, gather, kernel):
        _kernel_layers(layers, req, gather.tiles, view)
    elif gather.tiles is not None:
        _tile_layers(layers, req, gather.tiles, view)
    else:
        _unit_layers(layers, req, gather.units, view)
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
                   gather: GatherIndex | None = None, kernel: bool | None = None) -> torch.Tensor:
    """The send buffer (uint8, on the layers' device) that ``hawk_plan(req)`` reads from.

    ``out``: a preallocated send buffer to fill (e.g. a slice of a registered RDMA region);
    ``gather``: ``prepare(req)``, to reuse it across calls; ``kernel``: the fused CPU kernel
    where it applies and builds (None), never (False) or always (True; raises where it can't).
    """
    return _transform(layers, req, gather or prepare(req, "hawk"), out, kernel)


def page_order_transform(layers: Sequence[torch.Tensor], req: RequestTransfer, out=None,
                         gather: GatherIndex | None = None,
                         kernel: bool | None = None) -> torch.Tensor:
    """Step 1 only (tilize and pack): the send buffer that ``per_page_plan(req)`` reads from."""
    return _transform(layers, req, gather or prepare(req, "per_page"), out, kernel)


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
