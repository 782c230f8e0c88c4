"""The HAWK transformation in torch: byte-exact packing, and GPU cache -> plan -> banks -> back."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hardware import tile_torch, transform
from hardware.dram import DramConfig, contiguous_runs, page_location
from hardware.kv_layout import (GpuKVSpec, TTKVSpec, gather_tokens, read_tt_tokens,
                                to_tt_blocks)
from hardware.mechanism_plans import (RequestTransfer, apply_plan, check_disjoint, hawk_plan,
                            hawk_segments, per_page_plan)
from hardware.tiles import bfp_encode, pack as np_pack, quantize

golden = np.load(Path(__file__).parent / "data" / "ttnn-golden.npz")
DTYPES = ["bfloat16", "bfloat8_b", "bfloat4_b", "float32"]


@pytest.mark.parametrize("k", range(int(golden["n_cases"])))
def test_torch_pack_reproduces_ttnn_bytes(k):
    x = torch.from_numpy(golden[f"input_{k}"])
    packed = transform.pack(x, str(golden[f"dtype_{k}"])).reshape(-1).numpy()
    assert np.array_equal(packed, golden[f"packed_{k}"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_pack_equals_numpy_pack(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 45, 70)) * np.exp2(rng.integers(-40, 40, (3, 45, 70))))
    x = x.astype(np.float32)
    x[0, 0, :5] = [0.0, -0.0, 1e-40, -1e-42, 3e38]
    packed, _ = np_pack(x, dtype)
    assert np.array_equal(transform.pack(torch.from_numpy(x), dtype).reshape(-1).numpy(), packed)


def make_transfer(rng, num_tokens, heads, head, gpu_bs, order, tt_bs, dtype, banks, layers=2,
                  alignment=32, gpu_dtype="bfloat16"):
    gpu = GpuKVSpec(num_layers=layers, num_blocks=-(-num_tokens // gpu_bs) + 3,
                    num_kv_heads=heads, head_size=head, block_size=gpu_bs, order=order,
                    dtype=gpu_dtype)
    n_tt = -(-num_tokens // tt_bs)
    tt = TTKVSpec(num_layers=layers, max_num_blocks=n_tt + 3, num_kv_heads=heads, head_dim=head,
                  dram=DramConfig(num_banks=banks, alignment=alignment, bank_bytes=1 << 20),
                  block_size=tt_bs, dtype=dtype)
    table = rng.permutation(gpu.num_blocks)[:gpu.blocks_for(num_tokens)]
    tt_blocks = rng.permutation(tt.max_num_blocks)[:n_tt]
    if rng.random() < 0.5:                                   # often one contiguous run
        tt_blocks = np.arange(n_tt) + rng.integers(0, 4)
    return RequestTransfer(gpu, tt, table, tt_blocks, num_tokens)


def check_exactly_once(plan, req):
    """Writes cover exactly the pages of the request's blocks, each byte once."""
    check_disjoint(plan)
    plan.check_bounds(plan.src_size, req.tt.region_sizes)
    stride = req.page_stride if plan.kind == "hawk" else req.tt.page_bytes
    assert plan.total_bytes == plan.src_size == req.num_tensors * req.pages_per_tensor * stride
    covered = np.zeros(plan.src_size, bool)
    for s, n in zip(plan.src_offset, plan.nbytes):
        assert not covered[s:s + n].any()
        covered[s:s + n] = True
    assert covered.all()
    written = [np.zeros(size, np.int64) for size in req.tt.region_sizes]
    for r, d, n in zip(plan.dst_region, plan.dst_offset, plan.nbytes):
        written[r][d:d + n] += 1
    wanted = [np.zeros(size, np.int64) for size in req.tt.region_sizes]
    pages = req.tt.block_pages(req.tt_blocks)
    for t in range(req.num_tensors):
        bank, off = page_location(pages, req.tt.page_bytes, req.tt.dram,
                                  req.tt.tensor_base(t // 2, t % 2))
        for b, o in zip(bank, off):
            wanted[b][o:o + stride] += 1
    assert all(np.array_equal(w, v) for w, v in zip(written, wanted))   # each byte exactly once


def round_trip(req, make_send, build_plan, generator_seed):
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(generator_seed))
    send = make_send(layers, req)
    plan = build_plan(req)
    assert send.numel() == plan.src_size
    check_exactly_once(plan, req)
    banks = [np.zeros(s, np.uint8) for s in req.tt.region_sizes]
    apply_plan(plan, send.numpy(), banks)
    for layer in range(req.gpu.num_layers):
        tokens = gather_tokens(layers[layer].float().numpy(), req.gpu, req.block_table,
                               req.num_tokens)                  # [2, T, H, D]
        for kv in (0, 1):
            got = read_tt_tokens(banks, req.tt, layer, kv, req.tt_blocks, req.num_tokens)
            want = quantize(tokens[kv], req.tt.dtype)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (layer, kv)
    return plan


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 150), heads=st.integers(1, 3),
       head=st.sampled_from([32, 40, 64, 96]), gpu_bs=st.sampled_from([16, 32]),
       order=st.sampled_from(["NHD", "HND"]), tt_bs=st.sampled_from([32, 64]),
       dtype=st.sampled_from(DTYPES), banks=st.integers(1, 12),
       alignment=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**31))
