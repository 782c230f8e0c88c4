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
class ModelSpec:
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

    @property
    def attention_params_per_layer(self) -> int:
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_o + k_v

    @property
    def mlp_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.ffn_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def linear_params(self) -> int:
        """Parameters multiplied per token: all layers plus the LM head."""
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer
        return self.num_layers * per_layer + self.embedding_params

    @property
    def num_params(self) -> int:
        """All parameters (input embedding and LM head untied)."""
        return self.linear_params + self.embedding_params

    def weight_bytes(self, weight_format: str) -> float:
        """Bytes of all weights in ``weight_format`` (whole model, before tensor parallelism)."""
        attn, mlp, emb = (DTYPE_BYTES[d] for d in _weight_format(weight_format))
        layers = self.num_layers * (self.attention_params_per_layer * attn
                                    + self.mlp_params_per_layer * mlp)
        return layers + 2 * self.embedding_params * emb

    def weight_bytes_read_per_step(self, weight_format: str) -> float:
        """Bytes read by one forward step: every weight except the input embedding table."""
        emb = DTYPE_BYTES[_weight_format(weight_format)[2]]
        return self.weight_bytes(weight_format) - self.embedding_params * emb

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """K and V of one token over all layers and KV heads."""
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


def models() -> dict[str, ModelSpec]:
    return {key: ModelSpec(key=key, **value) for key, value in _table("models.toml").items()}


def device(key: str) -> DeviceSpec:
    return lookup(devices(), key, "device")


def model(key: str) -> ModelSpec:
    return lookup(models(), key, "model")
