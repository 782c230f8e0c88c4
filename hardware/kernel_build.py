"""Builds and loads the fused CPU kernel's library (``hardware.layout_kernel``) so that a
build never blocks a run.

torch's ``cpp_extension.load`` names its build directory by the extension's name only and,
when a ``lock`` file is there, waits for it to go away with no bound and no message: a build
that was killed left a lock that hung every later user, and two environments with different
torch headers rebuilt one directory in turn. Here:

- the directory's name carries a hash of everything that changes the binary (``build_key``):
  the sources, the flags, torch's version and include paths, the Python executable and ABI,
  the machine, the compiler (``CXX``) and the environment's include paths (``CPATH``,
  ``C_INCLUDE_PATH``, ``CPLUS_INCLUDE_PATH``), so two environments never share a directory;
- a process that builds holds an advisory ``flock`` on ``hawk.lock`` in that directory, which
  the system drops when the process dies, however it dies. Holding it, a torch ``lock`` file
  found there was left by a killed build: it is removed. A build says so in one line on
  stderr (where, and the lock it removed);
- another process's live build is waited on for at most ``wait_s`` seconds (the callers'
  default: ``HAWK_KERNEL_WAIT_S``, 5); past it ``BuildBusy`` is raised and the caller runs
  the eager torch path;
- a finished build writes ``built`` (the library's file name) beside it: later processes load
  that library at once, with no lock and no ninja run.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

WAIT_VAR = "HAWK_KERNEL_WAIT_S"
DEFAULT_WAIT_S = 5.0
POLL_S = 0.05
ENV_KEYS = ("CXX", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
LOCK = "hawk.lock"                  # ours (flock); torch's own is "lock"
MARK = "built"

_said: set[str] = set()


class BuildBusy(RuntimeError):
    """Another live process held the build directory past the bound."""


@dataclass(frozen=True)
class Spec:
    """One build: the library's name, its sources (the first compiled, the others the headers
    it includes) and flags."""
    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]


@dataclass(frozen=True)
class Built:
    directory: Path
    library: Path
    seconds: float
    compiled: bool              # False: an existing build was loaded


def say_once(line: str) -> None:
    """Print ``line`` on stderr, at most once per process."""
    if line not in _said:
        _said.add(line)
        print(f"hardware.layout_kernel: {line}", file=sys.stderr, flush=True)


def wait_seconds() -> float:
    """The bound on waiting for another process's build: ``HAWK_KERNEL_WAIT_S`` (seconds)."""
    text = os.environ.get(WAIT_VAR, "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{WAIT_VAR}={text!r}: seconds to wait for another process's kernel "
                         f"build, a number >= 0")
    return value


def build_key(spec: Spec) -> str:
    """A hash of everything that changes the binary built from ``spec`` here."""
    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha1()
    for part in (spec.name, spec.cflags, spec.ldflags, torch.__version__,
                 cpp_extension.include_paths(), sys.executable, sys.version,
                 sysconfig.get_config_var("SOABI"), getattr(sys, "abiflags", ""),
                 platform.machine(), [(k, os.environ.get(k)) for k in ENV_KEYS]):
        digest.update(repr(part).encode() + b"\0")
    for path in spec.sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_directory(spec: Spec) -> Path:
    """Where ``spec`` is built: ``<torch's extension root>/<name>_<build_key>``, the root
    being ``TORCH_EXTENSIONS_DIR`` or torch's default (``~/.cache/torch_extensions``)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"{spec.name}_{build_key(spec)}"


def _built_library(directory: Path) -> Path | None:
    try:
        library = directory / (directory / MARK).read_text().strip()
    except OSError:
        return None
    return library if library.is_file() else None


def _acquire(handle, wait_s: float) -> bool:
    """Take the exclusive flock on ``handle`` within ``wait_s`` seconds."""
    import fcntl

    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def _compile(spec: Spec, directory: Path) -> Path:
    """Compile (or let ninja find up to date) and load ``spec`` in ``directory``; the caller
    holds the directory's flock, so a torch lock there is a killed build's."""
    from torch.utils import cpp_extension

    stale, note = directory / "lock", ""
    if stale.exists():
        stale.unlink(missing_ok=True)
        note = f"removed the stale build lock {stale} (left by a build that was killed); "
    say_once(f"{note}building the fused kernel in {directory} (once; up to a minute)")
    library = Path(cpp_extension.load(
        name=spec.name, sources=[str(spec.sources[0])], extra_cflags=list(spec.cflags),
        extra_ldflags=list(spec.ldflags), build_directory=str(directory),
        is_python_module=False, verbose=False))
    part = directory / f"{MARK}.{os.getpid()}"
    part.write_text(library.name)
    part.replace(directory / MARK)
    return library


def load(spec: Spec, wait_s: float) -> Built:
    """Load ``spec``'s library into this process, building it first where no finished build
    is there; ``BuildBusy`` when another live process builds it for more than ``wait_s`` s.
    Build errors come through as torch raises them."""
    import torch

    start = time.perf_counter()
    directory = build_directory(spec)
    library = _built_library(directory)
    if library is not None:
        torch.ops.load_library(str(library))
        return Built(directory, library, time.perf_counter() - start, compiled=False)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK, "a") as handle:
        if not _acquire(handle, wait_s):
            raise BuildBusy(f"another process is building the fused kernel in {directory}; "
                            f"waited {wait_s:g} s ({WAIT_VAR})")
        library = _built_library(directory)         # the build just waited for
        compiled = library is None
        if compiled:
            library = _compile(spec, directory)
        else:
            torch.ops.load_library(str(library))
    return Built(directory, library, time.perf_counter() - start, compiled)