def test_hawk_round_trip(num_tokens, heads, head, gpu_bs, order, tt_bs, dtype, banks,
                         alignment, seed):
    rng = np.random.default_rng(seed)
    req = make_transfer(rng, num_tokens, heads, head, gpu_bs, order, tt_bs, dtype, banks,
                        alignment=alignment)
    plan = round_trip(req, transform.hawk_transform, hawk_plan, seed)
    runs = len(contiguous_runs(req.tt_blocks))
    assert plan.num_writes <= req.num_tensors * runs * banks


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.integers(1, 100), dtype=st.sampled_from(DTYPES), banks=st.integers(1, 12),
       seed=st.integers(0, 2**31))
def test_per_page_round_trip(num_tokens, dtype, banks, seed):
    req = make_transfer(np.random.default_rng(seed), num_tokens, 2, 64, 16, "NHD", 32, dtype,
                        banks)
    plan = round_trip(req, transform.page_order_transform, per_page_plan, seed)
    assert plan.num_writes == req.num_tensors * req.pages_per_tensor


def test_gather_tokens_is_the_request_in_gpu_dtype():
    req = make_transfer(np.random.default_rng(5), 50, 2, 32, 16, "HND", 32, "bfloat16", 8)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(0))
    raw = transform.gather_tokens(layers, req)
    assert raw.numel() == req.token_bytes
    got = raw.view(torch.bfloat16).reshape(2, 2, 50, 2, 32)[1].float().numpy()
    assert np.array_equal(got, gather_tokens(layers[1].float().numpy(), req.gpu,
                                             req.block_table, 50))


def test_layer_shape_mismatch_names_the_shape():
    req = make_transfer(np.random.default_rng(6), 20, 1, 32, 16, "NHD", 32, "bfloat16", 8)
    layers = transform.make_gpu_cache(req.gpu)
    layers[1] = layers[1].transpose(2, 3)
    with pytest.raises(ValueError, match=r"layer 1 has shape .* expected"):
        transform.hawk_transform(layers, req)
    with pytest.raises(ValueError, match="1 layer tensors"):
        transform.hawk_transform(layers[:1], req)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available here")
def test_hawk_transform_on_cuda_matches_cpu():
    req = make_transfer(np.random.default_rng(7), 300, 2, 128, 16, "NHD", 32, "bfloat8_b", 8)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(0))
    cpu = transform.hawk_transform(layers, req)
    cuda = transform.hawk_transform([x.cuda() for x in layers], req)
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.cpu(), cpu)


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.integers(1, 130), dtype=st.sampled_from(DTYPES), banks=st.integers(1, 12),
       order=st.sampled_from(["NHD", "HND"]), seed=st.integers(0, 2**31))
def test_fused_gather_equals_the_papers_two_steps(num_tokens, dtype, banks, order, seed):
    req = make_transfer(np.random.default_rng(seed), num_tokens, 2, 48, 16, order, 32, dtype,
                        banks, alignment=128)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(seed))
    gather = transform.prepare(req, "hawk")
    fused = transform.hawk_transform(layers, req, gather=gather)
    steps = transform._transform_stepwise(layers, req, hawk_segments(req)[0], req.page_stride)
    assert torch.equal(fused, steps)


