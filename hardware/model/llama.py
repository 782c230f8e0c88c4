"""A Llama-architecture decoder in PyTorch that reads and writes a paged KV cache.

RMSNorm, rotary embeddings with Llama 3 frequency scaling, grouped-query attention and a
SwiGLU MLP, with ``transformers``' parameter names (``model.layers.0.self_attn.q_proj.weight``)
so that a Hugging Face checkpoint loads as is. One attention path serves prefill and decode,
as in vLLM v1: a step appends new tokens to each sequence, writes their K/V into the paged
cache, then every query gathers its sequence's keys through the block table and attends to
positions up to its own. ``prefill`` and ``decode`` are that step with whole prompts, or with
one token per sequence at different context lengths. The cache is anything with
``update(layer, k, v, batch) -> (keys, values)``: vLLM's paged cache (``cache.PagedKVCache``) or
the decode side's NPU-layout cache (``hardware.serve.tiled_cache.TiledKVCache``).

Shapes: B sequences, T new tokens (padded), S = gathered cache tokens, C = hidden_size,
H = query heads, K = KV heads, D = head_dim, V = vocab_size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hardware.kv_layout import blocks_for
from hardware.model.cache import PagedKVCache, block_batch
from hardware.model.config import LlamaConfig

WEIGHTS_FILE = "model.safetensors"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()                                                           # [..., C]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` (float32), stretched per Llama 3.1 when configured."""
    d = config.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d    # not meta
    inv_freq = 1.0 / config.rope_theta ** exponents
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, n, D]`` by ``cos, sin [B, T, D]``; halves pair up (HF's rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)                                                 # [B, T, n, D/2]
    rotated = torch.cat((-x2, x1), dim=-1)                                      # [B, T, n, D]
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_head * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.d, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, layer: int, batch) -> torch.Tensor:
        """``x [B, T, C]``; ``cache`` stores the new K/V of layer ``layer`` and hands back each
        sequence's keys and values (``PagedKVCache`` or a tiled NPU-layout cache)."""
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.d), cos, sin)   # [B, T, H, D]
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.d), cos, sin)     # [B, T, K, D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.d)                           # [B, T, K, D]
        group = self.n_head // self.n_kv                    # query heads per KV head (GQA)
        keys, values = (t.to(x.dtype).repeat_interleave(group, dim=2).transpose(1, 2)
                        for t in cache.update(layer, k, v, batch))                 # [B, H, S, D]
        S = keys.shape[2]
        mask = torch.arange(S, device=x.device) <= batch.positions[:, :, None]      # [B, T, S]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                           attn_mask=mask[:, None])                 # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.d))   # [B, T, C]


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))         # [B, T, C]


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, cache, layer, batch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))                      # [B, T, C]


class LlamaModel(nn.Module):
    """A Llama causal LM (``LlamaForCausalLM``'s weights). Build it with ``random`` or
    ``load``; it runs in inference mode only."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(c.vocab_size, c.hidden_size),
            layers=nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers)),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps)))
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size,
                                                                    bias=False)
        self.inv_freq = rope_inv_freq(c)                                            # [D/2]

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_tensors(cls, config: LlamaConfig, tensors: dict, dtype=torch.float32,
                     device=None, where: str = "weights") -> LlamaModel:
        """A model holding ``tensors`` (HF names), cast to ``dtype`` on ``device`` (default:
        CUDA when present, else CPU). Missing, unexpected or misshapen tensors raise by name."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch.device("meta"):
            model = cls(config)
        tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing, unexpected = sorted(expected.keys() - tensors), sorted(tensors.keys() - expected)
        if missing or unexpected:
            raise ValueError(f"{where}: missing {missing[:5] or 'none'}, unexpected "
                             f"{unexpected[:5] or 'none'} ({len(missing)} and {len(unexpected)})")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, "
                                 f"config wants {shape}")
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()},
                              assign=True)
        return model.eval().requires_grad_(False)

    @classmethod
    def random(cls, config: LlamaConfig, seed: int = 0, dtype=torch.float32,
               device=None) -> LlamaModel:
        """Seeded weights, the same bytes on every device: embeddings N(0, 1), projections
        N(0, 1/fan_in), norm gains 1 + N(0, 0.1^2) (not all ones, so that every tensor counts)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in cls(config).state_dict().items()}
        tensors = {}
        for name in sorted(shapes):
            x = torch.randn(shapes[name], generator=gen)
            if name.endswith("norm.weight"):
                x = 1 + 0.1 * x
            elif name.endswith("proj.weight") or name == "lm_head.weight":
                x = x / math.sqrt(shapes[name][1])
            tensors[name] = x
        return cls.from_tensors(config, tensors, dtype, device, where=f"random seed {seed}")

    @classmethod
    def load(cls, path: str | Path, dtype=torch.float32, device=None) -> LlamaModel:
        """Load a Hugging Face-format directory: ``config.json`` and ``*.safetensors``."""
        from safetensors.torch import load_file
        path = Path(path)
        config = LlamaConfig.from_json(path / "config.json")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors weight files")
        tensors = {}
        for f in files:
            tensors.update(load_file(f))
        return cls.from_tensors(config, tensors, dtype, device, where=str(path))

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (HF names) into directory ``path``."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {**self.config.to_dict(), "torch_dtype": str(self.dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})

    # -- running ----------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, chunks: list[list[int]], starts: list[int], cache: PagedKVCache,
               block_tables: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Append ``chunks[i]`` to sequence i, which holds ``starts[i]`` tokens in ``cache``
        through ``block_tables[i]``; returns each chunk's last logits ``[B, V]`` (float32),
        or with ``all_logits`` those of every position ``[B, T, V]``."""
        cache.check_fits(self.config)
        for i, chunk in enumerate(chunks):
            bad = [t for t in chunk if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"sequence {i}: token ids {bad[:5]} outside "
                                 f"0..{self.config.vocab_size - 1}")
        batch = block_batch([len(c) for c in chunks], starts, block_tables, cache.block_size,
                            cache.num_blocks, self.device)
        T = max(len(c) for c in chunks)
        tokens = torch.tensor([c + [0] * (T - len(c)) for c in chunks], device=self.device)
        freqs = batch.positions[:, :, None].float() * self.inv_freq.to(self.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                      # [B, T, D]
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        x = self.model.embed_tokens(tokens)                                          # [B, T, C]
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, cache, i, batch)
        if not all_logits:
            x = x[torch.arange(len(chunks), device=self.device), batch.last]         # [B, C]
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (x @ head.T).float()                                                  # [B, (T,) V]

    def prefill(self, prompts: list[list[int]], cache: PagedKVCache,
                block_tables: list[list[int]]) -> torch.Tensor:
        """Write the prompts' K/V into ``cache``; logits of each last prompt token ``[B, V]``."""
        return self.extend(prompts, [0] * len(prompts), cache, block_tables)

    def decode(self, tokens: list[int], positions: list[int], cache: PagedKVCache,
               block_tables: list[list[int]]) -> torch.Tensor:
        """One new token per sequence, at ``positions[i]`` (= tokens already cached); ``[B, V]``."""
        return self.extend([[t] for t in tokens], positions, cache, block_tables)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every position ``[B, T, V]`` of ``tokens [B, T]``, in a scratch cache."""
        B, T = tokens.shape
        per_seq = blocks_for(T, 16)
        cache = PagedKVCache.for_model(self, num_blocks=B * per_seq)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
        return self.extend(tokens.tolist(), [0] * B, cache, tables, all_logits=True)
