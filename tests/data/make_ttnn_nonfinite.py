"""Write ``ttnn-nonfinite.npz``: ttnn 0.81.1's block-float bytes and values for NaN and inf.

Not part of the test suite (it needs ttnn, which the project does not depend on); it documents
how the fixture's bytes were made, and remakes them byte for byte:

    python3.12 -m venv /tmp/ttnn-venv
    /tmp/ttnn-venv/bin/pip install ttnn==0.81.1 numpy
    /tmp/ttnn-venv/bin/python tests/data/make_ttnn_nonfinite.py

ttnn's host-side packing runs without Tenstorrent hardware: the script points
``TT_METAL_MOCK_CLUSTER_DESC_PATH`` at a mock cluster descriptor (one Blackhole p150 chip,
written to a temporary file) and never opens a device. Each case is packed with
``ttnn.Tensor(x, dtype, layout=ttnn.TILE_LAYOUT)`` (default ``pad_value`` 0 and
``preserve_nan_values=False``, which makes no difference to block floats); ``packed`` is the
tensor's host buffer and ``unpacked`` its ``to_numpy()``.

The ``raw_`` cases hold bytes no float input packs to: every shared exponent 0..255 with every
code. ttnn 0.81.1 cannot build a block-float tensor from bytes (``ttnn.from_buffer`` refuses
BFLOAT8_B / BFLOAT4_B and wants a device), so the script packs a zero tensor of the right shape,
writes the crafted bytes into its host buffer (a writable view of the tensor's storage) and asks
that tensor for ``to_numpy()``. The format is described in ``ttnn-nonfinite.md``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).with_name("ttnn-nonfinite.npz")
BOARD_ID = 0x40 << 36          # a p150 board id (UMD reads the board type from bits 36..55)
MOCK_CLUSTER = f"""\
arch: {{0: blackhole}}
chips: {{}}
chip_unique_ids: {{0: {BOARD_ID}}}
ethernet_connections: []
ethernet_connections_to_remote_devices: []
chips_with_mmio: [{{0: 0}}]
harvesting: {{0: {{noc_translation: true, harvest_mask: 0, dram_harvesting_mask: 0, \
eth_harvesting_mask: 288, pcie_harvesting_mask: 2, l2cpu_harvesting_mask: 0}}}}
boards: [[{{board_id: {BOARD_ID}}}, {{board_type: p150}}, {{chips: [0]}}]]
"""
MAG_BITS = {"bfloat8_b": 7, "bfloat4_b": 3}
SEED = 20


def f32(*patterns) -> np.ndarray:
    """float32 values from their bit patterns."""
    return np.array(patterns, dtype=np.uint32).view(np.float32)


QNAN, SNAN, NEG_QNAN = 0x7FC00000, 0x7F800001, 0xFFC00000
NANS = f32(QNAN, SNAN, 0x7FBFFFFF, 0x7FC12345, 0x7FFFFFFF, 0x7FA00000, NEG_QNAN, 0xFF800001,
           0xFFFFFFFF, 0xFFE00000)
INF = np.float32(np.inf)
MAX = np.finfo(np.float32).max


def row(*parts) -> np.ndarray:
    """16 float32 values from float32 arrays and Python numbers (no float64 step, which would
    quiet a signalling NaN)."""
    out = np.concatenate([p if isinstance(p, np.ndarray) else np.array([p], np.float32)
                          for p in parts])
    assert out.dtype == np.float32 and out.size == 16, (out.dtype, out.size)
    return out


def crafted_tile() -> np.ndarray:
    """One 32x32 float32 tile, row by row (each row is two groups of 16 columns)."""
    x = np.zeros((32, 32), np.float32)
    ramp = np.linspace(-3, 3, 16, dtype=np.float32)
    zeros = lambda n: np.zeros(n, np.float32)                # noqa: E731
    rows = [
        row(NANS, INF, -INF, ramp[:4]),                       # every NaN kind, inf, finite
        row(f32(QNAN), ramp[:15]),                            # one NaN among finite values
        row(ramp[:8], -INF, ramp[8:15]),                      # one -inf among finite values
        np.full(16, INF),                                     # all +inf
        np.full(16, NANS[6]),                                 # all negative quiet NaN
        row(f32(SNAN, 0xFF800001, 0x7F800002, 0x7F80FFFF), zeros(12)),
        row(f32(QNAN), MAX, -MAX, MAX / 2, MAX / 3, MAX / 1000, 1e38, 3e37, zeros(8)),
        row(INF, MAX, 2.0 ** 127, 1.5 * 2.0 ** 126, zeros(12)),
        row(f32(QNAN), -0.0, 1e-40, -1e-45, 1e-30, 0.0, ramp[:10]),   # zeros, denormals
        row(f32(0x7F800000 | (1 << 22) | 1, 0x7F800000 | (1 << 16), 0x7F800000 | (1 << 17),
                0x7F800000 | (3 << 16), 0x7F800000 | (1 << 20), 0xFF800000 | (5 << 20)),
            zeros(10)),                                       # payloads at the rounding bits
    ]
    for i, values in enumerate(rows):
        x[i, :16] = values
        x[i + 16, 16:] = values[::-1]                         # the other faces, reversed
    rng = np.random.default_rng(SEED)
    x[12:16] = rng.standard_normal((4, 32)).astype(np.float32)   # finite groups beside them
    return x


def narrow_exact(x: np.ndarray, narrow: str) -> np.ndarray:
    """``x`` moved onto the bfloat16 or float16 grid, widened back to float32 bit for bit as a
    bfloat16 / float16 source widens. bfloat16: the top 16 bits (a NaN whose payload would
    vanish gets the quiet bit), so signalling NaNs stay. float16: finite values rounded (near
    -max ones overflow to inf), NaNs keep sign and top payload bits but are made quiet, since
    widening a signalling half NaN quiets it on x86."""
    bits = x.view(np.uint32)
    nan = np.isnan(x)
    if narrow == "bfloat16":
        top = bits >> 16
        top = np.where(nan & ((top & 0x7F) == 0), top | 0x40, top)
        return (top << 16).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        wide = x.astype(np.float16).astype(np.float32).view(np.uint32)
    nan_bits = bits & 0x80000000 | 0x7FC00000 | (bits & 0x3FE000)
    return np.where(nan, nan_bits, wide).astype(np.uint32).view(np.float32)


def random_tiles(shape, rng) -> np.ndarray:
    """Random normal values over a wide range of group scales, with zeros, denormals, near-max
    values, infinities and NaNs of every kind sprinkled in at a rate drawn per row (0..40%)."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-60, 60, shape[:-1] + (1,)))
    x = x.astype(np.float32)
    rate = rng.uniform(0, 0.4, shape[:-1] + (1,)) * (rng.random(shape[:-1] + (1,)) < 0.7)
    pick = np.where(rng.random(shape) < rate, rng.integers(0, 6, shape), -1)
    n = lambda k: int((pick == k).sum())                       # noqa: E731
    sign = lambda k: np.where(rng.random(n(k)) < 0.5, 0x80000000, 0).astype(np.uint32)  # noqa
    payload = rng.integers(1, 1 << 23, n(0), dtype=np.uint32)
    x[pick == 0] = (sign(0) | 0x7F800000 | payload).view(np.float32)        # any NaN
    x[pick == 1] = (sign(1) | QNAN).view(np.float32)                        # quiet NaN
    x[pick == 2] = np.where(sign(2) > 0, -INF, INF)
    x[pick == 3] = (sign(3) | rng.integers(0x7F000000, 0x7F800000, n(3), dtype=np.uint32)
                    ).view(np.float32)                                      # exponent 254
    x[pick == 4] = (sign(4) | rng.integers(1, 1 << 23, n(4), dtype=np.uint32)).view(np.float32)
    x[pick == 5] = 0.0
    return x


