"""Transfer plans per mechanism: docs/facts.md write counts, bounds, and what each plan moves."""

import numpy as np
import pytest

from hardware.dram import DramConfig, blackhole_p150a, contiguous_runs, wormhole
from hardware.kv_layout import GpuKVSpec, TTKVSpec, gather_tokens, scatter_tokens
from hardware.mechanism_plans import (RequestTransfer, all_plans, apply_plan, check_disjoint,
                            hawk_plan, per_gpu_block_plan, single_buffer_plan)


def llama70b_transfer(dram, num_tokens=4096, layers=1, heads=1, contiguous=True):
    """One chip's share of a Llama-3.1-70B request (bs 16 on the GPU, 32 bfp8 on the NPU)."""
    n_gpu, n_tt = -(-num_tokens // 16), -(-num_tokens // 32)
    gpu = GpuKVSpec(num_layers=layers, num_blocks=2 * n_gpu + 4, num_kv_heads=heads,
                    head_size=128)
    tt = TTKVSpec(num_layers=layers, max_num_blocks=2 * n_tt + 4, num_kv_heads=heads,
                  head_dim=128, dram=dram)
    rng = np.random.default_rng(0)
    table = rng.permutation(gpu.num_blocks)[:n_gpu]
    tt_blocks = np.arange(n_tt) + 3 if contiguous else rng.permutation(tt.max_num_blocks)[:n_tt]
    return RequestTransfer(gpu, tt, table, tt_blocks, num_tokens)


@pytest.mark.parametrize("dram, hawk", [(wormhole(), 12), (blackhole_p150a(), 8)])
def test_facts_write_counts_for_4096_tokens(dram, hawk):
    plans = all_plans(llama70b_transfer(dram))
    per_tensor = {kind: plan.num_writes // 2 for kind, plan in plans.items()}  # K and V
    assert per_tensor["per_page"] == 512
    assert per_tensor["per_gpu_block"] == 256
    assert per_tensor["hawk"] == hawk
    assert np.array_equal(plans["hawk"].writes_per_region(), np.full(dram.num_banks, 2))
    for plan in plans.values():
        plan.check_bounds(plan.src_size, plan.region_sizes)
        check_disjoint(plan)


def test_hawk_pays_one_write_per_bank_per_run():
    req = llama70b_transfer(blackhole_p150a(), num_tokens=1024, contiguous=False)
    runs = contiguous_runs(req.tt_blocks)
    plan = hawk_plan(req)
    assert len(runs) > 1
    # each run of b blocks has 4b pages: min(4b, 8) banks receive some
    assert plan.num_writes == 2 * sum(min(4 * n, 8) for _, n in runs)
    assert plan.total_bytes == 2 * 32 * 4 * 1088


def test_per_gpu_block_round_trip_and_merge():
    rng = np.random.default_rng(1)
    req = llama70b_transfer(wormhole(), num_tokens=100, layers=2, heads=2)
    g = req.gpu
    src = [np.zeros(g.physical_shape, np.float32).astype(np.uint16) for _ in range(2)]
    kv = rng.integers(0, 2**16, (2, 2, 100, 2, 128), dtype=np.uint16)
    for layer in range(2):
        scatter_tokens(src[layer], g, req.block_table, kv[layer])
    dst_table = rng.permutation(g.num_blocks)[:7]
    plan = per_gpu_block_plan(req, dst_table)
    assert plan.num_writes == 2 * 2 * 7
    regions = [np.zeros(n, np.uint8) for n in plan.region_sizes]
    apply_plan(plan, np.concatenate([s.reshape(-1) for s in src]).view(np.uint8), regions)
    for layer in range(2):
        peer = np.stack([regions[2 * layer + kv_].view(np.uint16).reshape(g.physical_shape[1:])
                         for kv_ in (0, 1)])
        assert np.array_equal(gather_tokens(peer, g, dst_table, 100), kv[layer])
    contiguous = RequestTransfer(g, req.tt, np.arange(5, 12), req.tt_blocks, 100)
    assert per_gpu_block_plan(contiguous, merge=True).num_writes == 2 * 2
    assert per_gpu_block_plan(contiguous, merge=True).total_bytes == plan.total_bytes


def test_single_buffer_loads_banks_unevenly():
    dram = DramConfig(num_banks=8, bank_bytes=1 << 20)
    req = llama70b_transfer(dram, num_tokens=512, layers=8, heads=1)   # 2 MiB of bf16 tokens
    plan = single_buffer_plan(req, base=(1 << 20) - 4096)
    plan.check_bounds(plan.src_size, plan.region_sizes)
    check_disjoint(plan)
    per_bank = np.array(plan.extra["staging_bank_bytes"])
    assert per_bank.sum() == req.token_bytes == plan.total_bytes
    assert per_bank[0] == 4096 and per_bank[1] == 1 << 20 and per_bank[3:].sum() == 0
    assert plan.extra["staging_imbalance"] == pytest.approx(per_bank.max() / per_bank.mean())
    assert plan.extra["staging_imbalance"] > 3
    assert plan.num_writes == 16 + 2                 # one per tensor, two cut at bank boundaries
    assert plan.extra["relayout_bytes"] == req.token_bytes
    with pytest.raises(ValueError, match="outside"):
        single_buffer_plan(req, base=8 << 20)


def test_single_buffer_and_host_staged_copy_the_token_bytes():
    req = llama70b_transfer(DramConfig(num_banks=4, bank_bytes=1 << 16), 64, layers=2)
    src = np.random.default_rng(2).integers(0, 256, req.token_bytes, dtype=np.uint8)
    plans = all_plans(req)
    hs = plans["host_staged"]
    assert hs.extra["host_copies"] == 2 and hs.extra["d2h_bytes"] == req.token_bytes
    host = [np.zeros(n, np.uint8) for n in hs.region_sizes]
    apply_plan(hs, src, host)
    assert np.array_equal(host[0], src)
    sb = plans["single_buffer"]
    banks = [np.zeros(n, np.uint8) for n in sb.region_sizes]
    apply_plan(sb, src, banks)
    assert np.array_equal(np.concatenate(banks)[:src.size], src)


def test_mismatched_sides_name_the_difference():
    req = llama70b_transfer(wormhole(), 64)
    tt = TTKVSpec(num_layers=1, max_num_blocks=8, num_kv_heads=2, head_dim=128, dram=wormhole())
    with pytest.raises(ValueError, match="num_kv_heads: 1 vs 2"):
        RequestTransfer(req.gpu, tt, req.block_table, req.tt_blocks, 64)
    with pytest.raises(ValueError, match="TT block table has 3 blocks"):
        RequestTransfer(req.gpu, req.tt, req.block_table, [0, 1, 2], 64)
    with pytest.raises(ValueError, match="repeats"):
        RequestTransfer(req.gpu, req.tt, req.block_table, [1, 1], 64)
