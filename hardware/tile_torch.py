"""Tenstorrent tile packing in PyTorch: the torch twin of ``hardware.tiles``, byte-exact with it.

Tilizes ``[..., H, W]`` into 32x32 tiles and packs them as ``float32``, ``bfloat16`` (nearest
even, NaN -> 0x7FC0), ``bfloat8_b`` or ``bfloat4_b`` (docs/facts.md 2) on the tensor's own device.
Block floats from a bfloat16 or float16 source are packed with a short float recipe
(``_bfp_narrow``); other inputs, or groups the short recipe declines (inf, NaN, tiny shared
exponents), take the integer recipe of ``hardware.tiles.bfp_encode`` (``_bfp_chunk``).
Used by ``hardware.transform`` to fill send buffers.
"""

from __future__ import annotations

import torch

from hardware.tiles import FACE, GROUPS, TILE, TILE_ELEMS, tile_format

NARROW_FLOATS = (torch.bfloat16, torch.float16)   # packed by the short block-float recipe
MAGIC = 1.5 * 2.0 ** 23   # v + MAGIC rounds v (|v| < 2^22) to an integer, half to even


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


def bfp_bytes(tiles: torch.Tensor, mag_bits: int, chunk: int = 512) -> torch.Tensor:
    """float tiles ``[n, 1024]`` -> block-float bytes ``[n, 64 + codes]`` (docs/facts.md 2).

    Works ``chunk`` tiles at a time, reusing the same scratch buffers.
    """
    n = tiles.shape[0]
    out = torch.empty((n, GROUPS + TILE_ELEMS * (mag_bits + 1) // 8), dtype=torch.uint8,
                      device=tiles.device)
    scratch = Scratch(min(n, chunk), tiles.device)
    for lo in range(0, n, chunk):
        _pack_bfp(tiles[lo:lo + chunk], mag_bits, out[lo:lo + chunk], scratch)
    return out


class Scratch:
    """Buffers for ``_bfp_narrow`` on up to ``tiles`` tiles, allocated once per transform."""

    def __init__(self, tiles: int, device) -> None:
        elems = tiles * TILE_ELEMS
        self.values = torch.empty(elems, device=device)                 # x as float32
        self.magnitude = torch.empty(elems, dtype=torch.int32, device=device)   # |x| bits
        self.code = torch.empty(elems, dtype=torch.int8, device=device)
        self.sign = torch.empty(elems, dtype=torch.int8, device=device)


def _pack_bfp(tiles: torch.Tensor, mag_bits: int, out: torch.Tensor, scratch: Scratch,
              narrow: bool = False) -> None:
    """Block-float bytes of the tiles ``tiles`` [n, 1024] into the rows ``out`` [..., bytes]:
    the short recipe for bfloat16 and float16 values, else (or where it declines) the integer
    one. ``narrow``: ``tiles`` is float32 scratch that holds such values and may be
    overwritten (the transformation widens while it tilizes)."""
    x = tiles if narrow and tiles.dtype == torch.float32 else None
    if tiles.dtype in NARROW_FLOATS:
        x = scratch.values[:tiles.numel()].view(tiles.shape)
        x.copy_(tiles)
    if x is not None and _bfp_narrow(x, mag_bits, out, scratch):
        return
    _bfp_chunk(tiles, mag_bits, out)


def _write_codes(magnitude: torch.Tensor, sign, mag_bits: int, out: torch.Tensor) -> None:
    """Codes ``magnitude | sign`` [n, 1024] (one per byte; ``sign`` may be None) into the code
    bytes of the rows ``out`` [..., bytes]; bfloat4_b puts element 2m in the low nibble, 2m+1
    in the high one."""
    lead = out.shape[:-1]
    codes = magnitude.view(*lead, TILE_ELEMS)
    if mag_bits == 7:
        target = out[..., GROUPS:].view(codes.dtype)
        if sign is None:
            target.copy_(codes)
        else:
            torch.bitwise_or(codes, sign.view(codes.shape), out=target)
        return
    if sign is not None:
        codes = codes.bitwise_or_(sign.view(codes.shape))
    codes = codes.view(torch.uint8)
    torch.bitwise_or(codes[..., 0::2] & 0xF, codes[..., 1::2] << 4, out=out[..., GROUPS:])


def _bfp_narrow(x: torch.Tensor, mag_bits: int, out: torch.Tensor, scratch: Scratch) -> bool:
    """Encode float32 tiles ``x`` [n, 1024] that hold bfloat16 or float16 values (overwritten)
    into the rows ``out`` [..., bytes] (leading dims: n tiles, any strides).

    Such a value has at most 11 significant bits, so the alignment shift of ``hardware.tiles``
    drops no bit that could reach the rounding position: the magnitude code is exactly
    ``|x| * 2^(126 + mag_bits - E)`` rounded half to even, done by one exact scaling and
    ``round`` (half to even); the signed int8 result then becomes sign-magnitude. Returns
    False, writing nothing and leaving ``x`` as it was, when a group needs the general recipe
    (inf or NaN; a nonzero group whose shared exponent is at most ``mag_bits``, where denormals
    would not round to 0).
    """
    n = x.shape[0]
    g = x.view(n * GROUPS, FACE)                                        # [G, 16]
    mag = torch.bitwise_and(g.view(torch.int32), 0x7FFFFFFF,
                            out=scratch.magnitude[:g.numel()].view(g.shape))
    top = mag.amax(-1, keepdim=True)                                    # [G, 1] max |x| bits
    shared = top >> 23                                                  # exponent field E
    lo, hi = (int(v) for v in torch.aminmax(shared))
    if hi == 255:
        return False
    scaled = shared
    if lo <= mag_bits:
        if bool(((top > 0) & (shared <= mag_bits)).any()):
            return False
        scaled = shared.clamp(min=mag_bits + 1)                        # all-zero groups: any scale
    scale = ((253 + mag_bits - scaled) << 23).view(torch.float32)     # 2^(126 + mag_bits - E)
    lim = (1 << mag_bits) - 1
    g.mul_(scale).round_().clamp_(-lim, lim)                           # signed code
    q = scratch.code[:g.numel()].view(n, TILE_ELEMS)
    q.copy_(x)                                                          # -lim..lim, exact
    sign = torch.bitwise_and(q, -128 >> (7 - mag_bits), out=scratch.sign[:q.numel()].view(q.shape))
    out[..., :GROUPS] = shared.view(out.shape[:-1] + (GROUPS,))
    _write_codes(q.abs_(), sign, mag_bits, out)                        # sign-magnitude
    return True


def _bfp_chunk(tiles: torch.Tensor, mag_bits: int, out: torch.Tensor) -> None:
    """The integer recipe of ``hardware.tiles.bfp_encode`` on the float32 bit patterns, for
    any input (float32 values, inf and NaN included); ``out`` [..., bytes] as above."""
    n = tiles.shape[0]
    bits = tiles.float().reshape(n * GROUPS, FACE).view(torch.int32)   # [G, 16]
    exp = (bits >> 23) & 0xFF
    shared = exp.amax(-1, keepdim=True)                                 # [G, 1]
    mant = ((bits & 0x7FFFFF) | 0x800000) * (exp > 0)                  # 24-bit significand
    aligned = mant >> (shared - exp).clamp_(max=31)                    # shifted-out bits lost
    drop = 24 - mag_bits
    half = 1 << (drop - 1)
    q = ((aligned + (half - 1) + ((aligned >> drop) & 1)) >> drop).clamp_(max=(1 << mag_bits) - 1)
    codes = (q | ((bits >> (31 - mag_bits)) & (1 << mag_bits)) * (q > 0)).to(torch.uint8)
    out[..., :GROUPS] = shared.view(out.shape[:-1] + (GROUPS,))
    _write_codes(codes, None, mag_bits, out)


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


def pack_rows(x: torch.Tensor, dtype_name: str, out: torch.Tensor, scratch,
              narrow: bool = False) -> None:
    """Pack the tiles ``x`` [n, 1024] into the rows ``out`` [..., tile_bytes] (leading dims
    hold the n tiles in ``x``'s order; any strides, e.g. rows of a send buffer grouped by
    bank). ``scratch``: a ``Scratch`` for at least ``n`` tiles where ``x`` holds bfloat16 or
    float16 values, else unused. ``narrow``: ``x`` is float32 scratch holding such values."""
    fmt = tile_format(dtype_name)
    if fmt.is_block_float:
        _pack_bfp(x, fmt.mag_bits, out, scratch, narrow)
    else:
        out.copy_(pack_tiles(x, dtype_name).view(out.shape))
