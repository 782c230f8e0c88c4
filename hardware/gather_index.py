"""Where the HAWK transformation reads each piece of its send buffer from: the gather index.

Built once per request on the host (numpy), like its plan, and reused for every layer by
``hardware.transform``. Head sizes that are multiples of 32 take the block gather
(``TileGather``): 16-token pieces into a token buffer, then one strided copy (affine runs of
send rows) or one ``index_select`` of face rows (``tile_units``) that tilizes and regroups by
bank. Other head sizes take the unit gather (``UnitGather``, ``source_units``): every output
unit picked one by one, tile padding listed. ``prepare`` picks one for ``hawk`` (pages
regrouped by bank) or ``per_page`` (pages as they come).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from hardware.dram import contiguous_runs
from hardware.mechanism_plans import RequestTransfer, hawk_segments
from hardware.tiles import FACE, TILE, TILE_ELEMS


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
class UnitGather:
    """The general gather: every output unit of ``unit_elems`` elements picked one by one."""

    unit_elems: int          # elements per gathered unit
    index: np.ndarray        # [units per layer] source unit of each output unit
    pad: np.ndarray          # [p] output units that are tile padding


@dataclass(frozen=True)
class TileGather:
    """The block gather: the request's 16-token pieces of a layer into one token buffer, then
    one strided copy that tilizes and puts every tile in its send row (head size a multiple
    of 32). ``runs``: per run of TT blocks ``(first, end, row, row strides over (block, head,
    tile row, tile column))`` when each run's send rows are affine in the tile coordinates,
    as for a run starting at bank 0 with a whole number of bank rows; else ``None`` and
    ``rows`` (page-order row of each send row) reorders the tiles after the copy.
    ``units``: where the send rows are the tiles' values as they are and contiguous, the
    face row (16 elements) of one tensor's token buffer that each face row of its send rows
    takes (``tile_units``): then one ``index_select`` of face rows replaces the strided copy.
    ``sources``, ``send_rows``: where each page's tile rows start in the layer and which send
    row the page fills (``tile_sources``), for the fused CPU kernel (``hardware.layout_kernel``).
    """

    unit_elems: int          # elements per 16-token piece (NHD: all heads; HND: one head)
    index: np.ndarray        # [2 * pieces] source piece of each piece of the token buffer
    runs: tuple | None
    rows: np.ndarray | None
    units: np.ndarray | None = None      # [S * 64] int32
    sources: np.ndarray | None = None    # [2 * S, 32] int64 (``tile_sources``)
    send_rows: np.ndarray | None = None  # [2 * S] int64


@dataclass(frozen=True)
class GatherIndex:
    """One request's gather, computed once on the host (like its plan) and reused per layer."""

    stride: int              # bytes per page in the send buffer
    page_bytes: int
    tiles: TileGather | None
    units: UnitGather | None


def _affine(pos: np.ndarray):
    """``(base, strides)`` with ``pos == base + sum(index * strides)``, strides >= 0, or None."""
    base, strides, want = int(pos.flat[0]), [], np.full(pos.shape, pos.flat[0], np.int64)
    for axis, size in enumerate(pos.shape):
        unit = tuple(int(a == axis) for a in range(pos.ndim))
        step = int(pos[unit]) - base if size > 1 else 0
        shape = [1] * pos.ndim
        shape[axis] = size
        want = want + (np.arange(size) * step).reshape(shape)
        strides.append(step)
    return (base, tuple(strides)) if min(strides) >= 0 and np.array_equal(want, pos) else None


