"""Transfer pricing: closed-form counts equal the plans', orderings, host slowdown."""

import re
from pathlib import Path

import numpy as np
import pytest

from hardware import catalog
from hardware.catalog import ModelSpec
from hardware.dram import DramConfig
from hardware.kv_layout import GpuKVSpec, TTKVSpec
from hardware.plans import PLAN_BUILDERS, RequestTransfer
from sim.transfer import (MECHANISMS, InstanceFacts, MechanismPricing, TransferParams,
                          host_slowdown, isolated_latency, plan_counts, transfer_params)

A100, P150 = catalog.device("a100-pcie"), catalog.device("p150a")
SMALL = ModelSpec("tiny", "tiny", 2, 256, 4, 8, 128, 512, 1000, 4096)   # 2 layers, 8 KV heads
BANK = 96 * 1024 + 4096      # small banks so the single buffer crosses bank boundaries


def _request(tokens: int, gpu_blocks=None, tt_blocks=None) -> RequestTransfer:
    g = GpuKVSpec(2, 200, 2, 128, 16, "bfloat16", "HND")
    tt = TTKVSpec(2, 100, 2, 128, DramConfig(8, bank_bytes=BANK), 32, "bfloat8_b")
    gb = np.arange(-(-tokens // 16)) if gpu_blocks is None else gpu_blocks
    tb = np.arange(-(-tokens // 32)) if tt_blocks is None else tt_blocks
    return RequestTransfer(g, tt, gb, tb, tokens)


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 31, 32, 33, 64, 100, 257, 300])
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_counts_equal_the_plans(name, tokens):
    mech = MECHANISMS[name]
    prefill = InstanceFacts(A100, 4, "bfloat16", 16)
    decode = (InstanceFacts(A100, 4, "bfloat16", 16) if mech.destination == "gpu"
              else InstanceFacts(P150, 4, "bfloat8_b", 32))
    plan = PLAN_BUILDERS[mech.plan](_request(tokens))
    counts = plan_counts(mech, SMALL, prefill, decode, tokens, BANK)
    assert (counts.num_writes, counts.wire_bytes) == (plan.num_writes, plan.total_bytes)


def test_hawk_tt_blocks_offset_keeps_one_write_per_bank():
    """A contiguous TT run starting mid-row still needs min(N, pages) writes per tensor."""
    plan = PLAN_BUILDERS["hawk"](_request(200, tt_blocks=np.arange(3, 10)))
    counts = plan_counts(MECHANISMS["GN-HAWK"], SMALL, InstanceFacts(A100, 4, "bfloat16", 16),
                         InstanceFacts(P150, 4, "bfloat8_b", 32), 200, BANK)
    assert counts.num_writes == plan.num_writes


def _pricing(name: str, params=None) -> MechanismPricing:
    model = catalog.model("llama-3.1-70b")
    mech = MECHANISMS[name]
    decode = (InstanceFacts(A100, 4, "fp8", 16) if mech.destination == "gpu"
              else InstanceFacts(P150, 4, "bfloat8_b", 32))
    return MechanismPricing(name, model, InstanceFacts(A100, 4, "fp8", 16), decode,
                            params or transfer_params("paper"))


@pytest.mark.parametrize("mb", [10, 20, 40, 80, 160, 320, 640, 1280])
def test_orderings_at_every_size(mb):
    tokens = mb * 1024 * 1024 // (160 * 1024)
    bw = transfer_params("paper").link_gb_s * 1e9
    lat = {n: isolated_latency(_pricing(n).price(tokens), bw) for n in MECHANISMS}
    assert lat["GG-Direct"] < lat["GN-HAWK"] < lat["GG-Host"] < lat["GN-Host"]
    assert lat["GN-HAWK"] < lat["GN-PerPage"] and lat["GN-HAWK"] < lat["GN-Direct"]


def test_price_is_memoised_and_consistent():
    pricing = _pricing("GN-HAWK")
    first = pricing.price(742)
    assert pricing.price(742) is first
    assert first.num_writes == 4 * 160 * 8           # 4 chips x 160 tensors x 8 banks
    assert first.wire_bytes == pytest.approx(4 * pricing.counts(742).wire_bytes)
    assert first.after_s == 0 and first.host_cpu_s == 0


def test_host_cpu_time_and_slowdown_only_for_host_staged():
    params = transfer_params("paper")
    for name, mech in MECHANISMS.items():
        cost = _pricing(name).price(512)
        if mech.host_staged:
            assert cost.host_cpu_s > 0 and host_slowdown(name, params) > 1
        else:
            assert cost.host_cpu_s == 0 and host_slowdown(name, params) == 1


def test_isolated_latency_is_closed_form():
    params = TransferParams(request_setup_s=0.001, per_write_s=0.0)
    cost = _pricing("GG-Direct", params).price(6400)
    wire = 4 * 160 * 400 * 16 * 2 * 128          # 4 ranks, 160 tensors, 400 blocks of 16 tokens
    assert cost.wire_bytes == wire
    assert isolated_latency(cost, 20e9) == pytest.approx(0.001 + wire / 20e9)


def _scaled(k: float) -> TransferParams:
    return TransferParams(**{**transfer_params("paper").__dict__, "time_scale": k})


@pytest.mark.parametrize("tokens", [64, 1000, 8192])
def test_time_scale_multiplies_every_time_and_keeps_every_ratio(tokens):
    """Fixed costs times k, bandwidths (the link's too) over k: each latency k times longer,
    each latency ratio (what Figure 9 reports) unchanged, bytes and writes untouched."""
    one, three = _scaled(1.0), _scaled(3.0)
    assert three.link_gb_s == pytest.approx(one.link_gb_s / 3)
    lat = {}
    for name in MECHANISMS:
        a, b = _pricing(name, one).price(tokens), _pricing(name, three).price(tokens)
        assert (b.wire_bytes, b.num_writes) == (a.wire_bytes, a.num_writes)
        assert b.host_cpu_s == pytest.approx(3 * a.host_cpu_s, rel=1e-12)
        lat[name] = (isolated_latency(a, one.link_gb_s * 1e9),
                     isolated_latency(b, three.link_gb_s * 1e9))
        assert lat[name][1] == pytest.approx(3 * lat[name][0], rel=1e-12)
    for name in MECHANISMS:
        assert (lat[name][1] / lat["GG-Host"][1]
                == pytest.approx(lat[name][0] / lat["GG-Host"][0], rel=1e-12))


def test_gn_host_relayout_on_npu_is_priced_too():
    base = transfer_params("paper")
    host = _pricing("GN-Host").price(1000)
    npu = _pricing("GN-Host", TransferParams(**{**base.__dict__, "relayout_at": "npu"})).price(1000)
    assert npu.after_s != host.after_s and npu.host_cpu_s > 0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown transfer mechanism"):
        MechanismPricing("GN-Fast", SMALL, InstanceFacts(A100, 4, "fp8", 16),
                         InstanceFacts(P150, 4, "bfloat8_b", 32), TransferParams())
    with pytest.raises(ValueError, match="NPU decode device"):
        MechanismPricing("GN-HAWK", SMALL, InstanceFacts(A100, 4, "fp8", 16),
                         InstanceFacts(A100, 4, "fp8", 16), TransferParams())
    with pytest.raises(ValueError, match="relayout_at"):
        TransferParams(relayout_at="gpu")
    with pytest.raises(ValueError, match="host_slowdown"):
        TransferParams(host_slowdown=0.5)
    with pytest.raises(ValueError, match="time_scale"):
        TransferParams(time_scale=0.0)


@pytest.mark.parametrize("mechanism", ["GG-Host", "GN-HAWK"])
def test_simulated_transfer_follows_the_profile_time_scale(tmp_path, mechanism):
    """One request alone: its transfer takes k times as long under a profile with time_scale k
    (the link's one-way latency aside), and the same bytes are recorded."""
    from sim.cluster import simulate
    from sim.paper import serving_config
    from tests.builders import make_trace

    text = (Path(__file__).resolve().parents[1] / "sim" / "profiles" / "paper.toml").read_text()
    trace = make_trace([0.0], [1500], [4])
    runs = {}
    for k in (1.0, 4.0):
        path = tmp_path / f"scale_{k}.toml"
        path.write_text(re.sub(r"(?m)^time_scale = .*$", f"time_scale = {k}", text))
        config = serving_config(mechanism, profile=str(path))
        runs[k] = simulate(config, trace).records.iloc[0]
    latency = serving_config(mechanism).cluster.link.latency_s
    took = {k: r.transfer_end_at - r.transfer_start_at - latency for k, r in runs.items()}
    assert took[4.0] == pytest.approx(4 * took[1.0], rel=1e-9)
    assert runs[4.0].kv_bytes == runs[1.0].kv_bytes > 0
