"""Sliding-window layers (``hardware.catalog.ModelSpec.attended_tokens``, ``attended_pairs``,
``kv_blocks``): a decode step past the window attends to and reads only the window on those
layers, a request's KV blocks stop growing there as vLLM frees them, a disaggregated request
sends only the window of those layers, and (where ``HAWK_VLLM_PYTHON`` names a python with
vLLM) one request's blocks against vLLM's own managers run on the same config."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hardware import catalog
from hardware.catalog import model_from_hf
from sim.engine.memory import make_pool
from sim.models.predictor import RooflinePredictor, load_profile
from sim.models.transfer import MECHANISMS, InstanceFacts, plan_counts
from tests.needs import vllm_python

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16

#: https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: a 4096-token window
#: on every layer
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 32768, "sliding_window": 4096}
#: https://huggingface.co/google/gemma-2-9b/blob/main/config.json (shapes): even layers slide
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
          "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
          "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
          "max_position_embeddings": 8192, "sliding_window": 4096}
#: a small Qwen2: layers from max_window_layers = 2 on slide (6 of 8)
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 32768,
        "use_sliding_window": True, "max_window_layers": 2, "sliding_window": 1024}


def spec(config: dict, **change):
    return model_from_hf({**config, **change}, "t", "t", "t.json")


def predictor(model):
    return RooflinePredictor(model, catalog.device("h100-sxm"), 1,
                             load_profile("paper")["h100-sxm"])


# --- timing --------------------------------------------------------------------------------

def test_a_mistral_decode_step_at_32k_costs_what_the_window_does():
    """Every layer slides: a step at context 32k attends to 4096 tokens, so it costs the
    unwindowed model's step at 4096, below its step at 32k; within the window, the same."""
    windowed, full = predictor(spec(MISTRAL)), predictor(spec(MISTRAL, sliding_window=None))
    for batch in (1, 8):
        at_32k = windowed.decode_step_time(batch, batch * 32768)
        assert at_32k < full.decode_step_time(batch, batch * 32768)
        assert at_32k == full.decode_step_time(batch, batch * 4096)
        assert windowed.decode_step_time(batch, batch * 4000) == full.decode_step_time(
            batch, batch * 4000)
    assert full.decode_step_time(1, 32768) - windowed.decode_step_time(1, 32768) \
        > 0.5 * (full.decode_step_time(1, 32768) - full.decode_step_time(1, 0))


def test_a_mixed_models_decode_step_reads_full_layers_whole_and_sliding_ones_windowed():
    m = spec(GEMMA2)
    assert (m.num_sliding_layers, m.window) == (21, 4096)
    per_layer_token = 2 * 8 * 256 * 2                     # K and V, 8 heads x 256, bf16
    assert m.kv_bytes_per_token("bfloat16") == 42 * per_layer_token
    # 21 full layers x 6300 tokens + 21 sliding ones x 4096, over 42 layers
    assert m.attended_tokens(6300) * m.kv_bytes_per_token("bfloat16") == pytest.approx(
        (21 * 6300 + 21 * 4096) * per_layer_token, rel=1e-12)
    assert m.attended_tokens(3 * 6300, num_seqs=3) == pytest.approx(3 * (6300 + 4096) / 2)
    assert m.attended_tokens(4000) == 4000


def test_decode_runs_across_the_window_sum_their_steps():
    """The decode sums (the engines' fast-forward) equal the steps one by one, across the
    window's edge, and the boundary search agrees with them."""
    pred, batch, context = predictor(spec(MISTRAL)), 4, 4 * 4000
    steps = 300                                           # crosses 4096 per sequence at 96
    each = [pred.decode_step_time(batch, context + batch * i) for i in range(steps)]
    assert pred.decode_time(batch, context, steps) == pytest.approx(sum(each), rel=1e-12)
    half = sum(each[:150])
    assert pred.decode_steps_within(batch, context, steps, half) == 150
    assert pred.decode_next_boundary(batch, context, steps, half * 0.999)[0] == 150


def test_prompt_attention_counts_the_window():
    m, n, w = spec(MISTRAL), 10000, 4096
    assert m.attended_pairs(n) == w * (w + 1) // 2 + (n - w) * w
    assert m.attended_pairs(1000, 9000) == 1000 * w
    assert spec(MISTRAL, sliding_window=None).attended_pairs(1000, 9000) == 1000 * 9000 + \
        1000 * 1001 // 2
    windowed, full = predictor(m), predictor(spec(MISTRAL, sliding_window=None))
    assert windowed.prefill_time([3000]) == full.prefill_time([3000])
    assert windowed.prefill_time([32000]) < full.prefill_time([32000])
    assert windowed.mixed_step_time([(3000, 0)], []) == windowed.prefill_time([3000])
    assert windowed.mixed_step_time([], [32768, 100]) == windowed.decode_step_time(2, 32868)


# --- memory --------------------------------------------------------------------------------