@pytest.mark.parametrize("batch_tiles", [1, 7, 40])
def test_batched_packing_equals_the_papers_two_steps(monkeypatch, batch_tiles):
    # small batches: packing splits runs of TT blocks; shapes not multiples of 32, both
    # orders, aligned and unaligned banks, every cache dtype
    monkeypatch.setattr(transform, "PACK_BATCH_TILES", batch_tiles)
    rng = np.random.default_rng(batch_tiles)
    for _ in range(12):
        order, dtype = rng.choice(["NHD", "HND"]), rng.choice(DTYPES)
        gpu_dtype = rng.choice(["bfloat16", "float16", "float32"])
        req = make_transfer(rng, int(rng.integers(1, 230)), int(rng.integers(1, 4)),
                            int(rng.choice([32, 64, 96])), int(rng.choice([16, 32, 48])), order,
                            int(rng.choice([32, 64])), dtype, int(rng.integers(1, 13)),
                            alignment=int(rng.choice([32, 64, 128])), gpu_dtype=gpu_dtype)
        layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(1))
        for kind, order_ in (("hawk", hawk_segments(req)[0]), ("per_page", None)):
            gather = transform.prepare(req, kind)
            make = transform.hawk_transform if kind == "hawk" else transform.page_order_transform
            steps = transform._transform_stepwise(layers, req, order_, gather.stride)
            assert torch.equal(make(layers, req, gather=gather), steps), (kind, req.gpu, req.tt)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_face_row_gather_equals_the_strided_copy(order, dtype):
    # values sent as they are into contiguous rows: one index_select of face rows
    rng = np.random.default_rng(11)
    for banks, tokens in ((8, 300), (7, 77), (12, 130), (1, 33)):
        req = make_transfer(rng, tokens, 2, 64, 16, order, 32, dtype, banks, gpu_dtype=dtype)
        layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(banks))
        for kind, page_order in (("hawk", hawk_segments(req)[0]), ("per_page", None)):
            gather = transform.prepare(req, kind)
            if gather.stride != req.tt.page_bytes:
                continue
            assert gather.tiles.units is not None
            copied = dataclasses.replace(gather, tiles=dataclasses.replace(gather.tiles,
                                                                           units=None))
            make = transform.hawk_transform if kind == "hawk" else transform.page_order_transform
            fast = make(layers, req, gather=gather)
            assert torch.equal(fast, make(layers, req, gather=copied))
            steps = transform._transform_stepwise(layers, req, page_order, gather.stride)
            assert torch.equal(fast, steps)


def test_transform_fills_a_given_send_buffer():
    req = make_transfer(np.random.default_rng(8), 40, 1, 64, 16, "NHD", 32, "bfloat16", 5)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(1))
    out = torch.full((hawk_plan(req).src_size,), 7, dtype=torch.uint8)
    assert transform.hawk_transform(layers, req, out=out) is out
    assert torch.equal(out, transform.hawk_transform(layers, req))
    with pytest.raises(ValueError, match="send buffer must be"):
        transform.hawk_transform(layers, req, out=out[1:])
    with pytest.raises(ValueError, match="'per_block'"):
        transform.prepare(req, "per_block")


def test_benchmark_reports_counts_and_ratios(capsys):
    from hardware import layout_bench
    result = layout_bench.run(tokens=256, repeats=1, bench_layers=1, tp=8, dram="wormhole")
    counts = result["write_counts"]
    assert counts["hawk"]["per_tensor"] == 12 and counts["per_page"]["per_tensor"] == 32
    assert counts["per_gpu_block"]["per_tensor"] == 16
    assert {t["dtype"] for t in result["throughput"]} == {"bfloat16", "bfloat8_b", "bfloat4_b"}
    req = layout_bench.make_transfer(256, 8, "wormhole", "bfloat8_b", 1)
    for t in result["throughput"]:                  # the baseline copies the bytes read
        assert t["bytes_in"] == req.num_tensors * req.block_table.size * req.gpu.block_bytes
        assert t["ratio"] == pytest.approx(t["copy_s"] / t["transform_s"])
        assert t["transform_gbps"] == pytest.approx(t["bytes_in"] / t["transform_s"] / 1e9)
    assert "copy_ of the same bytes" in layout_bench.format_table(result)
    assert layout_bench.main(["--tokens", "128", "--layers", "1", "--repeats", "1", "--json"]) == 0
    assert '"write_counts"' in capsys.readouterr().out


def numpy_send_buffer(layers, req, page_order, stride):
    """The send buffer built step by step with the numpy reference packing (hardware.tiles)."""
    out = np.zeros((req.gpu.num_layers, 2, req.pages_per_tensor, stride), np.uint8)
    for i, layer in enumerate(layers):
        tokens = gather_tokens(layer.float().numpy(), req.gpu, req.block_table, req.num_tokens)
        for kv in (0, 1):
            packed, _ = np_pack(to_tt_blocks(tokens[kv], req.tt.block_size), req.tt.dtype)
            pages = packed.reshape(req.pages_per_tensor, req.tt.page_bytes)
            out[i, kv, :, :req.tt.page_bytes] = pages if page_order is None else pages[page_order]
    return out.reshape(-1)


def check_against_numpy(req, kind, seed):
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(seed))
    gather = transform.prepare(req, kind)
    make = transform.hawk_transform if kind == "hawk" else transform.page_order_transform
    got = make(layers, req, gather=gather).numpy()
    order = hawk_segments(req)[0] if kind == "hawk" else None
    assert np.array_equal(got, numpy_send_buffer(layers, req, order, gather.stride))
    return gather


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 200), heads=st.integers(1, 3),
       head=st.sampled_from([32, 64, 96, 128]), gpu_bs=st.sampled_from([16, 32, 48]),
       order=st.sampled_from(["NHD", "HND"]), tt_bs=st.sampled_from([32, 64]),
       dtype=st.sampled_from(DTYPES), gpu_dtype=st.sampled_from(["bfloat16", "float16",
                                                                "float32"]),
       banks=st.integers(1, 12), alignment=st.sampled_from([32, 64, 128]),
       kind=st.sampled_from(["hawk", "per_page"]), seed=st.integers(0, 2**31))
