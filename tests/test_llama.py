"""The Llama model against ``transformers``' LlamaForCausalLM (the oracle, used in tests only):
same weights through a safetensors checkpoint, same logits, same greedy tokens, through vLLM's
paged KV cache at any block size and any block placement."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from hardware.model.cache import PagedKVCache
from hardware.model.config import LlamaConfig, RopeScaling
from hardware.model.generate import greedy_generate
from hardware.model.llama import LlamaModel, rope_inv_freq

from conftest import ROOT

# rope_theta 10^4 and 64 original positions put head_dim 16's frequencies in all three bands
# of Llama 3 scaling (kept, interpolated, stretched); sequences here run past 64 positions.
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                   rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=64),
                   max_position_embeddings=256)
ATOL = RTOL = 1e-4     # float32: the two implementations differ by ~1e-6 of logits ~4
BF16_RTOL = 1.6e-2     # torch.testing's default relative tolerance for bfloat16


def make_tokens(shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def oracle(path) -> LlamaForCausalLM:
    hf = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    hf.generation_config.eos_token_id = None      # generate exactly max_new_tokens
    return hf


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaModel.random(TINY, seed=1, device="cpu").save(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return LlamaModel.load(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return oracle(checkpoint)


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits.float()                                        # [B, T, V]


def test_tiny_config_exercises_every_llama3_band():
    s = TINY.rope_scaling
    wavelen = 2 * math.pi * TINY.rope_theta ** (torch.arange(0, 16, 2) / 16)
    kept = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    stretched = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    assert kept.any() and stretched.any() and (~kept & ~stretched).any()
    plain = rope_inv_freq(LlamaConfig(**{**TINY.__dict__, "rope_scaling": None}))
    assert torch.equal(rope_inv_freq(TINY)[kept], plain[kept])
    assert not torch.equal(rope_inv_freq(TINY), plain)


def test_full_forward_matches_transformers(model, hf):
    tokens = make_tokens((3, 80))
    torch.testing.assert_close(model(tokens), hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size,shuffled", [(16, False), (16, True), (32, True)])
def test_prefill_then_paged_decode_matches_full_sequence(model, hf, block_size, shuffled):
    lengths, steps = [5, 17, 40], 30                     # decode crosses blocks and position 64
    full = make_tokens((3, max(lengths) + steps), seed=2)
    ref = hf_logits(hf, full)                                                   # [B, T, V]
    need = [-(-(n + steps) // block_size) for n in lengths]
    num_blocks = 2 * sum(need)                                     # half the blocks stay unused
    order = (torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
             if shuffled else list(range(num_blocks)))
    tables = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(3)]
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size)

    logits = model.prefill([full[i, :n].tolist() for i, n in enumerate(lengths)], cache, tables)
    for step in range(steps + 1):
        expect = torch.stack([ref[i, n + step - 1] for i, n in enumerate(lengths)])
        torch.testing.assert_close(logits, expect, atol=ATOL, rtol=RTOL)
        if step < steps:
            positions = [n + step for n in lengths]
            logits = model.decode(full[range(3), positions].tolist(), positions, cache, tables)

    unused = sorted(set(range(num_blocks)) - {b for t in tables for b in t})
    assert all(not layer[:, unused].any() for layer in cache.layers)    # writes stayed in tables


def test_extend_appends_chunks_of_any_length(model, hf):
    full = make_tokens((2, 60), seed=9)
    ref = hf_logits(hf, full)
    cache = PagedKVCache.for_model(model, num_blocks=8)
    tables = [[0, 1, 2, 3], [7, 6, 5, 4]]
    model.prefill([full[0, :10].tolist(), full[1, :3].tolist()], cache, tables)
    logits = model.extend([full[0, 10:60].tolist(), full[1, 3:21].tolist()], [10, 3], cache,
                          tables, all_logits=True)                                # [2, 50, V]
    torch.testing.assert_close(logits[0], ref[0, 10:60], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[1, :18], ref[1, 3:21], atol=ATOL, rtol=RTOL)


def test_greedy_generate_equals_transformers_generate(model, hf):
    prompts = [make_tokens((n,), seed=10 + n).tolist() for n in (1, 9, 33, 16)]
    max_new = [12, 0, 25, 7]
    outputs = greedy_generate(model, prompts, max_new)
    assert [len(o) for o in outputs] == max_new
    for prompt, out in zip(prompts, outputs):
        if out:
            ids = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(out),
                              pad_token_id=0)
            assert out == ids[0, len(prompt):].tolist()
    assert greedy_generate(model, prompts, max_new, block_size=32) == outputs


def test_loads_a_checkpoint_written_by_transformers(tmp_path):
    tied = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    LlamaModel.random(tied, seed=4, device="cpu").save(tmp_path / "ours")
    hf = oracle(tmp_path / "ours")
    hf.save_pretrained(tmp_path / "theirs")      # newer releases spell RoPE as rope_parameters
    assert LlamaConfig.from_json(tmp_path / "theirs") == tied
    model = LlamaModel.load(tmp_path / "theirs", device="cpu")
    tokens = make_tokens((2, 70), seed=5)
    torch.testing.assert_close(model(tokens), hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_bfloat16_stays_within_bfloat16_precision_of_the_oracle(checkpoint, hf):
    model = LlamaModel.load(checkpoint, dtype=torch.bfloat16, device="cpu")
    tokens = make_tokens((2, 70), seed=6)
    ref = hf_logits(hf, tokens)
    logits = model(tokens)
    assert model.dtype == torch.bfloat16
    assert PagedKVCache.for_model(model, num_blocks=1).layers[0].dtype == torch.bfloat16
    assert (logits - ref).abs().max() <= BF16_RTOL * ref.abs().max()


def test_random_weights_are_seeded():
    a, b = (LlamaModel.random(TINY, seed=7, device="cpu").state_dict() for _ in range(2))
    c = LlamaModel.random(TINY, seed=8, device="cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))


def test_config_round_trips_through_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_dict()))
    assert LlamaConfig.from_json(tmp_path) == TINY
    assert LlamaConfig.from_dict({**TINY.to_dict(), "rope_scaling": None}).rope_scaling is None


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'; allowed"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 must divide num_attention_heads 4"),
    ({"hidden_size": None}, "missing field.*hidden_size"),
    ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
])
def test_bad_config_names_the_file_and_field(tmp_path, change, message):
    d = {k: v for k, v in {**TINY.to_dict(), **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        LlamaConfig.from_json(tmp_path)


def test_checkpoint_with_wrong_weights_names_them(tmp_path):
    from safetensors.torch import load_file, save_file
    LlamaModel.random(TINY, seed=1, device="cpu").save(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        LlamaModel.load(tmp_path, device="cpu")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(32,\), config wants"):
        LlamaModel.load(tmp_path, device="cpu")


@pytest.mark.parametrize("tables,message", [
    ([[0], [1]], "sequence 0: 20 tokens at block size 16 need 2 blocks; its block table has 1"),
    ([[0, 1], [1]], "block 1 is in the tables of sequences 0 and 1"),
    ([[2, 2], [1]], r"sequence 0: its block table repeats a block: \[2, 2\]"),
    ([[0, 9], [1]], "sequence 0: block id 9 outside 0..3"),
])
def test_bad_block_tables_are_refused(model, tables, message):
    cache = PagedKVCache.for_model(model, num_blocks=4)
    with pytest.raises(ValueError, match=message):
        model.prefill([[1] * 20, [2] * 3], cache, tables)
    with pytest.raises(ValueError, match=r"token ids \[128\] outside 0..127"):
        model.prefill([[128]], cache, [[0]])


def test_importing_the_package_imports_no_torch():
    code = ("import sys, hardware, sim, hardware.model, hardware.model.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
