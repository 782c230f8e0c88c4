"""KV-cache layouts: vLLM's paged GPU cache, TP sharding, and the TT paged cache in banks."""

import numpy as np
import pytest

from hardware.dram import blackhole_p150a, page_location, wormhole
from hardware.kv_layout import (GpuKVSpec, TTKVSpec, from_tt_blocks, gather_tokens,
                                kv_head_range, read_tt_tokens, scatter_tokens, shard_heads,
                                to_tt_blocks)
from hardware.tiles import pack_tiles, quantize, tilize


def make_request(spec, num_tokens, rng):
    table = rng.permutation(spec.num_blocks)[:spec.blocks_for(num_tokens)]
    kv = rng.standard_normal((2, num_tokens, spec.num_kv_heads, spec.head_size)).astype(np.float32)
    return table, kv


def test_gpu_shapes_and_bytes():
    nhd = GpuKVSpec(num_layers=2, num_blocks=10, num_kv_heads=2, head_size=128)
    hnd = GpuKVSpec(num_layers=2, num_blocks=10, num_kv_heads=2, head_size=128, order="HND")
    assert nhd.physical_shape == (2, 10, 16, 2, 128)
    assert hnd.physical_shape == (2, 10, 2, 16, 128)
    assert nhd.block_bytes == 16 * 2 * 128 * 2 and nhd.layer_bytes == 20 * nhd.block_bytes
    assert nhd.block_offsets(1, 1, [3]).tolist() == [nhd.layer_bytes + 13 * nhd.block_bytes]


def test_bad_specs_name_the_value():
    with pytest.raises(ValueError, match="block_size 24 must be a multiple of 16"):
        GpuKVSpec(num_layers=1, num_blocks=4, num_kv_heads=1, head_size=64, block_size=24)
    with pytest.raises(ValueError, match="block_size 48 must be a multiple of 32"):
        TTKVSpec(num_layers=1, max_num_blocks=4, num_kv_heads=1, head_dim=64,
                 dram=wormhole(), block_size=48)
    with pytest.raises(ValueError, match="'NDH'"):
        GpuKVSpec(num_layers=1, num_blocks=4, num_kv_heads=1, head_size=64, order="NDH")
    with pytest.raises(ValueError, match="bfloat12"):
        TTKVSpec(num_layers=1, max_num_blocks=4, num_kv_heads=1, head_dim=64,
                 dram=wormhole(), dtype="bfloat12")


def test_tp_sharding_by_kv_heads():
    ranges = [kv_head_range(8, 4, r) for r in range(4)]
    assert [list(r) for r in ranges] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [kv_head_range(8, 16, r).start for r in range(16)] == [r // 2 for r in range(16)]
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(8, 3, 0)
    x = np.arange(2 * 8 * 4).reshape(2, 8, 4)
    assert np.array_equal(shard_heads(x, 8, 4, 1), x[:, 2:4])


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_scatter_gather_round_trip(order):
    rng = np.random.default_rng(0)
    spec = GpuKVSpec(num_layers=1, num_blocks=12, num_kv_heads=3, head_size=40, order=order)
    table, kv = make_request(spec, 37, rng)
    layer = np.zeros(spec.physical_shape, np.float32)
    scatter_tokens(layer, spec, table, kv)
    assert np.array_equal(gather_tokens(layer, spec, table, 37), kv)
    with pytest.raises(ValueError, match="has 2 blocks; 37 tokens"):
        gather_tokens(layer, spec, table[:2], 37)


def test_hnd_block_is_tt_pre_tilize_order():
    rng = np.random.default_rng(1)
    spec = GpuKVSpec(num_layers=1, num_blocks=4, num_kv_heads=2, head_size=64,
                     block_size=32, order="HND")
    table, kv = make_request(spec, 64, rng)
    layer = np.zeros(spec.physical_shape, np.float32)
    scatter_tokens(layer, spec, table, kv)
    assert np.array_equal(layer[0, table], to_tt_blocks(kv[0], 32))     # [nb, H, bs, D]
    assert np.array_equal(from_tt_blocks(to_tt_blocks(kv[0], 32), 64), kv[0])


def test_llama70b_block_is_four_bfp8_tiles():
    tt = TTKVSpec(num_layers=80, max_num_blocks=128, num_kv_heads=1, head_dim=128,
                  dram=blackhole_p150a())
    assert tt.pages_per_block == 4 and tt.pages_per_block * tt.page_bytes == 4352
    assert tt.tensor_base(0, 1) == tt.tensor_bank_bytes == 64 * 1088   # 512 pages over 8 banks


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat8_b", "bfloat4_b", "float32"])
def test_read_tt_tokens_from_banks(dtype):
    rng = np.random.default_rng(2)
    tt = TTKVSpec(num_layers=2, max_num_blocks=6, num_kv_heads=2, head_dim=48,
                  dram=wormhole(), dtype=dtype)
    tokens = rng.standard_normal((45, 2, 48)).astype(np.float32)
    blocks = np.array([4, 1])
    banks = [np.zeros(s, np.uint8) for s in tt.region_sizes]
    pages = pack_tiles(tilize(to_tt_blocks(tokens, 32)), dtype)          # [8, tile_bytes]
    bank, off = page_location(tt.block_pages(blocks), tt.page_bytes, tt.dram, tt.tensor_base(1, 0))
    for p, (b, o) in enumerate(zip(bank, off)):
        banks[b][o:o + tt.page_bytes] = pages[p]
    got = read_tt_tokens(banks, tt, 1, 0, blocks, 45)
    assert np.array_equal(got, quantize(tokens, dtype))
    assert not read_tt_tokens(banks, tt, 0, 0, blocks, 45).any()        # other tensors untouched
