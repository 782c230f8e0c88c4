"""Block floats with NaN and infinity against ttnn 0.81.1's own bytes and values
(``data/ttnn-nonfinite.npz``, described in ``data/ttnn-nonfinite.md``): numpy unpack and pack,
the torch packing and the C++ kernel's, bit for bit, with no floating-point warnings."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hardware import layout_kernel, pack, tile_torch, unpack
from hardware.tiles import FORMATS, GROUPS, TILE, bfp_value_bits, tilize, untilize

FIXTURE = np.load(Path(__file__).parent / "data" / "ttnn-nonfinite.npz")
CASES = range(int(FIXTURE["n_cases"]))
RAW = range(int(FIXTURE["n_raw"]))
NARROW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # torch packs on either


def case(k):
    """(input, dtype, ttnn's packed bytes, ttnn's decoded values) of packed case ``k``."""
    z = FIXTURE
    return z[f"input_{k}"], str(z[f"dtype_{k}"]), z[f"packed_{k}"], z[f"unpacked_{k}"]


def bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def codes_of(packed, dtype):
    """Block-float bytes [n * tile_bytes] -> (exponent bytes [n, 64], codes [n, 1024])."""
    fmt = FORMATS[dtype]
    tiles = np.asarray(packed, np.uint8).reshape(-1, fmt.tile_bytes)
    codes = tiles[:, GROUPS:]
    if fmt.mag_bits == 3:
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(len(tiles), -1)
    return tiles[:, :GROUPS], codes


def narrow_source(x, narrow):
    """``x`` as a ``narrow`` tensor whose widening gives ``x`` bit for bit, or None."""
    b = bits(x)
    if narrow == "bfloat16":
        if (b & 0xFFFF).any():
            return None
        return torch.from_numpy((b >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    source = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float16)
    return source if np.array_equal(bits(source.float().numpy()), b) else None


def narrow_cases(narrow):
    found = [k for k in CASES if narrow_source(case(k)[0], narrow) is not None]
    assert len(found) >= 2, (narrow, found)            # at least the crafted tile, both formats
    return found


def test_fixture_holds_what_it_claims():
    assert str(FIXTURE["ttnn_version"]) == "0.81.1"
    nan_cases = [k for k in CASES if np.isnan(case(k)[3]).any() and np.isinf(case(k)[3]).any()]
    assert {case(k)[1] for k in nan_cases} == {"bfloat8_b", "bfloat4_b"}
    exps, _ = codes_of(case(0)[2], "bfloat8_b")
    assert (exps == 255).any() and (exps < 255).any()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("k", CASES)
def test_unpack_gives_ttnn_values_for_nan_and_inf(k):
    x, dtype, packed, want = case(k)
    with np.errstate(all="raise"):
        got = unpack(packed, dtype, FIXTURE[f"padded_shape_{k}"], x.shape)
    assert got.shape == want.shape
    assert np.array_equal(bits(got), bits(want))           # NaN positions, signs, payloads


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("j", RAW)
def test_unpack_decodes_every_exponent_and_code_as_ttnn(j):
    z = FIXTURE
    dtype, shape = str(z[f"raw_dtype_{j}"]), z[f"raw_padded_shape_{j}"]
    with np.errstate(all="raise"):
        got = unpack(z[f"raw_packed_{j}"], dtype, shape)
    assert np.array_equal(bits(got), bits(z[f"raw_unpacked_{j}"]))


def test_value_bits_of_the_codes_under_exponent_255():
    # bfloat8_b: q = 64 is inf, 96 a quiet NaN, 65 a signalling one; q = 63 is finite
    got = bfp_value_bits(255, [64, 0xC0, 96, 0xE0, 65, 63, 0x80, 0], 7)
    assert got.tolist() == [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F820000,
                            0x7F7C0000, 0x80000000, 0]
    assert bfp_value_bits(255, [4, 6, 0xF, 3], 3).tolist() == [0x7F800000, 0x7FC00000,
                                                              0xFFE00000, 0x7F400000]


@pytest.mark.parametrize("k", CASES)
def test_pack_gives_ttnn_bytes_for_nan_and_inf(k):
    x, dtype, packed, _ = case(k)
    got, pshape = pack(x, dtype)
    assert tuple(pshape) == tuple(FIXTURE[f"padded_shape_{k}"])
    assert np.array_equal(got, packed)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("k", CASES)
def test_round_trip_is_ttnns_round_trip(k):
    x, dtype, _, want = case(k)
    got, pshape = pack(x, dtype)
    assert np.array_equal(bits(unpack(got, dtype, pshape, x.shape)), bits(want))


def regrouped(dtype, seed, num_tiles):
    """New tiles drawn from the fixture's groups of ``dtype``, each group shuffled: the input,
    and ttnn's exponent bytes, codes and decoded values for it. A group is encoded on its own
    and each member only against the group's maximum exponent, so picking groups and shuffling
    within one carries ttnn's answers over."""
    pool_x, pool_exp, pool_codes, pool_y = [], [], [], []
    for k in CASES:
        x, d, packed, want = case(k)
        if d == dtype:
            exps, codes = codes_of(packed, dtype)
            pool_x.append(tilize(x).reshape(-1, 16))
            pool_y.append(tilize(want).reshape(-1, 16))
            pool_exp.append(exps.reshape(-1))
            pool_codes.append(codes.reshape(-1, 16))
    pool_x, pool_y = np.concatenate(pool_x), np.concatenate(pool_y)
    pool_exp, pool_codes = np.concatenate(pool_exp), np.concatenate(pool_codes)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(pool_x), num_tiles * GROUPS)              # [G]
    order = rng.permuted(np.tile(np.arange(16), (len(pick), 1)), axis=1)  # [G, 16]
    rows = np.arange(len(pick))[:, None]
    shape = (num_tiles * TILE, TILE)
    x = untilize(pool_x[pick][rows, order].reshape(num_tiles, -1), shape)
    y = untilize(pool_y[pick][rows, order].reshape(num_tiles, -1), shape)
    return x, pool_exp[pick].reshape(num_tiles, GROUPS), pool_codes[pick][rows, order], y


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["bfloat8_b", "bfloat4_b"]), seed=st.integers(0, 2**32 - 1),
       num_tiles=st.integers(1, 4))