def tile_gather(req: RequestTransfer, page_order=None) -> TileGather:
    """The block gather for ``page_order`` (send row -> request page; default: as they come)."""
    g, tt = req.gpu, req.tt
    per_block = g.block_size // FACE                                    # pieces per GPU block
    pieces = req.tt_blocks.size * tt.block_size // FACE                 # pieces, padded to TT
    piece = np.minimum(np.arange(pieces), -(-req.num_tokens // FACE) - 1)   # past T: any piece
    blocks, sub = np.divmod(piece, per_block)
    tensor_block = np.arange(2)[:, None] * g.num_blocks + req.block_table[blocks]  # [2, pieces]
    if g.order == "NHD":                                                # piece: [bs, H, D]
        first = tensor_block * per_block + sub
    else:                                                               # piece: [bs, D] of a head
        heads = np.arange(g.num_kv_heads)
        first = (tensor_block[..., None] * g.num_kv_heads + heads) * per_block + sub[:, None]
    s = req.pages_per_tensor
    order = np.arange(s) if page_order is None else np.asarray(page_order)
    pos = np.empty(s, np.int64)
    pos[order] = np.arange(s)
    grid = pos.reshape(-1, g.num_kv_heads, tt.block_size // TILE, g.head_size // TILE)
    runs, lo = [], 0
    for _, length in (contiguous_runs(req.tt_blocks) if page_order is not None
                      else [(0, req.tt_blocks.size)]):
        fit = _affine(grid[lo:lo + length])
        runs.append(fit and (lo, lo + length) + fit)
        lo += length
    unit = FACE * g.head_size * (g.num_kv_heads if g.order == "NHD" else 1)
    if all(runs):
        return TileGather(unit, first.reshape(-1), tuple(runs), None)
    return TileGather(unit, first.reshape(-1), None, np.concatenate([order, s + order]))


def tile_units(req: RequestTransfer, page_order=None) -> np.ndarray:
    """Face rows of one tensor's token buffer in send order: ``[S * 64]`` int32, tile by tile
    in ``page_order`` (default: as they come), 64 face rows a tile in tile element order."""
    g, tt = req.gpu, req.tt
    order = np.arange(req.pages_per_tensor) if page_order is None else np.asarray(page_order)
    tiles_w, per_row = g.head_size // TILE, g.head_size // FACE       # face rows per head row
    block, local = np.divmod(order, tt.pages_per_block)                 # [S]
    h, rest = np.divmod(local, (tt.block_size // TILE) * tiles_w)
    tr, tc = np.divmod(rest, tiles_w)
    f, r = np.divmod(np.arange(TILE_ELEMS // FACE), FACE)               # [64] face, row
    token = (block * tt.block_size + tr * TILE)[:, None] + (f // 2) * FACE + r   # [S, 64]
    column = (tc * 2)[:, None] + f % 2
    if g.order == "NHD":                                                # buffer [T, H, D]
        row = token * g.num_kv_heads + h[:, None]
    else:                                                               # [T / 16, H, 16, D]
        row = ((token // FACE) * g.num_kv_heads + h[:, None]) * FACE + token % FACE
    return (row * per_row + column).reshape(-1).astype(np.int32)


def tile_sources(req: RequestTransfer, page_order=None) -> tuple[np.ndarray, np.ndarray]:
    """Where each page's tile rows start in a layer, for the fused kernel: ``(sources,
    send_rows)``. ``sources`` ``[2 * S, 32]`` int64: element offsets into the layer (flattened)
    of the 32 tile rows of each of K's pages, then V's, in page order, ``-1`` for tile rows past
    the request (padding, read as zeros); tile row ``r`` is columns ``32 tc .. 32 tc + 31`` of
    one token's head row (head size a multiple of 32). ``send_rows`` ``[2 * S]`` int64: the send
    row of each page, for ``page_order`` (send row -> page; default: as they come). Walking pages
    in order reads each TT block's tokens while they are in cache."""
    g, tt = req.gpu, req.tt
    s = req.pages_per_tensor
    tiles_w = g.head_size // TILE
    block, local = np.divmod(np.arange(s), tt.pages_per_block)          # [S] in page order
    h, rest = np.divmod(local, (tt.block_size // TILE) * tiles_w)
    tr, tc = np.divmod(rest, tiles_w)
    token = (block * tt.block_size + tr * TILE)[:, None] + np.arange(TILE)    # [S, 32]
    pad = token >= req.num_tokens
    token = np.where(pad, 0, token)
    gblock = np.arange(2)[:, None, None] * g.num_blocks + req.block_table[token // g.block_size]
    offset, h = token % g.block_size, h[:, None]                        # gblock: [2, S, 32]
    if g.order == "NHD":                                                # [2, n, bs, H, D]
        row = (gblock * g.block_size + offset) * g.num_kv_heads + h
    else:                                                               # [2, n, H, bs, D]
        row = (gblock * g.num_kv_heads + h) * g.block_size + offset
    elem = row * g.head_size + (tc * TILE)[:, None]
    pos = np.arange(s)
    if page_order is not None:
        pos[np.asarray(page_order)] = np.arange(s)
    send_rows = np.concatenate([pos, s + pos]).astype(np.int64)
    return np.where(pad, -1, elem).reshape(-1, TILE).astype(np.int64), send_rows


def prepare(req: RequestTransfer, kind: str = "hawk") -> GatherIndex:
    """The gather for ``hawk`` (pages regrouped by bank) or ``per_page`` (pages as they come)."""
    if kind not in ("hawk", "per_page"):
        raise ValueError(f"transform kind {kind!r}; allowed: 'hawk', 'per_page'")
    order = hawk_segments(req)[0] if kind == "hawk" else None
    stride = req.page_stride if kind == "hawk" else req.tt.page_bytes
    if req.gpu.head_size % TILE == 0:
        sources, send_rows = tile_sources(req, order)
        tg = dataclasses.replace(tile_gather(req, order), sources=sources, send_rows=send_rows)
        if req.tt.dtype == req.gpu.dtype and stride == req.tt.page_bytes:    # values as they are
            tg = dataclasses.replace(tg, units=tile_units(req, order))
        return GatherIndex(stride, req.tt.page_bytes, tg, None)
    u, index, pad = source_units(req, order)
    return GatherIndex(stride, req.tt.page_bytes, None, UnitGather(u, index, pad))
