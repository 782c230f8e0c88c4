"""The fused CPU kernel of the HAWK transformation, built on first use (optional).

``csrc/layout_kernel.cpp`` reads each page's 32 tile rows straight from a layer's scattered
GPU blocks (``TileGather.sources``) and writes its send row once, tilized and packed:
bfloat16 / float32 values as they are, or bfloat8_b / bfloat4_b with the integer recipe of
``hardware.tiles.bfp_encode``, so it is byte-exact with the eager torch path. Block floats
take one of three paths, chosen at run time by asking the CPU: ``avx512`` (AVX-512 F, BW,
VL: from bfloat16 one tile row per register), ``avx2`` (AVX2, FMA, F16C: from bfloat16 one
group per register) or ``portable`` (plain C++ that the compiler vectorises for the build's
baseline: SSE2 on x86-64, NEON on arm64); the two vector paths pack float16 and float32
caches with the portable code compiled for their own target. All give the same bytes;
``HAWK_TRANSFORM_PATH=avx2`` (or the ``path`` argument of ``pack_layer``) forces one, and a
path the CPU lacks is refused by name. The build is baseline with each vector path compiled
for its own target, so one build runs on any CPU of the architecture. Pages are split over
torch's intra-op threads (``torch.set_num_threads``; each page fills its own send row, so the
bytes never depend on the split). It is compiled with ``torch.utils.cpp_extension.load`` the
first time a CPU transformation asks for it (a few seconds; cached in torch's extension
directory, ``~/.cache/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR`` says otherwise,
under a name that changes with the sources) and registered as ``torch.ops.hawk_layout``. With
more than one thread, calls take a second build with -fopenmp (``torch.ops.hawk_layout_omp``,
built on the first such call), the one whose ``at::parallel_for`` actually splits the pages.

When it cannot be built (no compiler, no ninja, a build error) ``available()`` is False, the
reason is logged at debug level and ``hardware.transform`` runs its eager torch path.
``HAWK_TRANSFORM_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "layout_kernel.cpp"
ENV_VAR = "HAWK_TRANSFORM_KERNEL"
PATH_VAR = "HAWK_TRANSFORM_PATH"
PATHS = {"portable": 1, "avx2": 2, "avx512": 3}         # block-float paths, slowest first
MAG_BITS = {"bfloat16": 0, "float32": 0, "bfloat8_b": 7, "bfloat4_b": 3}
SAME_BITS = {"bfloat16": torch.bfloat16, "float32": torch.float32}   # sent as they are
BLOCK_FLOAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)


def enabled() -> bool:
    """False when ``HAWK_TRANSFORM_KERNEL=0`` asks for the eager torch path."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def _openmp() -> bool:
    """Whether ATen runs its intra-op threads on OpenMP here (and gcc's -fopenmp builds)."""
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


def _flags(parallel: bool) -> tuple[list[str], list[str]]:
    """Compiler and linker flags of the serial or the parallel build. ``at::parallel_for`` is
    a header template: where ATen threads on OpenMP, its ``#pragma omp parallel`` splits the
    pages only in code built with -fopenmp (without it the kernel ran on one thread at any
    thread count). -fopenmp also made one thread 10-20% slower, so one-thread calls take the
    serial build."""
    if not parallel:
        return ["-O3"], []
    return ["-O3", "-fopenmp", "-DHAWK_LIB=hawk_layout_omp"], ["-fopenmp"]


def _source_tag(parallel: bool = False) -> str:
    """A short hash of the kernel's sources and flags, for the build's name: an edited kernel
    is built afresh rather than loaded from a cache of the old one."""
    digest = hashlib.sha1(repr(_flags(parallel)).encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def _build(parallel: bool = False) -> float | None:
    """Compile and load the serial (``torch.ops.hawk_layout``) or parallel
    (``torch.ops.hawk_layout_omp``) kernel once per process: the build's seconds, or None."""
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension
        cflags, ldflags = _flags(parallel)
        suffix = "_omp" if parallel else ""
        cpp_extension.load(name=f"hawk_layout{suffix}_{_source_tag(parallel)}",
                           sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                           is_python_module=False, verbose=False)
        getattr(torch.ops, f"hawk_layout{suffix}").pack_layer           # registered
    except Exception as e:                                               # noqa: BLE001
        log.debug("fused layout kernel (%s) unavailable: %s",
                  "parallel" if parallel else "serial", e)
        return None
    return time.perf_counter() - start


def _ops():
    """The kernel to call: the parallel build when torch runs more than one intra-op thread
    and it builds, else the serial one."""
    if torch.get_num_threads() > 1 and _openmp() and _build(True) is not None:
        return torch.ops.hawk_layout_omp
    return torch.ops.hawk_layout


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


@functools.cache
def supported_paths() -> tuple[str, ...]:
    """The block-float paths this CPU runs, slowest first (building the kernel if need be;
    empty where it cannot be built)."""
    if not available():
        return ()
    return tuple(name for name, code in PATHS.items() if torch.ops.hawk_layout.supports(code))


def best_path() -> str | None:
    """The path block floats from bfloat16 take unless one is forced, or None without a
    kernel."""
    paths = supported_paths()
    return paths[-1] if paths else None


def forced_path() -> str | None:
    """The path ``HAWK_TRANSFORM_PATH`` forces, or None where it is unset, empty or "auto"."""
    name = os.environ.get(PATH_VAR, "").strip().lower()
    if name in ("", "auto"):
        return None
    if name not in PATHS:
        raise ValueError(f"{PATH_VAR}={name!r}: not a kernel path; allowed: auto, "
                         f"{', '.join(PATHS)}")
    return name


def check_path(path: str) -> str:
    """``path`` where this CPU runs it; else ValueError naming it and the paths it runs."""
    if path not in PATHS:
        raise ValueError(f"kernel path {path!r} unknown; allowed: {', '.join(PATHS)}")
    if path not in supported_paths():
        raise ValueError(f"kernel path {path!r}: this CPU lacks its instructions (it runs "
                         f"{', '.join(supported_paths()) or 'none: no kernel'})")
    return path


@contextlib.contextmanager
def forcing(path: str | None):
    """Within the block, every pack takes ``path`` (None: the fastest), as
    ``HAWK_TRANSFORM_PATH`` would say; for benchmarks and tests."""
    if path is not None:
        check_path(path)
    old = os.environ.get(PATH_VAR)
    os.environ[PATH_VAR] = path or "auto"
    try:
        yield
    finally:
        if old is None:
            del os.environ[PATH_VAR]
        else:
            os.environ[PATH_VAR] = old


def pack_layer(layer: torch.Tensor, sources: torch.Tensor, send_rows: torch.Tensor,
               rows: torch.Tensor, tt_dtype: str, path: str | None = None,
               portable: bool = False) -> None:
    """Fill the send ``rows`` [2 * S, >= page_bytes] (uint8, contiguous rows) of one layer:
    page ``p`` (tile rows at ``sources[p]``) goes to row ``send_rows[p]``. ``path``: the
    block-float path to take (default: ``HAWK_TRANSFORM_PATH``, else the fastest the CPU
    has); ``portable=True`` is ``path="portable"``. Every path gives the same bytes."""
    name = "portable" if portable else path or forced_path()
    code = PATHS[check_path(name)] if name is not None else 0
    _ops().pack_layer(layer, sources, send_rows, rows, MAG_BITS[tt_dtype], code)
