"""Tenstorrent TILE layout and its tile formats, in numpy (byte-exact with ttnn 0.81.1).

A tensor ``[d0..dk, H, W]`` is padded with zeros to ``Hp, Wp`` (multiples of 32), folded into
the matrix ``[prod(d0..dk) * Hp, Wp]`` and cut into 32x32 tiles, stored row-major. A tile is four
16x16 faces (top-left, top-right, bottom-left, bottom-right), each row-major, so element
``(r, c)`` of a tile sits at ``((r//16)*2 + c//16)*256 + (r%16)*16 + c%16``. One tile is one
DRAM page.

Tile formats (bytes per tile): ``float32`` 4096, ``bfloat16`` 2048 (round to nearest even),
``bfloat8_b`` 1088 and ``bfloat4_b`` 576 (64 shared exponent bytes, one per 16-element face
row, then 8- or 4-bit sign-magnitude codes). See docs/facts.md sections 1-2. Block floats
decode by building float32 bits as ttnn does (``bfp_value_bits``), so a NaN or an infinity
packed under a shared exponent of 255 reads back as ttnn reads it. ``tests/data`` holds ttnn's
own bytes and values (``ttnn-golden.npz``, ``ttnn-nonfinite.npz``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

TILE = 32                 # tile edge, elements
FACE = 16                 # face edge, elements
TILE_ELEMS = TILE * TILE  # 1024
GROUPS = TILE_ELEMS // FACE  # 64 shared exponents per block-float tile


@dataclass(frozen=True)
class TileFormat:
    """One tile data format: its name, bytes per tile and (for block floats) magnitude bits."""

    name: str
    tile_bytes: int
    mag_bits: int = 0     # 7 for bfloat8_b, 3 for bfloat4_b, 0 for plain floats

    @property
    def is_block_float(self) -> bool:
        return self.mag_bits > 0


FORMATS = {
    "float32": TileFormat("float32", 4 * TILE_ELEMS),
    "bfloat16": TileFormat("bfloat16", 2 * TILE_ELEMS),
    "bfloat8_b": TileFormat("bfloat8_b", GROUPS + TILE_ELEMS, mag_bits=7),
    "bfloat4_b": TileFormat("bfloat4_b", GROUPS + TILE_ELEMS // 2, mag_bits=3),
}


def tile_format(dtype_name: str) -> TileFormat:
    """The format called ``dtype_name``; ``ValueError`` naming the allowed names otherwise."""
    try:
        return FORMATS[str(dtype_name)]
    except KeyError:
        raise ValueError(f"unknown tile dtype {dtype_name!r}; allowed: "
                         f"{', '.join(FORMATS)}") from None


def padded_shape(shape) -> tuple[int, ...]:
    """``shape`` with its last two dims rounded up to multiples of 32 (rank >= 2)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 0:
        raise ValueError(f"shape {shape} must have rank >= 2 and no negative dims")
    h, w = shape[-2:]
    return shape[:-2] + (-(-h // TILE) * TILE, -(-w // TILE) * TILE)


def num_tiles(shape) -> int:
    return int(np.prod(padded_shape(shape), dtype=np.int64)) // TILE_ELEMS


def tile_index(r, c):
    """In-tile element index of tile row ``r``, column ``c`` (arrays or ints)."""
    return ((r // FACE) * 2 + c // FACE) * FACE * FACE + (r % FACE) * FACE + c % FACE


def tilize(x: np.ndarray) -> np.ndarray:
    """``[..., H, W]`` -> ``[n_tiles, 1024]`` in tile element order, zero-padded."""
    ps = padded_shape(x.shape)
    h, w = x.shape[-2:]
    hp, wp = ps[-2:]
    lead = int(np.prod(ps[:-2], dtype=np.int64))
    padded = np.zeros((lead, hp, wp), dtype=x.dtype)
    padded[:, :h, :w] = x.reshape(lead, h, w)
    t = padded.reshape(lead, hp // TILE, 2, FACE, wp // TILE, 2, FACE)  # (L, tr, fr, r, tc, fc, c)
    t = t.transpose(0, 1, 4, 2, 5, 3, 6)                                # (L, tr, tc, fr, fc, r, c)
    return np.ascontiguousarray(t).reshape(-1, TILE_ELEMS)


def untilize(tiles: np.ndarray, pshape, shape=None) -> np.ndarray:
    """Inverse of ``tilize``: ``[n_tiles, 1024]`` -> ``shape`` (default: the padded shape)."""
    pshape = tuple(int(s) for s in pshape)
    shape = pshape if shape is None else tuple(int(s) for s in shape)
    hp, wp = pshape[-2:]
    lead = int(np.prod(pshape[:-2], dtype=np.int64))
    t = tiles.reshape(lead, hp // TILE, wp // TILE, 2, 2, FACE, FACE)   # (L, tr, tc, fr, fc, r, c)
    full = t.transpose(0, 1, 3, 5, 2, 4, 6).reshape(pshape)
    index = tuple(slice(0, s) for s in shape)
    return np.ascontiguousarray(full[index])


# ---- element formats ------------------------------------------------------------------------

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN -> 0x7FC0."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bfp_encode(tiles: np.ndarray, mag_bits: int) -> np.ndarray:
    """``[n, 1024]`` float32 tiles -> ``[n, 64 + 1024*(mag_bits+1)/8]`` uint8 block-float bytes."""
    n = tiles.shape[0]
    bits = np.ascontiguousarray(tiles, dtype=np.float32).view(np.uint32).reshape(n, GROUPS, FACE)
    exp = ((bits >> 23) & 0xFF).astype(np.int32)                     # [n, 64, 16]
    shared = exp.max(axis=-1)                                        # [n, 64]
    mant = np.where(exp > 0, (bits & 0x7FFFFF) | 0x800000, 0).astype(np.uint32)
    shift = np.minimum(shared[..., None] - exp, 31).astype(np.uint32)
    aligned = mant >> shift                                          # bits dropped here are lost
    drop = np.uint32(24 - mag_bits)
    q = aligned >> drop
    rem = aligned & ((np.uint32(1) << drop) - 1)
    half = np.uint32(1) << (drop - 1)
    q = q + ((rem > half) | ((rem == half) & (q & 1 == 1)))          # round half to even
    q = np.minimum(q, (1 << mag_bits) - 1)                            # saturate, exponent kept
    sign = (bits >> 31).astype(np.uint32)
    codes = np.where(q > 0, (sign << mag_bits) | q, 0).astype(np.uint8).reshape(n, TILE_ELEMS)
    if mag_bits == 3:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)               # [n, 512] low nibble first
    return np.concatenate([shared.astype(np.uint8), codes], axis=1)


def bfp_value_bits(shared, codes, mag_bits: int) -> np.ndarray:
    """float32 bit patterns (uint32) that ttnn 0.81.1 decodes block-float ``codes`` to under
    the shared exponent bytes ``shared`` (integer arrays that broadcast together).

    A code is ``sign << mag_bits | q``. ttnn normalizes ``q``: with ``p`` its top set bit, the
    value's exponent field is ``e = E - (mag_bits - 1) + p`` and its mantissa is the bits of
    ``q`` below ``p``, moved to the top of the 23-bit field. So the value is
    ``(-1)^sign * q * 2^(E - 127 - (mag_bits - 1))`` wherever ``1 <= e <= 254``, and the bits
    are built, not computed: under ``E = 255`` the codes with the top bit set land on
    ``e = 255``, so ``q = 2^(mag_bits-1)`` reads as +-inf and larger ``q`` as NaN (quiet when
    bit ``mag_bits - 2`` of ``q`` is set); ``e = 0`` gives a denormal pattern (the mantissa
    bits without the hidden one); ``e < 0`` gives +0.0. ``q = 0`` gives +-0.0 (the sign bit
    as stored).
    """
    shared = np.asarray(shared, dtype=np.int32)
    codes = np.asarray(codes, dtype=np.int32)
    q = codes & ((1 << mag_bits) - 1)
    sign = (codes >> mag_bits).astype(np.uint32) << 31
    top = np.zeros_like(q)                                            # top set bit of q
    for bit in range(1, mag_bits):
        top += (q >> bit) > 0
    exp = shared - (mag_bits - 1) + top
    mant = ((q - (1 << top)) << (23 - top)) & 0x7FFFFF                # bits below the top one
    bits = sign | (np.maximum(exp, 0).astype(np.uint32) << 23) | mant.astype(np.uint32)
    return np.where(q == 0, sign, np.where(exp < 0, np.uint32(0), bits)).astype(np.uint32)


@functools.cache
def _decode_table(mag_bits: int) -> np.ndarray:
    """``bfp_value_bits`` of every (exponent byte, code): uint32 [256 * 2^(mag_bits+1)],
    indexed by ``E << (mag_bits + 1) | code``; read-only."""
    num_codes = 1 << (mag_bits + 1)
    table = bfp_value_bits(np.arange(256)[:, None], np.arange(num_codes)[None, :], mag_bits)
    table = table.reshape(-1)
    table.setflags(write=False)
    return table


def bfp_decode(data: np.ndarray, mag_bits: int) -> np.ndarray:
    """``[n, tile_bytes]`` block-float bytes -> ``[n, 1024]`` float32, as ttnn decodes them
    (``bfp_value_bits``: NaN and inf under an exponent byte of 255; no floating-point math)."""
    n = data.shape[0]
    shared = data[:, :GROUPS].astype(np.intp) << (mag_bits + 1)       # [n, 64]
    codes = data[:, GROUPS:]
    if mag_bits == 3:
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1)         # low nibble first
    index = codes.reshape(n, GROUPS, FACE) | shared[..., None]        # [n, 64, 16]
    return _decode_table(mag_bits)[index].view(np.float32).reshape(n, TILE_ELEMS)


# ---- public pack / unpack ------------------------------------------------------------------

def pack_tiles(tiles: np.ndarray, dtype_name: str) -> np.ndarray:
    """``[n, 1024]`` float32 tiles -> ``[n, tile_bytes]`` uint8 in format ``dtype_name``."""
    fmt = tile_format(dtype_name)
    tiles = np.ascontiguousarray(tiles, dtype=np.float32)
    if fmt.is_block_float:
        return bfp_encode(tiles, fmt.mag_bits)
    if fmt.name == "bfloat16":
        return bf16_bits(tiles).astype("<u2").view(np.uint8).reshape(len(tiles), fmt.tile_bytes)
    return tiles.astype("<f4").view(np.uint8).reshape(len(tiles), fmt.tile_bytes)


def unpack_tiles(data: np.ndarray, dtype_name: str) -> np.ndarray:
    """``[n, tile_bytes]`` uint8 -> ``[n, 1024]`` float32 tiles."""
    fmt = tile_format(dtype_name)
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, fmt.tile_bytes)
    if fmt.is_block_float:
        return bfp_decode(data, fmt.mag_bits)
    if fmt.name == "bfloat16":
        return bf16_to_f32(data.view("<u2")).reshape(-1, TILE_ELEMS)
    return data.view("<f4").astype(np.float32).reshape(-1, TILE_ELEMS)


def pack(array, dtype_name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Lay ``array`` (rank >= 2) out as ttnn's host TILE buffer: ``(uint8 bytes, padded shape)``."""
    tile_format(dtype_name)
    x = np.asarray(array, dtype=np.float32)
    return pack_tiles(tilize(x), dtype_name).reshape(-1), padded_shape(x.shape)


def unpack(packed, dtype_name: str, pshape, shape=None) -> np.ndarray:
    """Inverse of ``pack``: decode ``packed`` bytes into float32 of ``shape`` (default: padded)."""
    fmt = tile_format(dtype_name)
    pshape = tuple(int(s) for s in pshape)
    if padded_shape(pshape) != pshape:
        raise ValueError(f"padded shape {pshape}: last two dims must be multiples of {TILE}")
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    expected = num_tiles(pshape) * fmt.tile_bytes
    if packed.size != expected:
        raise ValueError(f"{packed.size} packed bytes do not match padded shape {pshape} in "
                         f"{fmt.name}: expected {expected}")
    if shape is not None and padded_shape(shape) != pshape:
        raise ValueError(f"shape {tuple(shape)} does not pad to {pshape}")
    return untilize(unpack_tiles(packed, dtype_name), pshape, shape)


def quantize(array, dtype_name: str) -> np.ndarray:
    """What ``array`` reads back as after a trip through format ``dtype_name``."""
    x = np.asarray(array, dtype=np.float32)
    packed, pshape = pack(x, dtype_name)
    return unpack(packed, dtype_name, pshape, x.shape)
