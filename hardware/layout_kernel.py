"""The fused CPU kernel of the HAWK transformation, built ahead or on first use (optional).

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
bytes never depend on the split).

It is compiled with ``torch.utils.cpp_extension.load`` by ``hardware.kernel_build``: ahead of
serving with ``python -m hardware.layout_kernel --build`` (the real-mode prefill workers call
``warm_up()`` before they join), else the first time a CPU transformation asks for it (about
a minute; cached in torch's extension directory, ``~/.cache/torch_extensions`` unless
``TORCH_EXTENSIONS_DIR`` says otherwise, in a directory named by everything that changes the
binary). It is registered as ``torch.ops.hawk_layout``. With more than one thread, calls take
a second build with -fopenmp (``torch.ops.hawk_layout_omp``, built on the first such call),
the one whose ``at::parallel_for`` actually splits the pages. A process never waits more than
``HAWK_KERNEL_WAIT_S`` seconds (default 5) for another's build: past it, it runs the eager
torch path and says so in one line on stderr; a killed build's lock is removed.

When it cannot be built (no compiler, no ninja, a build error) ``available()`` is False, the
reason is logged at debug level and ``hardware.transform`` runs its eager torch path.
``HAWK_TRANSFORM_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
from pathlib import Path

import torch

from hardware import kernel_build

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "layout_kernel.cpp"
ENV_VAR = "HAWK_TRANSFORM_KERNEL"
PATH_VAR = "HAWK_TRANSFORM_PATH"
PATHS = {"portable": 1, "avx2": 2, "avx512": 3}         # block-float paths, slowest first
MAG_BITS = {"bfloat16": 0, "float32": 0, "bfloat8_b": 7, "bfloat4_b": 3}
SAME_BITS = {"bfloat16": torch.bfloat16, "float32": torch.float32}   # sent as they are
BLOCK_FLOAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
WARM_WAIT_S = 120.0        # warm-up waits out another process's build (one takes up to a minute)


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


def _spec(parallel: bool) -> kernel_build.Spec:
    """The serial or the parallel build: its name, sources (an edited kernel or header is
    built afresh, in a directory of its own) and flags."""
    cflags, ldflags = _flags(parallel)
    headers = sorted(p for p in CSRC.iterdir() if p.suffix == ".h")
    return kernel_build.Spec("hawk_layout_omp" if parallel else "hawk_layout",
                             (SOURCE, *headers), tuple(cflags), tuple(ldflags))


_BUILDS: dict[bool, kernel_build.Built | None] = {}     # parallel? -> the build, None: none
_FAILURES: dict[bool, str] = {}                          # parallel? -> why there is none


def _build(parallel: bool = False, wait_s: float | None = None) -> kernel_build.Built | None:
    """Load (building it if need be) the serial (``torch.ops.hawk_layout``) or parallel
    (``torch.ops.hawk_layout_omp``) kernel once per process, waiting at most ``wait_s``
    seconds (default ``HAWK_KERNEL_WAIT_S``) for another process's build of it; None where
    it cannot be had, and this process runs the eager torch path."""
    if parallel in _BUILDS:
        return _BUILDS[parallel]
    kind = "parallel" if parallel else "serial"
    wait_s = kernel_build.wait_seconds() if wait_s is None else wait_s
    built = None
    try:
        built = kernel_build.load(_spec(parallel), wait_s)
        getattr(torch.ops, _spec(parallel).name).pack_layer              # registered
    except kernel_build.BuildBusy as e:
        _FAILURES[parallel] = str(e)
        kernel_build.say_once(f"{e}; this process runs the eager torch path (python -m "
                              f"hardware.layout_kernel --build builds it ahead)")
        built = None
    except Exception as e:                                               # noqa: BLE001
        _FAILURES[parallel] = f"{type(e).__name__}: {e}"
        log.debug("fused layout kernel (%s) unavailable: %s", kind, e)
        built = None
    _BUILDS[parallel] = built
    return built


def _wants_parallel() -> bool:
    return torch.get_num_threads() > 1 and _openmp()


def _ops():
    """The kernel to call: the parallel build when torch runs more than one intra-op thread
    and it builds, else the serial one."""
    if _wants_parallel() and _build(True) is not None:
        return torch.ops.hawk_layout_omp
    return torch.ops.hawk_layout


def available() -> bool:
    """Whether the kernel is enabled and built (building it on the first call)."""
    return enabled() and _build() is not None


def build_seconds() -> float | None:
    """Seconds the first build (or load from the cache) took in this process, or None."""
    built = _build() if enabled() else None
    return built.seconds if built is not None else None


def warm_up(wait_s: float = WARM_WAIT_S) -> list[kernel_build.Built]:
    """Build (or load) now the kernel(s) this process's calls will take, waiting up to
    ``wait_s`` seconds for another process's build: a server calls it before it serves, so
    that no request waits on a compile. Nothing where ``HAWK_TRANSFORM_KERNEL=0``."""
    if not enabled():
        return []
    builds = [_build(False, wait_s)]
    if _wants_parallel():
        builds.append(_build(True, wait_s))
    return [b for b in builds if b is not None]


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


def main(argv=None) -> int:
    """``python -m hardware.layout_kernel --build``: build the kernel ahead of serving."""
    p = argparse.ArgumentParser(prog="python -m hardware.layout_kernel", allow_abbrev=False,
                                description="Build the fused CPU kernel of the HAWK "
                                            "transformation ahead of serving.")
    p.add_argument("--build", action="store_true", required=True,
                   help="build (or load) the serial build and, where torch threads on "
                        "OpenMP, the parallel one; print where and how long")
    p.add_argument("--wait-s", type=float, default=WARM_WAIT_S,
                   help=f"wait at most this long for another process's build (default "
                        f"{WARM_WAIT_S:g})")
    args = p.parse_args(argv)
    if not enabled():
        print(f"{ENV_VAR}=0: the fused kernel is off; nothing built")
        return 0
    status = 0
    for parallel in (False, True) if _openmp() else (False,):
        built = _build(parallel, args.wait_s)
        name = _spec(parallel).name
        if built is None:
            print(f"{name}: not built: {_FAILURES[parallel]}", file=sys.stderr)
            status = 1
        else:
            verb = "built" if built.compiled else "loaded (built before)"
            print(f"{name}: {verb} in {built.seconds:.1f} s: {built.library}")
    return status


if __name__ == "__main__":
    sys.exit(main())
