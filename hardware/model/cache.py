"""The paged KV cache in vLLM's layout, and the batch of block tables that addresses it.

Per layer one tensor ``(2, num_blocks, block_size, num_kv_heads, head_size)``, K = [0],
V = [1] (``hardware.kv_layout.GpuKVSpec`` in NHD order, the layout the transfer plans read).
A sequence owns the blocks of its block table, in token order: token ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``, its flat slot. The cache starts zeroed,
so reads past a sequence's length (masked out by attention) never meet NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hardware.kv_layout import GpuKVSpec, blocks_for

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedKVCache:
    """The KV blocks of every layer, on one device.

    ``quantize``: None, or a function applied to new K/V ``[N, K, D]`` before they are stored
    (the reference run of a decode side that holds its KV in a narrower format)."""

    def __init__(self, spec: GpuKVSpec, device: str | torch.device = "cpu"):
        if spec.order != "NHD":
            raise ValueError(f"PagedKVCache holds NHD order, got {spec.order!r}")
        self.spec = spec
        self.quantize = None
        self.layers = [torch.zeros(spec.physical_shape, dtype=TORCH_DTYPES[spec.dtype],
                                   device=device) for _ in range(spec.num_layers)]

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16,
                  dtype: str | None = None) -> PagedKVCache:
        """A cache shaped for ``model`` (a ``LlamaModel``), in its dtype unless ``dtype``."""
        c = model.config
        dtype = dtype or str(model.dtype).removeprefix("torch.")
        spec = GpuKVSpec(num_layers=c.num_hidden_layers, num_blocks=num_blocks,
                         num_kv_heads=c.num_key_value_heads, head_size=c.head_dim,
                         block_size=block_size, dtype=dtype)
        return cls(spec, device=model.device)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: "BlockBatch"):
        """Store new ``k, v [B, T, K, D]`` of ``layer`` at ``batch.slots``; return every
        sequence's keys and values ``[B, S, K, D]`` (S = block table width * block size)."""
        kv = self.layers[layer]                                              # [2, N, bs, K, D]
        valid = batch.slots >= 0                                             # [B, T]
        flat = kv.view(2, -1, *kv.shape[-2:])                                # [2, N*bs, K, D]
        for i, new in enumerate((k[valid], v[valid])):                       # [n, K, D]
            flat[i, batch.slots[valid]] = (new if self.quantize is None
                                           else self.quantize(new)).to(kv.dtype)
        return tuple(kv[i][batch.block_tables].flatten(1, 2) for i in (0, 1))

    def quantize_all(self, quantize) -> None:
        """Pass every stored K/V through ``quantize``, and every later one (``quantize``)."""
        for kv in self.layers:
            kv.copy_(quantize(kv.flatten(0, 2)).view(kv.shape).to(kv.dtype))
        self.quantize = quantize

    def check_fits(self, config) -> None:
        """Raise unless this cache has the layers and heads of a model with ``config``."""
        s = self.spec
        want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        if (s.num_layers, s.num_kv_heads, s.head_size) != want:
            raise ValueError(f"KV cache has (layers, kv heads, head size) "
                             f"{(s.num_layers, s.num_kv_heads, s.head_size)}; the model needs "
                             f"{want}")


@dataclass(frozen=True)
class BlockBatch:
    """Where one step's tokens go in the cache and what each sequence reads back."""

    slots: torch.Tensor          # [B, T] flat slot of each new token, -1 for padding
    block_tables: torch.Tensor   # [B, M] block ids in token order, padded with 0
    positions: torch.Tensor      # [B, T] position of each new token, 0 for padding
    last: torch.Tensor           # [B] index in T of each sequence's last new token


def block_batch(chunk_lens: list[int], starts: list[int], block_tables: list[list[int]],
                block_size: int, num_blocks: int, device) -> BlockBatch:
    """Check the block tables for sequences that hold ``starts[i]`` tokens and append
    ``chunk_lens[i]``, and lay out the step: raises ``ValueError`` naming the sequence."""
    if not len(chunk_lens) == len(starts) == len(block_tables):
        raise ValueError(f"{len(chunk_lens)} chunks, {len(starts)} starts and "
                         f"{len(block_tables)} block tables: one of each per sequence")
    if not chunk_lens:
        raise ValueError("a step needs at least one sequence")
    owner: dict[int, int] = {}
    tables = []
    for i, (n, start, table) in enumerate(zip(chunk_lens, starts, block_tables)):
        if n <= 0 or start < 0:
            raise ValueError(f"sequence {i}: {n} new tokens after {start}; need >= 1 after >= 0")
        need = blocks_for(start + n, block_size)
        ids = list(table[:need])
        if len(ids) < need:
            raise ValueError(f"sequence {i}: {start + n} tokens at block size {block_size} "
                             f"need {need} blocks; its block table has {len(ids)}")
        if len(set(ids)) < need:
            raise ValueError(f"sequence {i}: its block table repeats a block: {ids}")
        for b in ids:
            if not 0 <= b < num_blocks:
                raise ValueError(f"sequence {i}: block id {b} outside 0..{num_blocks - 1}")
            if owner.setdefault(b, i) != i:
                raise ValueError(f"block {b} is in the tables of sequences {owner[b]} and {i}")
        tables.append(ids)
    width, length = max(map(len, tables)), max(chunk_lens)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    offsets = torch.arange(length)                                                    # [T]
    positions = torch.tensor(starts)[:, None] + offsets                               # [B, T]
    valid = offsets < torch.tensor(chunk_lens)[:, None]                               # [B, T]
    blocks = table_t.gather(1, torch.where(valid, positions // block_size, 0))        # [B, T]
    slots = torch.where(valid, blocks * block_size + positions % block_size, -1)      # [B, T]
    return BlockBatch(slots=slots.to(device), block_tables=table_t.to(device),
                      positions=torch.where(valid, positions, 0).to(device),
                      last=(torch.tensor(chunk_lens) - 1).to(device))
