"""The fused CPU kernel of the HAWK transformation, built on first use (optional).

``csrc/layout_kernel.cpp`` reads each page's 32 tile rows straight from a layer's scattered
GPU blocks (``TileGather.sources``) and writes its send row once, tilized and packed:
bfloat16 / float32 values as they are, or bfloat8_b / bfloat4_b with the integer recipe of
``hardware.tiles.bfp_encode``, so it is byte-exact with the eager torch path. Where the CPU has
AVX-512 (F, BW, VL), block floats from bfloat16 are packed with it, one tile row per vector
register, the pages of a TT block side by side; a portable path packs them otherwise (and, for
tests, on request). Pages are split over torch's intra-op threads (``torch.set_num_threads``;
each page fills its own send row, so the bytes never depend on the split). It is compiled
with ``torch.utils.cpp_extension.load`` the first time a CPU transformation asks for it (a few
seconds; cached in torch's extension directory, ``~/.cache/torch_extensions`` unless
``TORCH_EXTENSIONS_DIR`` says otherwise) and registered as ``torch.ops.hawk_layout``.

When it cannot be built (no compiler, no ninja, a build error) ``available()`` is False, the
reason is logged at debug level and ``hardware.transform`` runs its eager torch path.
``HAWK_TRANSFORM_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "layout_kernel.cpp"
ENV_VAR = "HAWK_TRANSFORM_KERNEL"
MAG_BITS = {"bfloat16": 0, "float32": 0, "bfloat8_b": 7, "bfloat4_b": 3}
SAME_BITS = {"bfloat16": torch.bfloat16, "float32": torch.float32}   # sent as they are
BLOCK_FLOAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)


def enabled() -> bool:
    """False when ``HAWK_TRANSFORM_KERNEL=0`` asks for the eager torch path."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def _native() -> bool:
    """``-march=native`` only where it is known to work (gcc or clang on x86-64 Linux); the
    build is then named after the CPU's features, so a cache shared by machines with other
    CPUs never loads code built for instructions they lack."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags (Linux), for the build's name."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.cache
def _build() -> float | None:
    """Compile and load the kernel once per process: the build's seconds, or None on failure."""
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension
        native = _native()
        cpp_extension.load(name=f"hawk_layout_{_cpu_tag() if native else 'generic'}",
                           sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native"] if native else ["-O3"],
                           is_python_module=False, verbose=False)
        torch.ops.hawk_layout.pack_layer                                 # registered
    except Exception as e:                                               # noqa: BLE001
        log.debug("fused layout kernel unavailable, using eager torch: %s", e)
        return None
    return time.perf_counter() - start


def available() -> bool:
    """Whether the kernel is enabled and built (building it on the first call)."""
    return enabled() and _build() is not None


def build_seconds() -> float | None:
    """Seconds the first build (or load from the cache) took in this process, or None."""
    return _build() if enabled() else None


def applies(layer: torch.Tensor, tt_dtype: str, gather) -> bool:
    """Whether the kernel can fill this send buffer (before building it): a CPU layer, a
    block gather (head size a multiple of 32) and a format it packs from this cache dtype."""
    tiles = gather.tiles
    if layer.device.type != "cpu" or tiles is None or tiles.sources is None:
        return False
    if MAG_BITS.get(tt_dtype, 0):
        return layer.dtype in BLOCK_FLOAT_SOURCES
    return SAME_BITS.get(tt_dtype) == layer.dtype


def vectorized() -> bool:
    """Whether the built kernel packs block floats from bfloat16 with AVX-512 (building it if
    need be)."""
    return available() and bool(torch.ops.hawk_layout.vectorized())


def pack_layer(layer: torch.Tensor, sources: torch.Tensor, send_rows: torch.Tensor,
               rows: torch.Tensor, tt_dtype: str, portable: bool = False) -> None:
    """Fill the send ``rows`` [2 * S, >= page_bytes] (uint8, contiguous rows) of one layer:
    page ``p`` (tile rows at ``sources[p]``) goes to row ``send_rows[p]``. ``portable``: pack
    block floats without AVX-512 even where the kernel has it (the same bytes, slower)."""
    op = torch.ops.hawk_layout.pack_layer_portable if portable else torch.ops.hawk_layout.pack_layer
    op(layer, sources, send_rows, rows, MAG_BITS[tt_dtype])
