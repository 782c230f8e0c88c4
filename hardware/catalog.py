"""Device and model catalogs: what the machines and models are, in numbers.

The figures live in ``hardware/catalog/devices.toml`` and ``models.toml`` (with sources); this
module reads them into frozen specs and derives sizes: parameters, weight bytes per device
under a weight format, KV bytes per token under a KV dtype. Each device also carries its
serving engine's rules (``ServingRules``): the formats it can run and the defaults an instance
on it takes for what its config leaves unset.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from hardware.sliding_window import SlidingWindowLayers

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: bytes per element of each storage format (block-float formats include their exponent bytes:
#: a 32x32 tile is 1088 B in bfloat8_b and 576 B in bfloat4_b)
DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "fp8": 1.0,
    "bfloat8_b": 1088 / 1024,
    "bfloat4_b": 576 / 1024,
}

#: weight formats: bytes per element for (attention, MLP, embeddings and LM head)
WEIGHT_FORMATS: dict[str, tuple[str, str, str]] = {
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "fp8": ("fp8", "fp8", "bfloat16"),
    # tt-metal's Llama 3 70B performance config: bfloat8_b attention, bfloat4_b MLP
    "tt-mixed": ("bfloat8_b", "bfloat4_b", "bfloat16"),
}


#: how a serving engine allocates its KV cache
KV_ALLOCATIONS = ("free-memory", "fixed")


@dataclass(frozen=True)
class ServingRules:
    """What a device's serving engine can run, and its defaults (the first format of each list).

    ``kv_allocation`` "free-memory": the KV cache takes all memory left after the weights
    (vLLM on GPUs; ``max_num_blocks`` is None); "fixed": the engine allocates
    ``max_num_blocks`` blocks (the TT vLLM plugin)."""

    weight_formats: tuple[str, ...]
    kv_dtypes: tuple[str, ...]
    block_size: int
    block_multiple: int
    max_batch_size: int
    memory_utilization: float
    kv_allocation: str
    max_num_blocks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_formats", tuple(self.weight_formats))
        object.__setattr__(self, "kv_dtypes", tuple(self.kv_dtypes))
        bad = ([f for f in self.weight_formats if f not in WEIGHT_FORMATS]
               + [d for d in self.kv_dtypes if d not in DTYPE_BYTES])
        if bad or not self.weight_formats or not self.kv_dtypes:
            raise ValueError(f"serving rules name unknown or no formats: {bad}")
        if self.block_size % self.block_multiple:
            raise ValueError(f"default block_size {self.block_size} is not a multiple of "
                             f"block_multiple {self.block_multiple}")
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation {self.kv_allocation!r} must be one of "
                             f"{list(KV_ALLOCATIONS)}")
        if (self.kv_allocation == "fixed") != (self.max_num_blocks is not None):
            raise ValueError("kv_allocation 'fixed' needs max_num_blocks, 'free-memory' none")

    def defaults(self) -> dict:
        """The instance settings a device gives every key its config leaves unset."""
        return {"weight_format": self.weight_formats[0], "kv_dtype": self.kv_dtypes[0],
                "block_size": self.block_size, "max_batch_size": self.max_batch_size,
                "memory_utilization": self.memory_utilization,
                "max_num_blocks": self.max_num_blocks}


@dataclass(frozen=True)
class DeviceSpec:
    key: str
    name: str
    kind: str                     # "gpu" or "npu"
    peak_tflops: float
    memory_gb: float
    memory_bandwidth_gb_s: float
    board_power_w: float
    tp_link_gb_s: float
    price_usd: float
    source: str
    serving: ServingRules
    dram_channels: int = 0        # NPU DRAM banks; 0 where the hardware interleaves itself

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True)
class ModelSpec(SlidingWindowLayers):
    """A decoder-only transformer's shapes (a Hugging Face ``config.json``'s, read by
    ``hardware.model_config``) and the sizes derived from them.

    The fields after ``max_context`` default to a dense model with grouped-query attention:
    ``kv_lora_rank`` > 0 is multi-head latent attention (DeepSeek-V2/V3: one compressed KV
    vector of ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, which every
    tensor-parallel rank holds whole); ``num_experts`` > 0 a mixture of experts (the
    ``num_layers - num_dense_layers`` MoE layers route each token to ``num_experts_per_token``
    of ``num_experts`` experts of ``expert_ffn_size``, beside ``shared_ffn_size`` of always-on
    shared experts); ``num_sliding_layers`` of the layers attend to the last ``sliding_window``
    tokens only (``hardware.sliding_window``). ``npu_refusal`` says why Tenstorrent's stack
    cannot serve the model ("": it can)."""

    key: str
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_context: int
    tie_embeddings: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    sliding_window: int = 0
    num_sliding_layers: int = 0
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_ffn_size: int = 0
    shared_ffn_size: int = 0
    num_dense_layers: int = 0
    source: str = ""
    npu_refusal: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank
                 else h * n * qk)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim)
                  + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + n * self.v_head_dim * h
        q_o = 2 * h * n * self.head_dim
        k_v = 2 * h * self.num_kv_heads * self.head_dim
        return q_o + k_v

    @property
    def mlp_params_per_layer(self) -> int:
        """A dense layer's gated MLP (gate, up and down projections)."""
        return 3 * self.hidden_size * self.ffn_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    def _moe_layer_params(self, num_experts: float) -> float:
        """One MoE layer with ``num_experts`` routed experts' weights, its shared experts and
        its router."""
        h = self.hidden_size
        return (num_experts * 3 * h * self.expert_ffn_size + 3 * h * self.shared_ffn_size
                + h * self.num_experts)

    @property
    def mlp_params(self) -> int:
        """All layers' MLP parameters, every expert included."""
        dense = self.num_layers - self.num_moe_layers
        return (dense * self.mlp_params_per_layer
                + self.num_moe_layers * int(self._moe_layer_params(self.num_experts)))

    @property
    def active_mlp_params(self) -> int:
        """The MLP parameters one token multiplies: its routed experts only."""
        dense = self.num_layers - self.num_moe_layers
        return (dense * self.mlp_params_per_layer
                + self.num_moe_layers * int(self._moe_layer_params(self.num_experts_per_token)))

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        """Parameters multiplied per token: all layers (a MoE layer's routed experts only)
        plus the LM head."""
        if not self.num_experts:
            per_layer = self.attention_params_per_layer + self.mlp_params_per_layer
            return self.num_layers * per_layer + self.embedding_params
        return (self.num_layers * self.attention_params_per_layer + self.active_mlp_params
                + self.embedding_params)

    @property
    def num_params(self) -> int:
        """All parameters (input embedding and LM head untied unless ``tie_embeddings``)."""
        layers = self.num_layers * self.attention_params_per_layer + self.mlp_params
        return layers + (1 if self.tie_embeddings else 2) * self.embedding_params

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (the published "active" count: embeddings included)."""
        return self.linear_params + (0 if self.tie_embeddings else self.embedding_params)

    def weight_bytes(self, weight_format: str) -> float:
        """Bytes of all weights in ``weight_format`` (whole model, before tensor parallelism)."""
        attn, mlp, emb = (DTYPE_BYTES[d] for d in _weight_format(weight_format))
        tables = (1 if self.tie_embeddings else 2) * self.embedding_params * emb
        if not self.num_experts:
            layers = self.num_layers * (self.attention_params_per_layer * attn
                                        + self.mlp_params_per_layer * mlp)
            return layers + tables
        return self.num_layers * self.attention_params_per_layer * attn + self.mlp_params * mlp \
            + tables

    def expected_experts_read(self, batch: int) -> float:
        """Distinct routed experts one MoE layer reads for ``batch`` tokens, expected under
        uniform, independent routing: E (1 - (1 - k/E)^B). Real routers are skewed, so this
        bounds the experts read from above for a given batch (fewer distinct ones are hit)."""
        e, k = self.num_experts, self.num_experts_per_token
        return e * (1.0 - (1.0 - k / e) ** batch)

    def weight_bytes_read_per_step(self, weight_format: str, batch: int | None = None) -> float:
        """Bytes read by one forward step: every weight except the input embedding table (the
        LM head reads it where the two are tied). A MoE model's decode step of ``batch``
        sequences reads only the experts its tokens route to (``expected_experts_read``);
        ``batch`` None: every expert (a prefill batch of many tokens)."""
        emb = DTYPE_BYTES[_weight_format(weight_format)[2]]
        total = self.weight_bytes(weight_format)
        if not self.tie_embeddings:
            total -= self.embedding_params * emb
        if batch is None or not self.num_experts:
            return total
        mlp = DTYPE_BYTES[_weight_format(weight_format)[1]]
        unread = self.num_experts - self.expected_experts_read(batch)
        return total - self.num_moe_layers * unread * 3 * self.hidden_size \
            * self.expert_ffn_size * mlp

    @property
    def kv_replicated(self) -> bool:
        """Whether every tensor-parallel rank holds a token's whole KV (MLA's latent) instead
        of its share of the KV heads."""
        return self.is_mla

    def kv_block_bytes(self, kv_dtype: str, block_size: int, tp: int) -> float:
        """Bytes of one KV block of ``block_size`` tokens over all ``tp`` devices of an
        instance (MLA: each holds the whole latent)."""
        return self.kv_bytes_per_token(kv_dtype) * block_size * (
            tp if self.kv_replicated else 1)

    @property
    def kv_tensors_per_layer(self) -> int:
        """KV cache tensors per layer: K and V, or MLA's one latent."""
        return 1 if self.is_mla else 2

    @property
    def kv_head_size(self) -> int:
        """Elements of one KV head per token in one tensor (MLA: the latent and its RoPE key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def attention_flops_per_context_token(self) -> float:
        """FLOPs a token's attention spends per token of context over all layers: QK^T and
        AV, 2 (qk_dim + v_dim) per head (MLA: its uncompressed heads, as prefill runs them).
        Per token of context a layer attends to: times ``attended_tokens`` past a window."""
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return 2.0 * self.num_layers * self.num_heads * (qk + self.v_head_dim)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def mlp_flops_per_token(self) -> float:
        """FLOPs of one token's MLPs over all layers: 2 per active parameter (its routed
        experts, the shared ones and the router in a MoE layer)."""
        return 2.0 * self.active_mlp_params

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """K and V of one token over all layers and KV heads (MLA: the latent of each layer).
        Per token a layer holds: a sequence past a sliding window holds fewer on its sliding
        layers (``attended_tokens``, ``kv_blocks``)."""
        if self.is_mla:
            return self.num_layers * self.kv_head_size * dtype_bytes(kv_dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(kv_dtype)


def lookup(table, key, what: str):
    """``table[key]``, or a ValueError naming the unknown ``what`` and the known keys."""
    try:
        return table[key]
    except KeyError:
        raise ValueError(f"unknown {what} {key!r}; choose one of {sorted(table)}") from None


def dtype_bytes(name: str) -> float:
    return lookup(DTYPE_BYTES, name, "dtype")


def _weight_format(name: str) -> tuple[str, str, str]:
    return lookup(WEIGHT_FORMATS, name, "weight format")


@lru_cache(maxsize=None)
def _table(filename: str) -> dict:
    text = resources.files("hardware").joinpath("catalog", filename).read_text()
    return tomllib.loads(text)


@lru_cache(maxsize=None)
def _devices() -> dict[str, DeviceSpec]:
    out = {}
    for key, value in _table("devices.toml").items():
        try:
            rules = ServingRules(**value.get("serving", {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"devices.toml [{key}.serving]: {exc}") from None
        out[key] = DeviceSpec(key=key, **{**value, "serving": rules})
    return out


def devices() -> dict[str, DeviceSpec]:
    return dict(_devices())


@lru_cache(maxsize=None)
def _models() -> dict[str, ModelSpec]:
    out = {}
    for key, value in _table("models.toml").items():
        if "config" in value:          # a Hugging Face config.json's fields, as published
            out[key] = model_from_hf(value["config"], key, value["name"],
                                     f"models.toml [{key}.config]", value.get("source", ""),
                                     value.get("npu_refusal"))
        else:
            out[key] = ModelSpec(key=key, **value)
    return out


def model_from_hf(config: dict, key: str, name: str, where: str, source: str = "",
                  npu_refusal: str | None = None) -> ModelSpec:
    """The spec of a Hugging Face ``config.json`` dict (``hardware.model_config``);
    ``npu_refusal`` None: its architecture's."""
    from hardware.model_config import spec_fields

    fields = spec_fields(config, name, where)
    if npu_refusal is not None:
        fields["npu_refusal"] = npu_refusal
    return ModelSpec(key=key, name=name, source=source, **fields)


def models() -> dict[str, ModelSpec]:
    return dict(_models())


def device(key: str) -> DeviceSpec:
    return lookup(devices(), key, "device")


def model(key: str) -> ModelSpec:
    """A catalog model by name, or the model of a Hugging Face ``config.json`` path (a file
    ending in .json, or a directory holding config.json)."""
    if key not in _models() and is_config_path(key):
        return _config_model(key)
    try:
        return _models()[key]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; choose one of {sorted(_models())} or a "
                         f"Hugging Face config.json path") from None


def is_config_path(key: str) -> bool:
    """Whether a model name is a path to a ``config.json`` (or to its directory) rather than a
    catalog name."""
    import os

    return key.endswith(".json") or "/" in key or os.sep in key or os.path.isdir(key)


@lru_cache(maxsize=64)
def _config_model(path: str) -> ModelSpec:
    from hardware.model_config import read_config_json

    config, name, where = read_config_json(path)
    return model_from_hf(config, path, name, where, source=where)
