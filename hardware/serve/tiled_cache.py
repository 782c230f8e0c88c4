"""The decode side's KV cache in the NPU's own layout, and the PyTorch backend that decodes from it.

``TiledKVCache`` holds the TT paged cache of ``hardware.kv_layout.TTKVSpec`` as it sits on the
chip: per layer K and V, each ``[max_num_blocks, kv_heads, block_size, head_dim]`` in TILE
layout (bfloat8_b by default, or bfloat16), pages interleaved over the DRAM banks, one uint8
buffer per bank. These buffers are what a transfer lands in (the HAWK plan writes straight
into them) and what decoding reads: ``update`` writes each new token's K/V rows into its tile
pages in place and hands attention every sequence's keys and values, dequantised from the
bank buffers (as ``hardware.kv_layout.read_tt_tokens`` reads them). It is a drop-in for
``hardware.model.cache.PagedKVCache`` in ``LlamaModel.extend``, with TT block ids in the block
tables.

A tile row of one token and head is two 16-element face rows per 32 columns, and a block-float
shares one exponent per face row, so a token's K/V quantises on its own: appending a token
rewrites only its own face rows (exponent byte and codes), never its neighbours'.

``ttnn_backend_available`` says whether a ttnn decode backend could run here (ttnn importable and
a Tenstorrent device present), and why not.
"""

from __future__ import annotations

import numpy as np
import torch

from hardware.dram import page_location
from hardware.kv_layout import TTKVSpec, from_tt_blocks
from hardware.tiles import FACE, TILE, tile_format, unpack_tiles, untilize

ROW_GROUPS = TILE // FACE            # face rows of one tile row (two)


