"""A served request's KV cache from the prefill worker's paged cache into the decode worker's
cache, through Algorithm 1 (``hardware.protocol``), for each mechanism of
``hardware.mechanisms``:

=============  ==========================  ================================================
mechanism      decode side's cache         what lands, and what the receiver does after
=============  ==========================  ================================================
``GG-Host``    paged (``PagedKVCache``)    tokens in a host staging buffer; scattered into
                                           the request's blocks
``GG-Direct``  paged                       the request's GPU blocks straight into its blocks
                                           of the per-layer K/V tensors
``GN-Host``    tiled (``TiledKVCache``)    tokens in a host staging buffer; a copy, then the
                                           NPU re-layout into the request's TT blocks
``GN-Direct``  tiled                       tokens in one contiguous buffer (the single buffer),
                                           then the re-layout
``GN-HAWK``    tiled                       transformed on the prefill side; the HAWK plan writes
                                           the pages straight into the per-bank buffers
=============  ==========================  ================================================

``KVSource`` is the prefill side's ``Source``: it holds each prefilled request's blocks until
the decode side pulls them (or the router drops the request), then frees them. ``KVSink`` is
the decode side's ``Sink`` over the worker's whole cache: ``expect`` tells it a request's
length, ``reserve`` allocates blocks for the prompt and every token still to come, ``plan``
maps the prepared bytes onto them. A request's blocks stay allocated after the pull (decoding
appends to them) until ``free``. The staging buffer is one request wide: a decode worker pulls
one request at a time.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hardware.dram import DramConfig
from hardware.kv_layout import GpuKVSpec, TTKVSpec, blocks_for
from hardware.mechanisms import MECHANISMS, contiguous_plan, relayout_to_banks, send_payload, \
    tokens_view
from hardware.transfer_plan import TransferPlan
from hardware.mechanism_plans import RequestTransfer, hawk_plan
from hardware.transport.base import Prepared, Transport

TILED = ("GN-Host", "GN-Direct", "GN-HAWK")


def check_mechanism(name: str) -> str:
    if name not in MECHANISMS:
        raise ValueError(f"mechanism {name!r}: allowed {', '.join(MECHANISMS)}")
    return name


class BlockPool:
    """Free block ids of one cache; a request takes the lowest free ids (runs stay adjacent)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = set(range(num_blocks))
        self.held: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, key: str, n: int) -> list[int] | None:
        """``n`` block ids for ``key``, or None when fewer are free."""
        with self._lock:
            if key in self.held:
                raise ValueError(f"request {key!r} already holds blocks")
            if n > len(self._free):
                return None
            ids = sorted(self._free)[:n]
            self._free.difference_update(ids)
            self.held[key] = ids
            return ids

    def free(self, key: str) -> None:
        with self._lock:
            self._free.update(self.held.pop(key, ()))


def gpu_spec_dict(spec: GpuKVSpec) -> dict:
    return {"num_layers": spec.num_layers, "num_blocks": spec.num_blocks,
            "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
            "block_size": spec.block_size, "dtype": spec.dtype}


def tt_spec_dict(spec: TTKVSpec) -> dict:
    return {"num_layers": spec.num_layers, "max_num_blocks": spec.max_num_blocks,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": spec.dtype,
            "num_banks": spec.dram.num_banks, "alignment": spec.dram.alignment}


def tt_spec_from(d: dict) -> TTKVSpec:
    dram = DramConfig(num_banks=int(d["num_banks"]), alignment=int(d["alignment"]),
                      bank_bytes=1 << 40, name="decode")
    return TTKVSpec(int(d["num_layers"]), int(d["max_num_blocks"]), int(d["num_kv_heads"]),
                    int(d["head_dim"]), dram, int(d["block_size"]), str(d["dtype"]))


def nominal_tt(gpu: GpuKVSpec, num_tokens: int) -> tuple[TTKVSpec, np.ndarray]:
    """A TT spec and blocks sized to one request: the GPU-to-GPU paths carry no NPU side."""
    n = blocks_for(num_tokens, 32)
    dram = DramConfig(num_banks=1, bank_bytes=1 << 40, name="none")
    return TTKVSpec(gpu.num_layers, n, gpu.num_kv_heads, gpu.head_size, dram,
                    dtype="bfloat16"), np.arange(n)


# -- prefill side ----------------------------------------------------------------------------
class KVSource:
    """The prefill worker's ``Source``: prepares a held request's KV for the puller's mechanism."""

    def __init__(self, cache, pool: BlockPool):
        self.cache, self.pool = cache, pool          # a PagedKVCache and its block pool
        self.lengths: dict[str, int] = {}
        self._lock = threading.Lock()

    def hold(self, request_id: str, num_tokens: int) -> None:
        with self._lock:
            self.lengths[request_id] = num_tokens

    def drop(self, request_id: str) -> None:
        with self._lock:
            self.lengths.pop(request_id, None)
        self.pool.free(request_id)

    def __call__(self, request_id: str, dest: dict) -> Prepared:
        with self._lock:
            num_tokens = self.lengths[request_id]            # KeyError: UnknownRequest
        mechanism = check_mechanism(dest.get("mechanism"))
        gpu = self.cache.spec
        table = np.asarray(self.pool.held[request_id][:gpu.blocks_for(num_tokens)])
        if mechanism in TILED:
            tt, tt_blocks = tt_spec_from(dest["tt"]), np.asarray(dest["blocks"])
        else:
            tt, tt_blocks = nominal_tt(gpu, num_tokens)
        req = RequestTransfer(gpu, tt, table, tt_blocks, num_tokens)
        payload = send_payload(mechanism, self.cache.layers, req)
        self.drop(request_id)                          # the payload is a copy: blocks are free
        return Prepared(payload, {"mechanism": mechanism, "num_tokens": num_tokens,
                                  "gpu": gpu_spec_dict(gpu), "block_table": table.tolist()})


