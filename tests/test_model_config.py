"""Models from a Hugging Face config.json (``hardware.model_config``): parameter counts against
the published ones and transformers' own models, KV bytes per token by hand for each attention
kind, MoE weights read per decode step, sliding windows, bad files named in one line, the NPU
refusal, ``--model`` on the command line, and (where ``HAWK_VLLM_PYTHON`` names a python with
vLLM) KV sizes against vLLM's own."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest

from hardware import catalog
from hardware.catalog import model_from_hf
from sim.commands.main import main
from sim.config import ConfigError, RunConfig
from sim.models.predictor import RooflinePredictor, load_profile
from sim.models.transfer import MECHANISMS, InstanceFacts, plan_counts
from tests.needs import vllm_python

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL_JSON = ROOT / "tests" / "data" / "mixtral-8x7b-config.json"

#: (catalog key, published total parameters, published active parameters, source)
PUBLISHED = [
    ("llama-3.1-8b", 8.0e9, 8.0e9, "Llama 3.1 model card: 8B"),
    ("llama-3.1-70b", 70e9, 70e9, "Llama 3.1 model card: 70B"),
    ("llama-3.1-405b", 405e9, 405e9, "Llama 3.1 model card and Llama 3 paper: 405B"),
    ("qwen3-32b", 32.8e9, 32.8e9, "Qwen3-32B model card: 32.8B"),
    ("mixtral-8x7b", 46.7e9, 12.9e9, "Mistral AI, Mixtral of experts: 46.7B total, 12.9B "
                                     "per token"),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "Qwen3-30B-A3B model card: 30.5B, 3.3B activated"),
    ("deepseek-v3", 671e9, 37e9, "DeepSeek-V3 technical report (arXiv 2412.19437): 671B, "
                                 "37B activated"),
]


@pytest.mark.parametrize("key,total,active,source", PUBLISHED)
def test_parameter_counts_match_the_published_ones_within_2_percent(key, total, active, source):
    m = catalog.model(key)
    assert m.num_params == pytest.approx(total, rel=0.02), source
    assert m.num_active_params == pytest.approx(active, rel=0.02), source


@pytest.mark.parametrize("key", ["llama-3.1-405b", "qwen3-32b", "mixtral-8x7b",
                                 "qwen3-30b-a3b", "deepseek-v3"])
def test_parameter_counts_match_transformers_models_built_from_the_same_config(key):
    """transformers builds each model on the meta device (no memory) from the catalog's
    config values: its exact count, norms included, within 1e-4 (the norms left out here)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    table = tomllib.loads((ROOT / "hardware" / "catalog" / "models.toml").read_text())
    values = {k: v for k, v in table[key]["config"].items() if k != "architectures"}
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    exact = sum(p.numel() for p in model.parameters())
    assert catalog.model(key).num_params == pytest.approx(exact, rel=1e-4)
    assert catalog.model(key).num_params <= exact


#: bf16 KV bytes per token by hand: 2 (K, V) x layers x KV heads x head_dim x 2 B; MLA: layers
#: x (kv_lora_rank + qk_rope_head_dim) x 2 B
KV_BY_HAND = {
    "llama-3.1-8b": 2 * 32 * 8 * 128 * 2,
    "llama-3.1-70b": 2 * 80 * 8 * 128 * 2,
    "llama-3.1-405b": 2 * 126 * 8 * 128 * 2,
    "qwen3-32b": 2 * 64 * 8 * 128 * 2,
    "mixtral-8x7b": 2 * 32 * 8 * 128 * 2,
    "qwen3-30b-a3b": 2 * 48 * 4 * 128 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
}


@pytest.mark.parametrize("key", sorted(KV_BY_HAND))
def test_kv_bytes_per_token_match_the_hand_computation(key):
    m = catalog.model(key)
    assert m.kv_bytes_per_token("bfloat16") == KV_BY_HAND[key]
    assert m.kv_bytes_per_token("fp8") == KV_BY_HAND[key] / 2


def test_every_catalog_model_names_its_source():
    for key, m in catalog.models().items():
        assert m.source.startswith("https://huggingface.co/"), key


def test_the_mixtral_file_and_the_catalog_entry_derive_the_same_model():
    from dataclasses import replace

    from_file = catalog.model(str(MIXTRAL_JSON))
    entry = catalog.model("mixtral-8x7b")
    assert replace(from_file, key="", name="", source="") == replace(entry, key="", name="",
                                                                     source="")
    assert (entry.num_experts, entry.num_experts_per_token, entry.num_dense_layers) == (8, 2, 0)