def cases(rng):
    """(input, dtype, description) for every packed case, in fixture order."""
    tile = crafted_tile()[None, None]
    out = []
    for dtype in MAG_BITS:
        out.append((tile, dtype, "crafted float32 tile: NaNs (quiet, signalling, payload, "
                    "negative) and +-inf among finite values, all-inf / all-NaN groups, "
                    "NaN beside near-max values, zeros and denormals"))
    for narrow in ("bfloat16", "float16"):
        for dtype in MAG_BITS:
            out.append((narrow_exact(tile, narrow), dtype,
                        f"the crafted tile on the {narrow} grid ({narrow} sources)"))
    for dtype in MAG_BITS:
        out.append((random_tiles((2, 1, 64, 64), rng), dtype,
                    "8 random tiles with NaN, inf, near-max, denormals and zeros sprinkled in"))
    for dtype in MAG_BITS:
        out.append((random_tiles((3, 40, 50), rng), dtype,
                    "random, not tile-aligned [3,40,50] -> [3,64,64], non-finite sprinkled in"))
    bf16 = narrow_exact(random_tiles((1, 1, 32, 128), rng), "bfloat16")
    for dtype in MAG_BITS:
        out.append((bf16, dtype, "4 random tiles on the bfloat16 grid, non-finite sprinkled in"))
    return out