# -- decode side -----------------------------------------------------------------------------
class KVSink:
    """The decode worker's ``Sink`` for one mechanism over its whole cache (paged or tiled)."""

    def __init__(self, mechanism: str, transport: Transport, cache, max_request_tokens: int):
        self.mechanism, self.transport, self.cache = check_mechanism(mechanism), transport, cache
        self.tiled = mechanism in TILED
        self.pool = BlockPool(cache.num_blocks)
        self.expected: dict[str, tuple[int, int]] = {}     # id -> (prompt, total tokens)
        self._registered = []
        if mechanism == "GN-HAWK":
            self._registered = [transport.register_buffer(b) for b in cache.banks]
        elif mechanism == "GG-Direct":
            self._registered = [transport.register_buffer(t) for t in cache.layers]
        else:
            c = cache.spec
            heads, dim = c.num_kv_heads, (c.head_dim if self.tiled else c.head_size)
            self.staging = np.zeros(2 * c.num_layers * max_request_tokens * heads * dim * 4,
                                    np.uint8)
            self._registered = [transport.register_buffer(self.staging)]
        self.regions = (self._tensor_regions() if mechanism == "GG-Direct"
                        else list(self._registered))

    def _tensor_regions(self):
        """The paged cache's per-layer K and V tensors, as vLLM registers them."""
        from hardware.transport.base import Region
        out = []
        for whole in self._registered:
            half = whole.nbytes // 2
            out += [Region(whole.address + i * half, half, whole.key, whole.owner) for i in (0, 1)]
        return out

    def expect(self, request_id: str, num_prompt_tokens: int, num_total_tokens: int) -> None:
        self.expected[request_id] = (num_prompt_tokens, num_total_tokens)

    def blocks_needed(self, request_id: str) -> int:
        return blocks_for(self.expected[request_id][1], self.cache.block_size)

    def reserve(self, request_id: str) -> dict:
        ids = self.pool.alloc(request_id, self.blocks_needed(request_id))
        if ids is None:
            raise MemoryError(f"decode cache: no {self.blocks_needed(request_id)} free blocks "
                              f"for request {request_id!r} ({self.pool.num_free} free)")
        prompt = self.expected[request_id][0]
        dest = {"mechanism": self.mechanism,
                "blocks": ids[:blocks_for(prompt, self.cache.block_size)]}
        if self.tiled:
            dest["tt"] = tt_spec_dict(self.cache.spec)
        return dest

    def _request(self, dest: dict, meta: dict) -> RequestTransfer:
        g = meta["gpu"]
        gpu = GpuKVSpec(g["num_layers"], g["num_blocks"], g["num_kv_heads"], g["head_size"],
                        g["block_size"], g["dtype"])
        n = int(meta["num_tokens"])
        tt, blocks = ((self.cache.spec, dest["blocks"]) if self.tiled else nominal_tt(gpu, n))
        blocks = np.asarray(blocks)[:blocks_for(n, tt.block_size)]
        return RequestTransfer(gpu, tt, np.asarray(meta["block_table"]), blocks, n)

    def plan(self, request_id: str, dest: dict, meta: dict) -> TransferPlan:
        req = self._request(dest, meta)
        if self.mechanism == "GN-HAWK":
            return hawk_plan(req)
        if self.mechanism == "GG-Direct":
            g, n = req.gpu, req.block_table.size
            t = np.repeat(np.arange(req.num_tensors), n)
            dst = np.tile(np.asarray(dest["blocks"]), req.num_tensors) * g.block_bytes
            src = np.arange(req.num_tensors * n) * g.block_bytes
            return TransferPlan("per_gpu_block", src, t, dst, np.full(t.size, g.block_bytes),
                                req.num_tensors * n * g.block_bytes,
                                tuple(r.nbytes for r in self.regions))
        return contiguous_plan(self.mechanism, req, req.token_bytes // req.num_tensors)

    def complete(self, request_id: str, meta: dict) -> None:
        """D6-D7: what the receiver does before the KV cache is usable."""
        if self.mechanism in ("GN-HAWK", "GG-Direct"):
            return
        dest = {"blocks": self.pool.held[request_id]}
        req = self._request(dest, meta)
        staged = self.staging[:req.token_bytes]
        staged = staged.copy() if self.mechanism.endswith("-Host") else staged
        tokens = tokens_view(staged, req)                                   # [L, 2, T, K, D]
        if self.tiled:
            relayout_to_banks(tokens, req, self.cache.banks)
            return
        bs, n = self.cache.block_size, req.num_tokens
        slots = torch.as_tensor(np.asarray(dest["blocks"])[np.arange(n) // bs] * bs
                                + np.arange(n) % bs)
        for layer, kv in zip(self.cache.layers, torch.from_numpy(tokens)):
            flat = layer.view(2, -1, *layer.shape[-2:])                    # [2, N*bs, K, D]
            flat[:, slots] = kv.to(layer.dtype)

    def release(self, request_id: str) -> None:
        """Nothing to do: the request keeps its blocks for decoding until ``free``."""

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)
        self.expected.pop(request_id, None)

    def close(self) -> None:
        for r in self._registered:
            self.transport.release(r)
        self._registered = []