def test_a_mistral_requests_blocks_stop_at_the_window():
    m, n = spec(MISTRAL), 32768
    assert m.kv_blocks(n, BLOCK) == 4096 // BLOCK + 1 == 257
    assert spec(MISTRAL, sliding_window=None).kv_blocks(n, BLOCK) == 2048
    assert m.kv_blocks(1200, BLOCK) == 75
    assert list(m.kv_blocks(np.array([1, 4096, 4097, 4112, 4113, 9000]), BLOCK)) == \
        [1, 256, 257, 257, 257, 257]
    pool = make_pool("block", 1000, BLOCK, kv_blocks=lambda t: m.kv_blocks(t, BLOCK))
    assert pool.try_reserve("a", 30000, 2768) == "ok"
    assert pool.held["a"] == 257
    assert pool.fits_ever(1_000_000, 1) and not make_pool("block", 1000, BLOCK).fits_ever(
        1_000_000, 1)


def test_a_mixed_models_request_bytes_equal_the_hand_computation():
    """Gemma-2 9B, 6300 tokens, blocks of 16: 21 full layers hold ceil(6300/16) = 394 blocks,
    21 sliding ones ceil(min(6300, 4096 + 16)/16) = 257; pooled into blocks of all 42 layers,
    ceil((21 x 394 + 21 x 257) / 42) = 326."""
    m = spec(GEMMA2)
    assert m.kv_blocks(6300, BLOCK) == 326
    block_bytes = m.kv_block_bytes("bfloat16", BLOCK, 1)
    assert block_bytes == 42 * BLOCK * 2 * 8 * 256 * 2
    assert 326 * block_bytes - (21 * 394 + 21 * 257) * BLOCK * 2 * 8 * 256 * 2 == \
        block_bytes / 2                                   # the pooled ceiling's half block
    q = spec(QWEN)                                        # 2 full, 6 sliding layers
    assert (q.num_sliding_layers, q.kv_blocks(6300, BLOCK)) == (6, -(-(2 * 394 + 6 * 65) // 8))
    assert spec(GEMMA2, sliding_window=None).kv_blocks(6300, BLOCK) == 394


# --- transfer ------------------------------------------------------------------------------

def test_a_disaggregated_request_sends_the_window_of_sliding_layers():
    gpu = InstanceFacts(catalog.device("h100-sxm"), 1, "bfloat16", BLOCK)
    mech = next(m for m in MECHANISMS.values() if m.destination == "gpu")
    windowed, full = spec(MISTRAL), spec(MISTRAL, sliding_window=None)
    assert plan_counts(mech, windowed, gpu, gpu, 20000) == plan_counts(mech, full, gpu, gpu,
                                                                       4096)
    assert plan_counts(mech, windowed, gpu, gpu, 3000) == plan_counts(mech, full, gpu, gpu, 3000)
    g = spec(GEMMA2)
    per_layer_token = 2 * 8 * 256 * 2
    assert plan_counts(mech, g, gpu, gpu, 6300).token_bytes == \
        (21 * 6300 + 21 * 4096) * per_layer_token


# --- against vLLM's own managers -----------------------------------------------------------

def test_request_blocks_match_vllms_sliding_window_managers():
    """vLLM's own managers (scripts/vllm_swa_blocks.py) run one request's decode steps; its
    peak bytes, rounded up to blocks of every layer, are ``kv_blocks``, and its pool holds as
    many layer-blocks as ours."""
    python, memory = vllm_python(), 8 * 2 ** 30
    cases = [(c, p, o) for c in (MISTRAL, GEMMA2, QWEN) for p, o in ((6000, 300), (1000, 200))]
    stdin = json.dumps([{"config": c, "block_size": BLOCK, "memory_bytes": memory,
                         "prompt": p, "output": o} for c, p, o in cases])
    done = subprocess.run([python, str(ROOT / "scripts" / "vllm_swa_blocks.py")], input=stdin,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    for (config, prompt, output), got in zip(cases, json.loads(done.stdout.splitlines()[-1])):
        m = spec(config)
        block_bytes = m.kv_block_bytes("bfloat16", BLOCK, 1)
        for g in got["groups"]:
            assert g["page_size_bytes"] * m.num_layers == block_bytes
            assert (g["sliding_window"] or 0) in (0, m.window)
        assert sum(g["num_layers"] for g in got["groups"] if g["sliding_window"]) == \
            m.num_sliding_layers
        assert m.kv_blocks(prompt + output, BLOCK) == math.ceil(got["request_bytes"]
                                                                / block_bytes)
        group_layers = got["groups"][0]["num_layers"]
        assert memory // block_bytes == got["num_blocks"] * group_layers // m.num_layers
        print(f"{config['model_type']} {prompt}+{output}: vLLM peak blocks per group "
              f"{[g['peak_blocks'] for g in got['groups']]}, {got['request_bytes']} B; "
              f"kv_blocks {m.kv_blocks(prompt + output, BLOCK)} x {block_bytes} B")