def test_round_trip_equals_ttnn_on_regrouped_tiles(dtype, seed, num_tiles):
    x, exps, codes, want = regrouped(dtype, seed, num_tiles)
    packed, pshape = pack(x, dtype)
    got_exps, got_codes = codes_of(packed, dtype)
    assert np.array_equal(got_exps, exps)
    assert np.array_equal(got_codes.reshape(codes.shape), codes)
    with np.errstate(all="raise"):
        assert np.array_equal(bits(unpack(packed, dtype, pshape)), bits(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", CASES)
def test_torch_packing_gives_ttnn_bytes(k, device):
    x, dtype, packed, _ = case(k)
    got = tile_torch.pack(torch.from_numpy(x).to(device), dtype)
    assert np.array_equal(got.cpu().numpy().reshape(-1), packed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", NARROW)
def test_torch_packing_from_narrow_sources_gives_ttnn_bytes(narrow, device):
    for k in narrow_cases(narrow):
        x, dtype, packed, _ = case(k)
        got = tile_torch.pack(narrow_source(x, narrow).to(device), dtype)
        assert np.array_equal(got.cpu().numpy().reshape(-1), packed), k


@pytest.fixture(scope="module")
def kernel():
    if not (layout_kernel.enabled() and layout_kernel.available()):
        pytest.skip("the fused layout kernel is off or could not be built here")


def kernel_pack(layer, dtype, portable):
    """The kernel's bytes for a ``[..., H, W]`` tensor: pages are its tiles in order."""
    *lead, h, w = layer.shape
    hp, wp = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    matrix = torch.zeros((int(np.prod(lead, dtype=np.int64)), hp, wp), dtype=layer.dtype)
    matrix[:, :h, :w] = layer.reshape(-1, h, w)
    tile_rows = np.arange(matrix.shape[0] * hp // TILE)[:, None] * TILE + np.arange(TILE)
    starts = tile_rows[:, None, :] * wp + np.arange(0, wp, TILE)[None, :, None]  # [R, C, 32]
    sources = torch.from_numpy(starts.reshape(-1, TILE).astype(np.int64))
    out = torch.full((sources.shape[0], FORMATS[dtype].tile_bytes), 0xAB, dtype=torch.uint8)
    layout_kernel.pack_layer(matrix.contiguous().view(-1), sources,
                             torch.arange(sources.shape[0]), out, dtype, portable=portable)
    return out.numpy().reshape(-1)


@pytest.mark.parametrize("source", ["float32", *NARROW])
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_packing_gives_ttnn_bytes(kernel, source, portable):
    for k in (CASES if source == "float32" else narrow_cases(source)):
        x, dtype, packed, _ = case(k)
        layer = torch.from_numpy(x) if source == "float32" else narrow_source(x, source)
        assert np.array_equal(kernel_pack(layer, dtype, portable), packed), k