class TiledKVCache:
    """The TT paged KV cache of one chip, in per-bank buffers (``banks[b]``: uint8)."""

    def __init__(self, spec: TTKVSpec):
        self.spec = spec
        self.banks = [np.zeros(n, np.uint8) for n in spec.region_sizes]
        fmt = tile_format(spec.dtype)
        if fmt.is_block_float:
            self._group_bytes = FACE * (fmt.mag_bits + 1) // 8     # codes of one face row
        else:
            self._group_bytes = FACE * fmt.tile_bytes // (TILE * TILE)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.spec.max_num_blocks

    def check_fits(self, config) -> None:
        s = self.spec
        want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        if (s.num_layers, s.num_kv_heads, s.head_dim) != want:
            raise ValueError(f"tiled KV cache has (layers, kv heads, head dim) "
                             f"{(s.num_layers, s.num_kv_heads, s.head_dim)}; the model needs "
                             f"{want}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch):
        """Write new ``k, v [B, T, K, D]`` at ``batch.slots`` (TT block * block_size + row) into
        the bank buffers; return every sequence's keys and values ``[B, S, K, D]`` float32,
        S = block table width * block size, read back from the banks."""
        valid = (batch.slots >= 0).cpu()                                      # [B, T]
        slots = batch.slots.cpu()[valid].numpy()                              # [n]
        for kv, new in enumerate((k, v)):
            self.write_rows(layer, kv, slots, new.detach()[valid.to(new.device)].float().cpu()
                            .numpy())
        tables = batch.block_tables.cpu().numpy()                             # [B, M]
        out = []
        for kv in (0, 1):
            seqs = [self.read(layer, kv, table) for table in tables]          # [S, K, D] each
            out.append(torch.from_numpy(np.stack(seqs)).to(k.device))         # [B, S, K, D]
        return tuple(out)

    def read(self, layer: int, kv: int, tt_blocks) -> np.ndarray:
        """Whole blocks ``tt_blocks`` of one tensor, dequantised: ``[len * block_size, K, D]``
        (a padded block table may repeat block 0: attention masks those rows out)."""
        s = self.spec
        tt_blocks = np.asarray(tt_blocks, np.int64)
        pages = s.block_pages(tt_blocks)
        bank, offset = page_location(pages, s.page_bytes, s.dram, s.tensor_base(layer, kv))
        rows = offset[:, None] + np.arange(s.page_bytes)                     # [pages, bytes]
        data = np.empty(rows.shape, dtype=np.uint8)
        for b in np.unique(bank):
            data[bank == b] = self.banks[b][rows[bank == b]]
        h, d = s.num_kv_heads, s.head_dim
        pshape = (tt_blocks.size, h, s.block_size, -(-d // TILE) * TILE)
        blocks = untilize(unpack_tiles(data, s.dtype), pshape, pshape[:3] + (d,))
        return from_tt_blocks(blocks, tt_blocks.size * s.block_size)

    def write_rows(self, layer: int, kv: int, slots: np.ndarray, rows: np.ndarray) -> None:
        """Pack ``rows [n, K, D]`` (float32) into the tile rows of flat slots ``slots [n]``."""
        s = self.spec
        if rows.size == 0:
            return
        nc = -(-s.head_dim // TILE)                                          # tile columns
        block, r = slots // s.block_size, slots % s.block_size               # [n]
        heads = np.arange(s.num_kv_heads)
        tile_rows = s.block_size // TILE
        page = (((block[:, None] * s.num_kv_heads + heads) * tile_rows + r[:, None] // TILE)
                [:, :, None] * nc + np.arange(nc))                           # [n, K, nc]
        rr = (r % TILE)[:, None, None, None]
        group = ((rr // FACE) * 2 + np.arange(ROW_GROUPS)) * FACE + rr % FACE  # [n, 1, 1, 2]
        padded = np.zeros(rows.shape[:2] + (nc * TILE,), np.float32)
        padded[..., :s.head_dim] = rows
        values = padded.reshape(-1, FACE)                                    # [n*K*nc*2, 16]
        shared, codes = _encode_groups(values, s.dtype, self._group_bytes)
        page = np.broadcast_to(page[..., None], group.shape[:1] + page.shape[1:] + (2,))
        group = np.broadcast_to(group, page.shape).reshape(-1)
        bank, base = page_location(page.reshape(-1), s.page_bytes, s.dram, s.tensor_base(layer, kv))
        block_float = shared is not None
        code_at = base + (TILE * TILE // FACE if block_float else 0) + group * self._group_bytes
        cols = np.arange(self._group_bytes)
        for b in np.unique(bank):
            sel = bank == b
            if block_float:
                self.banks[b][base[sel] + group[sel]] = shared[sel]
            self.banks[b][code_at[sel, None] + cols] = codes[sel]


def _encode_groups(values: np.ndarray, dtype: str, group_bytes: int):
    """Face rows ``[m, 16]`` float32 -> (exponent byte per row, or None for plain floats;
    bytes ``[m, group_bytes]``)."""
    from hardware.tiles import GROUPS, pack_tiles

    fmt = tile_format(dtype)
    m = values.shape[0]
    tiles = np.zeros((-(-m // GROUPS) * GROUPS, FACE), np.float32)
    tiles[:m] = values
    packed = pack_tiles(tiles.reshape(-1, TILE * TILE), dtype)              # [m/64, tile_bytes]
    if not fmt.is_block_float:
        return None, packed.reshape(-1, group_bytes)[:m]
    shared = packed[:, :GROUPS].reshape(-1)[:m]
    codes = packed[:, GROUPS:].reshape(-1, group_bytes)[:m]
    return shared, codes


def ttnn_backend_available() -> tuple[bool, str]:
    """Whether a ttnn decode backend can run here; the reason when it cannot."""
    try:
        import ttnn  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure means no backend)
        return False, f"ttnn does not import ({type(e).__name__}: {e})"
    try:
        num = ttnn.GetNumAvailableDevices()
    except Exception as e:  # noqa: BLE001
        return False, f"ttnn imports but cannot count devices ({e})"
    if not num:
        return False, "ttnn imports but no Tenstorrent device is present"
    return True, f"{num} Tenstorrent device(s)"