def test_block_gather_gives_the_numpy_bytes(num_tokens, heads, head, gpu_bs, order, tt_bs,
                                            dtype, gpu_dtype, banks, alignment, kind, seed):
    req = make_transfer(np.random.default_rng(seed), num_tokens, heads, head, gpu_bs, order,
                        tt_bs, dtype, banks, alignment=alignment, gpu_dtype=gpu_dtype)
    gather = check_against_numpy(req, kind, seed)
    assert gather.tiles is not None and gather.units is None


def fixed_transfer(tt_blocks, banks, num_tokens=300, dtype="bfloat8_b", order="NHD"):
    gpu = GpuKVSpec(num_layers=2, num_blocks=40, num_kv_heads=2, head_size=128, order=order)
    tt = TTKVSpec(num_layers=2, max_num_blocks=16, num_kv_heads=2, head_dim=128, dtype=dtype,
                  dram=DramConfig(num_banks=banks, alignment=64, bank_bytes=1 << 22))
    table = np.random.default_rng(0).permutation(40)[:-(-num_tokens // 16)]
    return RequestTransfer(gpu, tt, table, np.asarray(tt_blocks), num_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bank_regroup_folds_into_the_tilize_copy_when_aligned(dtype):
    # 8 pages per block on 8 banks from bank 0: one strided copy per run of blocks
    req = fixed_transfer(np.arange(10), 8, dtype=dtype)
    runs = check_against_numpy(req, "hawk", 1).tiles.runs
    assert runs == ((0, 10, 0, (1, 40, 0, 10)),)       # row = 40 h + 10 tc + b
    two_runs = fixed_transfer([0, 1, 2, 3, 4, 9, 10, 11, 12, 13], 8, dtype=dtype, order="HND")
    assert len(check_against_numpy(two_runs, "hawk", 2).tiles.runs) == 2


@pytest.mark.parametrize("banks, first", [(12, 0), (7, 0), (6, 1)])
def test_unaligned_banks_reorder_whole_pages(banks, first):
    req = fixed_transfer(np.arange(10) + first, banks)
    tiles = check_against_numpy(req, "hawk", 3).tiles
    assert tiles.runs is None
    assert sorted(tiles.rows.tolist()) == list(range(2 * req.pages_per_tensor))


def narrow_tiles(rng, n, dtype):
    """Tiles of bfloat16 or float16 values: normal groups over a wide range of scales, with
    all-zero groups, signed zeros and values at the saturation edge mixed in."""
    spread = 20 if dtype == torch.bfloat16 else 8                    # float16 stays finite
    x = rng.standard_normal((n * 64, 16)) * np.exp2(rng.integers(-spread, spread, (n * 64, 1)))
    x[rng.random(n * 64) < 0.1] = 0.0
    x[rng.random(x.shape) < 0.02] = -0.0
    edge = rng.random(n * 64) < 0.05
    x[edge, 0] = np.copysign(255 / 128, x[edge, 0]) * np.exp2(rng.integers(-5, 5, edge.sum()))
    return torch.from_numpy(x.reshape(n, 1024).astype(np.float32)).to(dtype)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 40),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), mag_bits=st.sampled_from([7, 3]))
def test_short_block_float_recipe_is_exact(seed, n, dtype, mag_bits):
    tiles = narrow_tiles(np.random.default_rng(seed), n, dtype)
    want = bfp_encode(tiles.float().numpy(), mag_bits)
    out = torch.zeros(n, want.shape[1], dtype=torch.uint8)
    assert tile_torch._bfp_narrow(tiles.float(), mag_bits, out, tile_torch.Scratch(n, "cpu"))
    assert np.array_equal(out.numpy(), want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       mag_bits=st.sampled_from([7, 3]))
def test_block_float_bytes_of_any_bit_pattern(seed, dtype, mag_bits):
    # every 16-bit pattern can occur: NaN, inf, denormals, tiny groups take the integer recipe
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, (3, 1024), dtype=np.uint16)
    bits[0, :512] &= 0x807F                      # bfloat16: zeros and denormals only
    bits[1] &= 0x81FF                            # bfloat16: shared exponents 0..3
    tiles = torch.from_numpy(bits.view(np.int16)).view(dtype)
    want = bfp_encode(tiles.float().numpy(), mag_bits)
    assert np.array_equal(tile_torch.bfp_bytes(tiles, mag_bits, chunk=1).numpy(), want)
    assert np.array_equal(tile_torch.bfp_bytes(tiles.float(), mag_bits).numpy(), want)