def test_deepseek_v3_layers_experts_and_latent_attention():
    m = catalog.model("deepseek-v3")
    assert m.is_mla and m.kv_head_size == 576 and m.kv_tensors_per_layer == 1
    assert (m.num_experts, m.num_experts_per_token, m.num_dense_layers) == (256, 8, 3)
    assert m.shared_ffn_size == 2048 and m.num_moe_layers == 58


# --- mixture of experts: the experts a decode step reads -----------------------------------

def test_expected_distinct_experts_follow_uniform_routing():
    m = catalog.model("mixtral-8x7b")              # E = 8, k = 2
    assert m.expected_experts_read(1) == pytest.approx(2.0)
    assert m.expected_experts_read(2) == pytest.approx(8 * (1 - 0.75 ** 2))     # 3.5
    assert m.expected_experts_read(1000) == pytest.approx(8.0)
    reads = [m.weight_bytes_read_per_step("bfloat16", b) for b in (1, 2, 4, 16, 64)]
    assert reads == sorted(reads) and reads[-1] <= m.weight_bytes_read_per_step("bfloat16")


def test_a_moe_decode_step_at_batch_1_reads_the_active_weights_only():
    m = catalog.model("mixtral-8x7b")
    # bf16: every weight but the input embedding, with 2 of 8 experts per layer
    expected = 2 * (m.num_active_params - m.embedding_params)
    assert m.weight_bytes_read_per_step("bfloat16", 1) == pytest.approx(expected, rel=1e-12)


def test_the_decode_step_time_grows_with_the_experts_read_and_flops_use_active_params():
    m, dev = catalog.model("mixtral-8x7b"), catalog.device("a100-pcie")
    eff = load_profile("paper")["a100-pcie"]
    pred = RooflinePredictor(m, dev, 2, eff)
    bandwidth = dev.memory_bandwidth_gb_s * 1e9 * 2 * eff.decode_memory_efficiency
    extra = (m.weight_bytes_read_per_step("bfloat16", 8)
             - m.weight_bytes_read_per_step("bfloat16", 1)) / bandwidth
    step1, step8 = pred.decode_step_time(1, 100), pred.decode_step_time(8, 800)
    kv = m.kv_bytes_per_token("bfloat16") * 700 / (dev.memory_bandwidth_gb_s * 1e9 * 2
                                                  * (eff.decode_attention_efficiency
                                                     or eff.decode_memory_efficiency))
    allreduce = pred.allreduce_time(8) - pred.allreduce_time(1)
    assert step8 - step1 == pytest.approx(extra + kv + allreduce, rel=1e-9)
    assert pred._body_flops_per_token == 2.0 * (m.linear_params - m.embedding_params)
    assert m.linear_params < m.num_params / 3          # 2 of 8 experts multiply a token


def test_a_dense_models_decode_reads_every_weight_at_any_batch():
    m = catalog.model("qwen3-32b")
    pred = RooflinePredictor(m, catalog.device("h100-sxm"), 2, load_profile("paper")["h100-sxm"])
    assert pred.decode_weight_bytes(1) == pred.decode_weight_bytes(64) == \
        m.weight_bytes_read_per_step("bfloat16")


# --- multi-head latent attention under tensor parallelism -----------------------------------

def test_mla_latent_is_held_whole_by_every_tp_device():
    mla, gqa = catalog.model("deepseek-v3"), catalog.model("llama-3.1-70b")
    assert mla.kv_block_bytes("bfloat16", 16, 8) == 8 * mla.kv_block_bytes("bfloat16", 16, 1)
    assert gqa.kv_block_bytes("bfloat16", 16, 8) == gqa.kv_block_bytes("bfloat16", 16, 1)
    facts = InstanceFacts(catalog.device("h200"), 8, "bfloat16", 16)
    counts = plan_counts(MECHANISMS["GG-Direct"], mla, facts, facts, 100)
    assert counts.token_bytes == 61 * 100 * 576 * 2                 # the whole latent, per device


# --- sliding windows ---------------------------------------------------------------------

BASE = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "max_position_embeddings": 1024}


@pytest.mark.parametrize("extra,num_sliding", [
    ({"sliding_window": 512}, 4),                                       # Mistral: every layer
    ({"sliding_window": None}, 0),
    ({"sliding_window": 512, "use_sliding_window": False}, 0),          # Qwen: off
    ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 1}, 3),
    ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 2}, 2),
    ({"sliding_window": 512, "model_type": "gemma2"}, 2),
])
def test_sliding_window_layers_are_read_from_the_config(extra, num_sliding):
    m = model_from_hf({**BASE, **extra}, "t", "t", "t.json")
    assert m.num_sliding_layers == num_sliding
    assert m.sliding_window == (512 if num_sliding else 0)


# --- bad config.json: one line naming the file and the field --------------------------------

