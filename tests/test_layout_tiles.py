"""TILE layout and tile formats: golden ttnn bytes, docs/facts.md worked examples, round trips."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hardware import pack, unpack
from hardware.tiles import FORMATS, padded_shape, quantize, tile_index

GOLDEN = Path(__file__).parent / "data" / "ttnn-golden.npz"
golden = np.load(GOLDEN)
CASES = range(int(golden["n_cases"]))


@pytest.mark.parametrize("k", CASES)
def test_pack_reproduces_ttnn_bytes(k):
    x, dtype = golden[f"input_{k}"], str(golden[f"dtype_{k}"])
    packed, pshape = pack(x, dtype)
    assert tuple(pshape) == tuple(golden[f"padded_shape_{k}"])
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert np.array_equal(packed, golden[f"packed_{k}"])


@pytest.mark.parametrize("k", CASES)
def test_unpack_reproduces_ttnn_values(k):
    x, dtype = golden[f"input_{k}"], str(golden[f"dtype_{k}"])
    decoded = unpack(golden[f"packed_{k}"], dtype, golden[f"padded_shape_{k}"], x.shape)
    assert decoded.shape == x.shape
    assert np.array_equal(decoded.view(np.uint32), golden[f"unpacked_{k}"].view(np.uint32))


def test_tile_bytes():
    assert {k: f.tile_bytes for k, f in FORMATS.items()} == {
        "float32": 4096, "bfloat16": 2048, "bfloat8_b": 1088, "bfloat4_b": 576}


def test_padding_examples():
    assert padded_shape((1, 1, 20, 40)) == (1, 1, 32, 64)
    assert padded_shape((40, 50)) == (64, 64)


def test_facts_worked_example_element_33_50():
    # bf16 [1,1,64,96]: 6 tiles; (33,50) is page 4, in-tile (1,18), face 1, offset 274, byte 8740
    x = np.zeros((1, 1, 64, 96), np.float32)
    x[0, 0, 33, 50] = 1.0                        # bf16 0x3F80: bytes 0x80, 0x3F
    packed, pshape = pack(x, "bfloat16")
    assert packed.size == 6 * 2048
    assert tile_index(1, 18) == 274 and (274 // 256) == 1
    assert np.flatnonzero(packed).tolist() == [8740, 8741]
    assert packed[8740:8742].tolist() == [0x80, 0x3F]


def test_bfp8_packs_from_float32_not_via_bf16():
    x = np.zeros((32, 32), np.float32)
    x[0, 0] = np.float32(1 + 2**-7 + 2**-20)
    packed, _ = pack(x, "bfloat8_b")
    assert packed[0] == 127 and packed[64] == 0x41


def test_bad_dtype_and_size_name_the_value():
    with pytest.raises(ValueError, match="bfloat12.*allowed"):
        pack(np.zeros((32, 32)), "bfloat12")
    with pytest.raises(ValueError, match="100 packed bytes"):
        unpack(np.zeros(100, np.uint8), "bfloat16", (32, 32))
    with pytest.raises(ValueError, match="multiples of 32"):
        unpack(np.zeros(2048, np.uint8), "bfloat16", (32, 20))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 70), st.integers(1, 70))


def _values(shape, seed, spread):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, shape))
    return x.astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_bf16_and_f32_round_trip(shape, seed):
    x = _values(shape, seed, 20)
    oracle = torch.from_numpy(x).to(torch.bfloat16).float().numpy()   # torch rounds to nearest even
    assert np.array_equal(quantize(x, "bfloat16").view(np.uint32), oracle.view(np.uint32))
    assert np.array_equal(quantize(x, "float32").view(np.uint32), x.view(np.uint32))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(["bfloat8_b", "bfloat4_b"]))
def test_block_float_error_bound_and_idempotence(shape, seed, dtype):
    x = _values(shape, seed, 6)
    q = quantize(x, dtype)
    assert np.array_equal(quantize(q, dtype), q)                 # the grid maps to itself
    bits = FORMATS[dtype].mag_bits
    padded = np.zeros(shape[:-1] + (-(-shape[-1] // 16) * 16,), np.float32)
    padded[..., :shape[-1]] = x
    groups = padded.reshape(-1, 16)
    with np.errstate(divide="ignore"):                           # all-zero groups: step 0
        step = np.exp2(np.floor(np.log2(np.abs(groups).max(axis=1))) - (bits - 1))
    err = np.abs(q.reshape(padded[..., :shape[-1]].shape) - x)
    err_padded = np.zeros_like(padded)
    err_padded[..., :shape[-1]] = err
    assert (err_padded.reshape(-1, 16) <= 1.5 * step[:, None]).all()
