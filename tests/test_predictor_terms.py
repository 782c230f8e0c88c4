"""The step time's grounded terms: each default leaves the roofline's floats unchanged, and each
term, switched on, changes the step as its physics says, in both engines' timing."""

import dataclasses

import numpy as np
import pytest

from hardware import catalog
from sim.models.efficiency import Efficiency
from sim.models.predictor import RooflinePredictor
from sim.models.rooflines import HostBoundRoofline, roofline

BASE = Efficiency(prefill_compute_efficiency=0.5, prefill_memory_efficiency=0.8,
                  decode_compute_efficiency=0.3, decode_memory_efficiency=0.6,
                  step_overhead_s=0.01, allreduce_latency_s=20e-6)
MODEL, DEVICE = catalog.model("llama-3.1-70b"), catalog.device("a100-sxm")


def make(tp=4, **changes):
    return roofline(MODEL, DEVICE, tp, dataclasses.replace(BASE, **changes))


def test_defaults_give_the_same_floats_as_stating_them():
    stated = make(prefill_step_overhead_s=0.01, prefill_attention_efficiency=None,
                  decode_per_seq_s=0.0, allreduce_hop_latency_s=0.0, allreduce_overlap=0.0)
    plain = make()
    assert type(plain) is RooflinePredictor
    for n in (1, 128, 2048, 9000):
        assert stated.prefill_time([n]) == plain.prefill_time([n])
    for batch, context in ((1, 100), (32, 32 * 700), (256, 256 * 3000)):
        assert stated.decode_time(batch, context, 50) == plain.decode_time(batch, context, 50)
        assert (stated.mixed_step_time([(512, 100)], [700] * batch)
                == plain.mixed_step_time([(512, 100)], [700] * batch))


def test_prefill_overhead_and_attention_efficiency_apply_to_prompt_steps_only():
    plain, own = make(), make(prefill_step_overhead_s=0.05)
    assert own.prefill_time([1000]) == pytest.approx(plain.prefill_time([1000]) + 0.04)
    assert own.decode_step_time(8, 8000) == plain.decode_step_time(8, 8000)
    slow = make(prefill_attention_efficiency=0.05)
    # attention's FLOPs grow with the square of the prompt: the slower kernel costs ever more
    extra = [slow.prefill_time([n]) - plain.prefill_time([n]) for n in (2048, 4096, 8192)]
    assert 0 < extra[0] and extra[1] == pytest.approx(4 * extra[0], rel=0.02)
    assert extra[2] == pytest.approx(4 * extra[1], rel=0.02)


def test_per_sequence_cost_grows_the_step_with_the_batch():
    plain, per = make(), make(decode_per_seq_s=2e-4)
    for batch in (1, 16, 64):
        assert per.decode_step_time(batch, batch * 500) == pytest.approx(
            plain.decode_step_time(batch, batch * 500) + 2e-4 * batch)
        assert per.mixed_step_time([(256, 0)], [500] * batch) == pytest.approx(
            plain.mixed_step_time([(256, 0)], [500] * batch) + 2e-4 * batch)


def test_hop_latency_is_paid_per_ring_step():
    """2 (tp - 1) steps per all-reduce, 2 all-reduces per layer."""
    for tp in (2, 4, 8):
        plain, hops = make(tp), make(tp, allreduce_hop_latency_s=5e-6)
        extra = hops.allreduce_time(32) - plain.allreduce_time(32)
        assert extra == pytest.approx(2 * MODEL.num_layers * 2 * (tp - 1) * 5e-6)
    assert make(1, allreduce_hop_latency_s=5e-6).allreduce_time(32) == 0.0


def test_allreduce_overlap_hides_at_most_the_shorter_side():
    plain, half = make(), make(allreduce_overlap=0.5)
    comm = plain.allreduce_time(2048)
    assert half.prefill_time([2048]) == pytest.approx(plain.prefill_time([2048]) - 0.5 * comm)
    full = make(allreduce_overlap=1.0)
    device = plain.prefill_time([2048]) - BASE.step_overhead_s          # roofline + comm
    assert full.prefill_time([2048]) == pytest.approx(
        max(device - comm, comm) + BASE.step_overhead_s)


def test_host_bound_step_is_the_longer_of_host_and_device():
    eff = dict(host_overlap=True, step_overhead_s=0.04, decode_per_seq_s=3e-4,
               prefill_step_overhead_s=0.06)
    host = make(**eff)
    assert isinstance(host, HostBoundRoofline)
    device = make(step_overhead_s=0.0, prefill_step_overhead_s=0.0)
    for n in (64, 512, 8192):
        assert host.prefill_time([n]) == pytest.approx(max(0.06, device.prefill_time([n])))
    for batch in (1, 64, 256):
        ctx = batch * 900
        assert host.decode_step_time(batch, ctx) == pytest.approx(
            max(0.04 + 3e-4 * batch, device.decode_step_time(batch, ctx)))
    # the aggregated engine's step: decodes alone = the decode step, one chunk = prefill
    assert host.mixed_step_time([], [900] * 64) == host.decode_step_time(64, 64 * 900)
    assert host.mixed_step_time([(700, 0)], []) == host.prefill_time([700])


def test_host_bound_decode_sums_match_the_steps():
    host = make(host_overlap=True, step_overhead_s=0.045, decode_per_seq_s=4e-4)
    rng = np.random.default_rng(1)
    for _ in range(30):
        batch, context = int(rng.choice([1, 8, 64, 200])), int(rng.integers(0, 600_000))
        steps = int(rng.integers(1, 400))
        each = [host.decode_step_time(batch, context + batch * i) for i in range(steps)]
        assert host.decode_time(batch, context, steps) == pytest.approx(sum(each))
        elapsed = float(rng.random()) * sum(each)
        j = host.decode_steps_within(batch, context, steps, elapsed)
        assert sum(each[:j]) <= elapsed * (1 + 1e-12) and (j == steps or sum(each[:j + 1])
                                                          > elapsed)


@pytest.mark.parametrize("field, value, message", [
    ("host_overlap", "yes", "host_overlap = 'yes' must be true or false"),
    ("allreduce_overlap", 1.5, "allreduce_overlap = 1.5 must be in [0, 1]"),
    ("prefill_attention_efficiency", 0.0, "prefill_attention_efficiency = 0.0 must be in"),
    ("decode_per_seq_s", -1e-3, "decode_per_seq_s = -0.001 must be in [0, 10] seconds"),
])
def test_bad_terms_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dataclasses.replace(BASE, **{field: value})
