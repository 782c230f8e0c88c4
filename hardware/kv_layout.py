"""KV-cache layouts on both sides of a transfer: vLLM's paged GPU cache and the TT paged cache.

GPU (vLLM v1, FlashAttention backend): per layer a tensor of logical shape
``(2, num_blocks, block_size, num_kv_heads, head_size)``, K = [0], V = [1], stored in NHD order
or in HND order ``(2, num_blocks, num_kv_heads, block_size, head_size)``. A request owns the
blocks of its block table, in token order. Tensor parallelism shards the cache by KV heads.

NPU (tt-metal Llama): per layer K and V, each ``[max_num_blocks, kv_heads, block_size,
head_dim]`` in TILE layout, DRAM interleaved over the chip's banks. Block size is a multiple of
32, so one block of one head is ``block_size/32 * ceil(head_dim/32)`` whole tiles (pages).
The 2 * num_layers tensors sit one after another in every bank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from hardware.dram import DramConfig, page_location
from hardware.tiles import TILE, tile_format, unpack_tiles, untilize

GPU_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def blocks_for(num_tokens, block_size: int):
    """KV blocks holding ``num_tokens`` tokens (an int, or an integer array elementwise)."""
    return -(-num_tokens // block_size)


def _positive(**values) -> None:
    for name, value in values.items():
        if int(value) <= 0:
            raise ValueError(f"{name} {value} must be > 0")


@dataclass(frozen=True)
class GpuKVSpec:
    """The paged KV cache of one GPU (one TP rank): every layer has the same shape."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int            # on this rank
    head_size: int
    block_size: int = 16
    dtype: str = "bfloat16"
    order: Literal["NHD", "HND"] = "NHD"

    def __post_init__(self) -> None:
        _positive(num_layers=self.num_layers, num_blocks=self.num_blocks,
                  num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                  block_size=self.block_size)
        if self.block_size % 16:
            raise ValueError(f"GPU block_size {self.block_size} must be a multiple of 16")
        if self.order not in ("NHD", "HND"):
            raise ValueError(f"order {self.order!r} must be 'NHD' or 'HND'")
        if self.dtype not in GPU_DTYPES:
            raise ValueError(f"GPU cache dtype {self.dtype!r}; allowed: {', '.join(GPU_DTYPES)}")

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """Shape of one layer's tensor as stored."""
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size
        return (2, nb, bs, h, d) if self.order == "NHD" else (2, nb, h, bs, d)

    @property
    def elem_bytes(self) -> int:
        return GPU_DTYPES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_size * self.elem_bytes

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(int(num_tokens), self.block_size)

    def block_offsets(self, layer: int, kv: int, block_ids) -> np.ndarray:
        """Byte offsets of blocks in the layers laid end to end (layer, K/V, block)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return layer * self.layer_bytes + (kv * self.num_blocks + ids) * self.block_bytes


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """KV heads held by TP ``rank``; heads are replicated when ``tp_size`` exceeds them (vLLM)."""
    _positive(num_kv_heads=num_kv_heads, tp_size=tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range 0..{tp_size - 1}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads {num_kv_heads} not divisible by tp_size {tp_size}")
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} not a multiple of num_kv_heads {num_kv_heads}")
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


def shard_heads(x: np.ndarray, num_kv_heads: int, tp_size: int, rank: int,
                axis: int = -2) -> np.ndarray:
    """The slice of ``x`` (heads on ``axis``) that TP ``rank`` holds."""
    heads = kv_head_range(num_kv_heads, tp_size, rank)
    return np.take(x, np.arange(heads.start, heads.stop), axis=axis)


def check_block_table(block_table, num_tokens: int, block_size: int, num_blocks: int,
                      what: str = "block table") -> np.ndarray:
    """``block_table`` as int64, checked: enough blocks for ``num_tokens``, ids in range."""
    table = np.asarray(block_table, dtype=np.int64).reshape(-1)
    need = blocks_for(int(num_tokens), block_size)
    if num_tokens <= 0:
        raise ValueError(f"num_tokens {num_tokens} must be > 0")
    if table.size != need:
        raise ValueError(f"{what} has {table.size} blocks; {num_tokens} tokens at block size "
                         f"{block_size} need {need}")
    if table.min() < 0 or table.max() >= num_blocks:
        raise ValueError(f"{what} ids must be in 0..{num_blocks - 1}, got {table.min()}.."
                         f"{table.max()}")
    if np.unique(table).size != table.size:
        raise ValueError(f"{what} repeats a block id")
    return table


def gather_tokens(layer: np.ndarray, spec: GpuKVSpec, block_table, num_tokens: int) -> np.ndarray:
    """One layer's cache (physical shape) -> the request's ``[2, T, H, D]`` K and V."""
    table = check_block_table(block_table, num_tokens, spec.block_size, spec.num_blocks)
    blocks = layer[:, table]                            # [2, n, bs, H, D] or [2, n, H, bs, D]
    if spec.order == "HND":
        blocks = blocks.swapaxes(2, 3)                         # [2, n, bs, H, D]
    tokens = blocks.reshape(2, -1, spec.num_kv_heads, spec.head_size)
    return tokens[:, :num_tokens]


def scatter_tokens(layer: np.ndarray, spec: GpuKVSpec, block_table, kv: np.ndarray) -> None:
    """Write a request's ``[2, T, H, D]`` into one layer's cache (physical shape), in place."""
    num_tokens = kv.shape[1]
    table = check_block_table(block_table, num_tokens, spec.block_size, spec.num_blocks)
    padded = np.zeros((2, table.size * spec.block_size) + kv.shape[2:], dtype=layer.dtype)
    padded[:, :num_tokens] = kv
    blocks = padded.reshape(2, table.size, spec.block_size, *kv.shape[2:])
    if spec.order == "HND":
        blocks = blocks.swapaxes(2, 3)
    layer[:, table] = blocks


@dataclass(frozen=True)
class TTKVSpec:
    """The paged KV cache of one Tenstorrent chip: ``2 * num_layers`` interleaved tensors."""

    num_layers: int
    max_num_blocks: int
    num_kv_heads: int            # on this chip
    head_dim: int
    dram: DramConfig
    block_size: int = 32
    dtype: str = "bfloat8_b"

    def __post_init__(self) -> None:
        _positive(num_layers=self.num_layers, max_num_blocks=self.max_num_blocks,
                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                  block_size=self.block_size)
        if self.block_size % TILE:
            raise ValueError(f"TT block_size {self.block_size} must be a multiple of {TILE}")
        tile_format(self.dtype)

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.max_num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return tile_format(self.dtype).tile_bytes

    @property
    def pages_per_block(self) -> int:
        return self.num_kv_heads * (self.block_size // TILE) * -(-self.head_dim // TILE)

    @property
    def tensor_pages(self) -> int:
        return self.max_num_blocks * self.pages_per_block

    @property
    def tensor_bank_bytes(self) -> int:
        """Bytes one tensor (one layer's K or V) takes in every bank."""
        slots = -(-self.tensor_pages // self.dram.num_banks)
        return slots * self.dram.aligned(self.page_bytes)

    @property
    def region_sizes(self) -> tuple[int, ...]:
        """Bytes of the whole cache in each bank."""
        return (2 * self.num_layers * self.tensor_bank_bytes,) * self.dram.num_banks

    def tensor_base(self, layer: int, kv: int) -> int:
        """In-bank base address of layer ``layer``'s K (kv=0) or V (kv=1) tensor."""
        if not (0 <= layer < self.num_layers and kv in (0, 1)):
            raise ValueError(f"layer {layer} / kv {kv} out of range "
                             f"0..{self.num_layers - 1} / 0..1")
        return (2 * layer + kv) * self.tensor_bank_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(int(num_tokens), self.block_size)

    def block_pages(self, block_ids) -> np.ndarray:
        """Page numbers, in order, of the given blocks (within one tensor)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return (ids[:, None] * self.pages_per_block + np.arange(self.pages_per_block)).reshape(-1)


def to_tt_blocks(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """``[T, H, D]`` -> ``[nb, H, block_size, D]``, zero-padding the last block."""
    t, h, d = tokens.shape
    nb = blocks_for(t, block_size)
    padded = np.zeros((nb * block_size, h, d), dtype=tokens.dtype)
    padded[:t] = tokens
    return padded.reshape(nb, block_size, h, d).transpose(0, 2, 1, 3)


def from_tt_blocks(blocks: np.ndarray, num_tokens: int) -> np.ndarray:
    """``[nb, H, bs, D]`` -> the first ``num_tokens`` tokens as ``[T, H, D]``."""
    nb, h, bs, d = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(nb * bs, h, d)[:num_tokens]


def read_tt_tokens(banks, spec: TTKVSpec, layer: int, kv: int, tt_blocks,
                   num_tokens: int) -> np.ndarray:
    """Read a request back out of per-bank buffers: ``[T, H, D]`` float32 for one tensor."""
    table = check_block_table(tt_blocks, num_tokens, spec.block_size, spec.max_num_blocks,
                              what="TT block table")
    pages = spec.block_pages(table)
    bank, offset = page_location(pages, spec.page_bytes, spec.dram, spec.tensor_base(layer, kv))
    rows = offset[:, None] + np.arange(spec.page_bytes)            # [pages, page_bytes]
    data = np.empty(rows.shape, dtype=np.uint8)
    for b in np.unique(bank):
        data[bank == b] = np.asarray(banks[b])[rows[bank == b]]
    tiles = unpack_tiles(data, spec.dtype)                           # [pages, 1024]
    h, d = spec.num_kv_heads, spec.head_dim
    pshape = (table.size, h, spec.block_size, -(-d // TILE) * TILE)
    blocks = untilize(tiles, pshape, (table.size, h, spec.block_size, d))
    return from_tt_blocks(blocks, num_tokens)