@pytest.mark.parametrize("change,field", [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_a_bad_config_json_is_one_line_naming_file_and_field(tmp_path, change, field):
    config = {**json.loads(MIXTRAL_JSON.read_text()), **change}
    config = {k: v for k, v in config.items() if v is not None or k == "sliding_window"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as exc:
        catalog.model(str(path))
    message = str(exc.value)
    assert str(path) in message and field in message and "\n" not in message


def test_hawk_names_a_bad_config_json_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(MIXTRAL_JSON.read_text()), "vocab_size": 3.5}))
    assert main(["simulate", "--model", str(path), "--num-requests", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "vocab_size" in err
    (tmp_path / "broken.json").write_text("{")
    assert main(["simulate", "--model", str(tmp_path / "broken.json")]) == 2
    assert "not JSON" in capsys.readouterr().err


# --- the TT stack's models -----------------------------------------------------------------

@pytest.mark.parametrize("key,reason,tp", [
    ("deepseek-v3", "multi-host Wormhole Galaxy", 8),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 4),
    ("llama-3.1-405b", "405B", 8),
])
def test_a_model_the_tt_stack_does_not_run_is_refused_on_an_npu_with_the_reason(key, reason, tp):
    with pytest.raises(ConfigError) as exc:
        RunConfig().replace(**{"cluster.model": key})          # decode on p150a by default
    assert "cluster.decode.device = 'p150a'" in str(exc.value) and reason in str(exc.value)
    gpus = RunConfig().replace(**{"cluster.model": key, "cluster.decode.device": "h200",
                                  "cluster.decode.tp": tp, "cluster.prefill.device": "h200",
                                  "cluster.prefill.tp": tp, "cluster.link.mechanism": "GG-Direct"})
    assert gpus.cluster.model == key                            # GPUs serve it


def test_models_tt_metal_runs_are_accepted_on_an_npu():
    for key in ("llama-3.1-70b", "qwen3-32b", "mixtral-8x7b"):
        assert RunConfig().replace(**{"cluster.model": key}).cluster.decode.device == "p150a"


# --- the command line ----------------------------------------------------------------------

def test_hawk_simulate_runs_a_mixtral_config_json(capsys):
    assert main(["simulate", "--model", str(MIXTRAL_JSON), "--num-requests", "50",
                 "--json"]) == 0
    mixtral = json.loads(capsys.readouterr().out)
    assert mixtral["num_finished"] == 50
    assert main(["simulate", "--num-requests", "50", "--json"]) == 0
    llama = json.loads(capsys.readouterr().out)
    assert mixtral["tpot_p50_s"] < llama["tpot_p50_s"]    # 12.9B active vs 70B: faster decode


def test_an_unknown_model_name_lists_the_catalog(capsys):
    assert main(["simulate", "--model", "gpt-5", "--num-requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "gpt-5" in err and "mixtral-8x7b" in err and "config.json" in err


# --- against vLLM's own KV sizing ----------------------------------------------------------

LLAMA_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 128256, "max_position_embeddings": 131072}


#: https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: a 4096-token window
#: on every layer
MISTRAL_7B_CONFIG = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "sliding_window": 4096}


def _vllm_cases() -> list[tuple[str, dict, int]]:
    table = tomllib.loads((ROOT / "hardware" / "catalog" / "models.toml").read_text())
    cases = [("llama-3.1-8b", LLAMA_8B_CONFIG, 1), ("llama-3.1-8b", LLAMA_8B_CONFIG, 2)]
    cases += [(key, table[key]["config"], 1)
              for key in ("qwen3-32b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")]
    cases += [("llama-3.1-405b", table["llama-3.1-405b"]["config"], 8)]
    return cases + [("deepseek-v3", table["deepseek-v3"]["config"], 2),
                    ("mistral-7b-v0.1", MISTRAL_7B_CONFIG, 1)]


def test_kv_bytes_and_blocks_match_vllms_own_computation():
    python = vllm_python()
    memory, block = 10 * 2 ** 30, 16                    # bytes per device, tokens per block
    cases = _vllm_cases()
    stdin = json.dumps([{"config": c, "tp": tp, "block_size": block, "memory_bytes": memory}
                        for _, c, tp in cases])
    done = subprocess.run([python, str(ROOT / "scripts" / "vllm_kv_spec.py")], input=stdin,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    for (key, config, tp), got in zip(cases, json.loads(done.stdout.splitlines()[-1])):
        m = model_from_hf(config, key, key, key)
        per_device = m.kv_block_bytes("bfloat16", block, tp) / tp
        assert got["page_size_bytes"] * got["num_layers"] == per_device, (key, tp, got)
        assert got["use_mla"] == m.is_mla
        assert got["sliding_window"] == (m.sliding_window or None)
        assert got["num_blocks"] == int(memory * tp // m.kv_block_bytes("bfloat16", block, tp))
        print(f"{key} tp={tp}: vLLM {got['num_layers']} layers x {got['page_size_bytes']} B "
              f"per block, {got['num_blocks']} blocks in {memory / 2**30:.0f} GiB; "
              f"hawk {per_device / block:.0f} B/token")


@pytest.mark.parametrize("key", sorted(KV_BY_HAND))
def test_hawk_plan_takes_every_catalog_model(key):
    from sim.commands import plan
    from sim.commands.main import build_parser

    args = build_parser(load={"plan"}).parse_args(
        ["plan", "--model", key, "--rate", "1", "--decode-devices", "p150a,h200"])
    base = plan._base_config(args)
    assert base.cluster.model == key
    refused = bool(catalog.model(key).npu_refusal)
    assert base.cluster.decode.device == ("h200" if refused else "p150a")


def test_hawk_plan_of_a_model_the_npu_cannot_run_needs_a_gpu_decode_side(capsys):
    from sim.commands import plan
    from sim.commands.main import build_parser

    assert main(["plan", "--model", "deepseek-v3", "--rate", "1", "--decode-devices",
                 "p150a"]) == 2
    assert "multi-host Wormhole Galaxy" in capsys.readouterr().err
    args = build_parser(load={"plan"}).parse_args(["plan", "--model", "deepseek-v3",
                                                  "--rate", "1"])
    base = plan._base_config(args)                 # no --decode-devices: the prefill GPU
    assert base.cluster.decode.device == base.cluster.prefill.device == "a100-pcie"


def test_tied_embeddings_count_once_and_the_lm_head_reads_them():
    # Qwen3-0.6B (https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json); model card:
    # 0.6B parameters, 0.44B without embeddings
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "head_dim": 128,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
              "tie_word_embeddings": True, "use_sliding_window": False}
    m = model_from_hf(config, "qwen3-0.6b", "Qwen3 0.6B", "config.json")
    assert m.num_params - m.embedding_params == pytest.approx(0.44e9, rel=0.02)
    assert m.num_params == pytest.approx(0.6e9, rel=0.02)
    assert m.weight_bytes_read_per_step("bfloat16") == m.weight_bytes("bfloat16") \
        == 2 * m.num_params


def test_flops_per_token_split_into_attention_and_active_mlp():
    m = catalog.model("mixtral-8x7b")
    per_layer_expert = 3 * 4096 * 14336
    assert m.mlp_flops_per_token == 2.0 * 32 * (2 * per_layer_expert + 4096 * 8)
    assert m.attention_flops_per_context_token == 4.0 * 32 * 32 * 128
    d = catalog.model("deepseek-v3")                 # 128 heads of qk 192, v 128
    assert d.attention_flops_per_context_token == 2.0 * 61 * 128 * (192 + 128)


def test_each_tp_device_reads_the_whole_mla_latent_per_token_of_context():
    eff = load_profile("paper")["h200"]
    bw = catalog.device("h200").memory_bandwidth_gb_s * 1e9 * (
        eff.decode_attention_efficiency or eff.decode_memory_efficiency)
    for key, per_device in (("deepseek-v3", 1), ("llama-3.1-70b", 8)):
        m = catalog.model(key)
        pred = RooflinePredictor(m, catalog.device("h200"), 8, eff)
        slope = pred.decode_step_time(1, 2000) - pred.decode_step_time(1, 1000)
        assert slope == pytest.approx(1000 * m.kv_bytes_per_token("bfloat16") / per_device / bw,
                                      rel=1e-9)


def test_a_directory_holding_config_json_is_a_model(tmp_path):
    (tmp_path / "config.json").write_text(MIXTRAL_JSON.read_text())
    assert catalog.model(str(tmp_path)).num_experts == 8


def test_a_multimodal_configs_language_model_is_its_text_config():
    nested = {"architectures": ["MistralForCausalLM"], "text_config": BASE,
              "vision_config": {"hidden_size": 8}}
    m = model_from_hf(nested, "t", "t", "t.json")
    assert (m.num_layers, m.hidden_size) == (4, 64)
    with pytest.raises(ValueError, match="t.json text_config: missing field 'vocab_size'"):
        model_from_hf({"text_config": {k: v for k, v in BASE.items() if k != "vocab_size"}},
                      "t", "t", "t.json")


def test_a_config_with_zero_or_one_expert_is_dense():
    for experts in (0, 1):
        assert model_from_hf({**BASE, "num_experts": experts}, "t", "t", "t.json").num_experts == 0