def raw_tiles(dtype: str) -> np.ndarray:
    """Block-float tiles [n, tile_bytes] holding every (shared exponent, code) pair: exponent
    ``E`` owns ``2^(bits+1) / 16`` consecutive groups whose codes run 0 .. 2^(bits+1) - 1."""
    bits = MAG_BITS[dtype]
    num_codes = 1 << (bits + 1)
    groups_per_exp = num_codes // 16
    n = 256 * groups_per_exp // 64
    exps = np.repeat(np.arange(256), groups_per_exp).reshape(n, 64)
    codes = np.tile(np.arange(num_codes), 256).reshape(n, 1024)
    if bits == 3:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)    # element 2m: low nibble of byte m
    return np.concatenate([exps, codes], axis=1).astype(np.uint8)


def host_bytes(tensor, ttnn) -> np.ndarray:
    """A writable uint8 view of a host tensor's storage."""
    shard = tensor.host_buffer().get_shard(ttnn.MeshCoordinate(0, 0))
    return np.asarray(shard.__array__()).view(np.uint8)


def main() -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(MOCK_CLUSTER)
    os.environ["TT_METAL_MOCK_CLUSTER_DESC_PATH"] = f.name
    import ttnn
    dtypes = {"bfloat8_b": ttnn.bfloat8_b, "bfloat4_b": ttnn.bfloat4_b}
    z = {"ttnn_version": np.array("0.81.1")}
    packed_cases = cases(np.random.default_rng(SEED))
    for k, (x, dtype, description) in enumerate(packed_cases):
        t = ttnn.Tensor(np.ascontiguousarray(x), dtypes[dtype], layout=ttnn.TILE_LAYOUT)
        z |= {f"input_{k}": x, f"dtype_{k}": np.array(dtype),
              f"packed_{k}": host_bytes(t, ttnn).copy(),
              f"unpacked_{k}": np.asarray(t.to_numpy(), np.float32).reshape(x.shape),
              f"padded_shape_{k}": np.array(list(t.padded_shape), np.int64),
              f"description_{k}": np.array(description)}
    z["n_cases"] = np.array(len(packed_cases), np.int64)
    for j, dtype in enumerate(MAG_BITS):
        raw = raw_tiles(dtype)
        shape = (raw.shape[0] * 32, 32)
        t = ttnn.Tensor(np.zeros(shape, np.float32), dtypes[dtype], layout=ttnn.TILE_LAYOUT)
        view = host_bytes(t, ttnn)
        view[:] = raw.reshape(-1)                            # the crafted bytes, in place
        z |= {f"raw_dtype_{j}": np.array(dtype), f"raw_packed_{j}": view.copy(),
              f"raw_unpacked_{j}": np.asarray(t.to_numpy(), np.float32).reshape(shape),
              f"raw_padded_shape_{j}": np.array(shape, np.int64),
              f"raw_description_{j}": np.array(
                  f"every shared exponent 0..255 with every {dtype} code, written as bytes")}
    z["n_raw"] = np.array(len(MAG_BITS), np.int64)
    os.unlink(f.name)
    np.savez_compressed(OUT, **z)
    print(f"wrote {OUT}: {len(packed_cases)} packed cases, {len(MAG_BITS)} raw cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
