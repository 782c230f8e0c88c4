"""The Llama architecture's config, read from a Hugging Face ``config.json``. Imports no torch.

Both spellings of the rotary settings are read: the classic one of Llama 3.x checkpoints
(``rope_theta`` plus ``rope_scaling = {"rope_type": "llama3", ...}``) and the newer
``rope_parameters`` dict that holds ``rope_theta`` too. ``to_dict`` writes the classic one,
which every ``transformers`` release reads. Features this model does not implement (biases,
another activation, another RoPE type) are refused by name rather than ignored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROPE_TYPES = ("default", "llama3")
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (``"rope_type": "llama3"``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those
    shorter than ``.../ high_freq_factor`` kept, the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in LLAMA3_FIELDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"rope_scaling.{name} {getattr(self, name)} must be > 0")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor {self.high_freq_factor} must "
                             f"exceed low_freq_factor {self.low_freq_factor}")


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-architecture decoder; names and defaults as in ``transformers``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None          # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} must divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                                 f"num_attention_heads {self.num_attention_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim!r} must be a positive even integer")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps {self.rms_norm_eps} and rope_theta "
                             f"{self.rope_theta} must be > 0")

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> LlamaConfig:
        """A config from a ``config.json`` dict; errors start with ``where`` and name the field."""
        try:
            return cls(**_fields(d))
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{where}: {e}") from e

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        """Read ``path``: a ``config.json``, or a checkpoint directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a model config: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: a model config must be a JSON object")
        return cls.from_dict(d, where=str(path))

    def to_dict(self) -> dict:
        """The ``config.json`` of this config, as ``LlamaForCausalLM`` reads it."""
        d = {k: v for k, v in asdict(self).items() if k != "rope_scaling"}
        scaling = None if self.rope_scaling is None else {
            "rope_type": "llama3", **asdict(self.rope_scaling)}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                **d, "rope_scaling": scaling}


def _fields(d: dict) -> dict:
    """The dataclass fields of a ``config.json`` dict; unsupported features raise by name."""
    refused = {"model_type": ("llama", None), "hidden_act": ("silu", None),
               "attention_bias": (False, None), "mlp_bias": (False, None)}
    for name, allowed in refused.items():
        if d.get(name) not in allowed:
            raise ValueError(f"field {name!r} is {d[name]!r}; this model supports {allowed[0]!r}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [name for name in required if name not in d]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    out = {name: d[name] for name in required}
    out["num_key_value_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
    for name in ("head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        if d.get(name) is not None:
            out[name] = d[name]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"field 'rope_scaling' must be an object, got {rope!r}")
    out["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r}; allowed: {', '.join(ROPE_TYPES)}")
    if rope_type == "llama3":
        missing = [name for name in LLAMA3_FIELDS if name not in rope]
        if missing:
            raise ValueError(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
        out["rope_scaling"] = RopeScaling(**{name: rope[name] for name in LLAMA3_FIELDS})
    return out


def tiny_config() -> LlamaConfig:
    """The seeded tiny Llama real mode serves when no checkpoint is given (no model hub is
    needed): 2 layers, hidden 256, 4 query and 2 KV heads of 64, Llama 3 RoPE, a context of
    512 tokens."""
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rope_theta=500000.0, max_position_embeddings=512,
                       rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0,
                                                original_max_position_embeddings=64))
