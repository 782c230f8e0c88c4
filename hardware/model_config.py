"""A model's ``hardware.catalog.ModelSpec`` fields from its Hugging Face ``config.json``.

``read_config_json(path)`` reads a file (or a directory holding ``config.json``);
``spec_fields(config, where)`` reads the dict, as the catalog's ``[<key>.config]`` tables do
(``hardware.catalog.model`` builds the spec of either). What it reads:

- attention: ``num_attention_heads``, ``num_key_value_heads`` (grouped-query attention;
  absent: one KV head per head), ``head_dim`` (absent: hidden / heads); ``kv_lora_rank`` with
  ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim`` and ``q_lora_rank`` is multi-head
  latent attention (DeepSeek-V2/V3);
- sliding windows: ``layer_types`` (``"sliding_attention"`` layers), else Qwen's
  ``use_sliding_window`` (layers from ``max_window_layers`` on), else Gemma 2's alternation,
  else a ``sliding_window`` on every layer (Mistral's convention);
- mixture of experts: ``num_local_experts`` (Mixtral), ``num_experts`` (Qwen-MoE) or
  ``n_routed_experts`` (DeepSeek), ``num_experts_per_tok``, the expert size
  ``moe_intermediate_size`` (absent: ``intermediate_size``), shared experts
  (``n_shared_experts`` x the expert size, or ``shared_expert_intermediate_size``), and the
  dense layers among them (``first_k_dense_replace`` and ``moe_layer_freq``; Qwen's
  ``mlp_only_layers`` and ``decoder_sparse_step``).

Small parameters are left out of the counts (norms, biases, Qwen3's QK norms: under 0.1% of a
model). A bad file is a ``ValueError`` of one line naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Hugging Face architectures tt-metal's tt_transformers runs (its README's verified models:
#: Llama 3.x, Mistral, Mixtral, Qwen 2.5, Qwen 3 dense, Phi-3; tenstorrent/tt-metal
#: models/tt_transformers/README.md)
TT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")

#: why tt-metal cannot serve an architecture outside ``TT_ARCHITECTURES`` that it names
TT_REFUSALS = {
    "DeepseekV3ForCausalLM": "tt-metal runs DeepSeek-V3 only as a multi-host Wormhole Galaxy "
                             "demo (models/demos/deepseek_v3/README.md), not in tt_transformers",
}


class _Reader:
    """Typed reads of one config dict, each error naming ``where`` and the field."""

    def __init__(self, config: dict, where: str):
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
        self.config, self.where = config, where

    def int(self, field: str, default=None, least: int = 1) -> int:
        value = self.config.get(field)
        if value is None:
            if default is None:
                raise ValueError(f"{self.where}: missing field {field!r} (an integer)")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{self.where}: field {field!r} = {value!r} must be an integer "
                             f">= {least}")
        return value

    def bool(self, field: str, default: bool = False) -> bool:
        value = self.config.get(field, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}: field {field!r} = {value!r} must be true or false")
        return value

    def int_list(self, field: str) -> list[int]:
        value = self.config.get(field) or []
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                               for v in value):
            raise ValueError(f"{self.where}: field {field!r} = {value!r} must be a list of "
                             f"integers")
        return value


def read_config_json(path: str | Path) -> tuple[dict, str, str]:
    """(the config dict, the model's name, the file) of a ``config.json`` file or of a
    directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    name = name if isinstance(name, str) and name else path.parent.name or str(path)
    return config, name, str(path)


def spec_fields(config: dict, name: str, where: str) -> dict:
    """``ModelSpec`` fields of a ``config.json`` dict (all but key, name, source), with
    ``npu_refusal`` from its architecture. A multimodal config's language model is its
    ``text_config``."""
    text = config.get("text_config") if isinstance(config, dict) else None
    if isinstance(text, dict) and "hidden_size" not in config:
        config = {"architectures": config.get("architectures"), **text}
        where = f"{where} text_config"
    r = _Reader(config, where)
    hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
    layers = r.int("num_hidden_layers")
    fields = dict(
        num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=r.int("num_key_value_heads", heads), ffn_size=r.int("intermediate_size"),
        head_dim=r.int("head_dim", hidden // heads), vocab_size=r.int("vocab_size"),
        max_context=r.int("max_position_embeddings"),
        tie_embeddings=r.bool("tie_word_embeddings"))
    if heads % fields["num_kv_heads"]:
        raise ValueError(f"{where}: field 'num_key_value_heads' = {fields['num_kv_heads']} "
                         f"must divide num_attention_heads = {heads}")
    if config.get("kv_lora_rank") is not None:
        fields.update(kv_lora_rank=r.int("kv_lora_rank"), q_lora_rank=r.int("q_lora_rank", 0, 0),
                      qk_rope_head_dim=r.int("qk_rope_head_dim"),
                      qk_nope_head_dim=r.int("qk_nope_head_dim"), v_head_dim=r.int("v_head_dim"))
    fields.update(_sliding(r, layers))
    fields.update(_experts(r, layers))
    fields["npu_refusal"] = _npu_refusal(config, name, where)
    return fields


def _sliding(r: _Reader, layers: int) -> dict:
    """``sliding_window`` and ``num_sliding_layers`` of a config (both 0: none)."""
    types = r.config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ValueError(f"{r.where}: field 'layer_types' must list num_hidden_layers = "
                             f"{layers} layer types")
        num = sum(t == "sliding_attention" for t in types)
    elif "use_sliding_window" in r.config:             # Qwen2/Qwen3
        num = (layers - min(r.int("max_window_layers", layers, 0), layers)
               if r.bool("use_sliding_window") else 0)
    elif r.config.get("model_type") == "gemma2":       # even layers slide
        num = (layers + 1) // 2
    else:                                              # Mistral: a window on every layer
        num = layers
    window = r.int("sliding_window", 0, 0) if num else 0
    return {"sliding_window": window, "num_sliding_layers": num if window else 0}


def _experts(r: _Reader, layers: int) -> dict:
    """The mixture-of-experts fields of a config (none for a dense model)."""
    field = next((f for f in ("num_local_experts", "n_routed_experts", "num_experts")
                  if r.config.get(f) is not None), None)
    if field is None or r.int(field, least=0) <= 1:
        return {}
    experts, per_token = r.int(field), r.int("num_experts_per_tok")
    if per_token > experts:
        raise ValueError(f"{r.where}: field 'num_experts_per_tok' = {per_token} exceeds "
                         f"{field} = {experts}")
    size = r.int("moe_intermediate_size", r.int("intermediate_size"))
    shared = (r.int("n_shared_experts", 0, 0) * size
              or r.int("shared_expert_intermediate_size", 0, 0))
    if "first_k_dense_replace" in r.config or "moe_layer_freq" in r.config:    # DeepSeek
        first, freq = r.int("first_k_dense_replace", 0, 0), r.int("moe_layer_freq", 1)
        moe = sum(i >= first and i % freq == 0 for i in range(layers))
    else:                                              # Qwen-MoE; Mixtral: every layer
        only, step = set(r.int_list("mlp_only_layers")), r.int("decoder_sparse_step", 1)
        moe = sum(i not in only and (i + 1) % step == 0 for i in range(layers))
    return {"num_experts": experts, "num_experts_per_token": per_token,
            "expert_ffn_size": size, "shared_ffn_size": shared,
            "num_dense_layers": layers - moe}


def _npu_refusal(config: dict, name: str, where: str) -> str:
    """Why tt-metal cannot serve a config's architecture ("": it can)."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        return (f"{where} names no architectures, so whether tt-metal runs {name} is "
                f"unknown")
    if any(a in TT_ARCHITECTURES for a in archs):
        return ""
    reason = next((TT_REFUSALS[a] for a in archs if a in TT_REFUSALS), None)
    return reason or (f"architecture {archs[0]} is not among tt-metal tt_transformers' "
                      f"verified models (models/tt_transformers/README.md)")
