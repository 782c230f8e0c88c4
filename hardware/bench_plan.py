"""What ``hawk real transfer-bench`` will do, before it starts: its steps, the bytes each moves,
its wall time and peak memory on this machine; and the progress counter that counts those
bytes as they move.

Per size the benchmark starts a prefill process, then runs these steps, each a number of
whole moves of the request's KV bytes: the raw socket, the pulls without and with MACs
(``repeats + 1`` each: the first one warms up) and every chosen mechanism (``repeats``). The
wall time is each move's bytes times its measured cost (``SECONDS_PER_GB``), plus the prefill
process's start per size. A run estimated past ``--max-wall-s`` is refused, naming the
estimate and the flag.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

MIB = 1 << 20
#: wall seconds per GB (1e9 B) of one move of each step, from the decode side's start of the
#: step to its end (receive buffers allocated and registered, the prefill side's staging or
#: transformation, the transfer, the MAC check, the re-layout), measured on this machine (2
#: cores shared with other work, load average 4.3 to 7.7) with ``hawk real transfer-bench
#: --sizes 640 --repeats 1`` (0.67 GB a move; 172 s in all) and rounded up: raw socket 2.5 s
#: for 2 moves, pulls without MACs 11.4 s for 2, with MACs 7.8 s for 2, GG-Host 16.0 s,
#: GN-Host 51.3 s, GG-Direct 11.1 s, GN-Direct 51.7 s, GN-HAWK 5.4 s
SECONDS_PER_GB = {"raw socket": 2.0, "pulls without MACs": 9.0, "pulls with MACs": 6.0,
                  "GG-Host": 24.0, "GN-Host": 77.0, "GG-Direct": 17.0, "GN-Direct": 78.0,
                  "GN-HAWK": 9.0}
#: wall seconds to start one prefill process (import torch, build and transform the seeded
#: cache, warm up the layout kernel): 10 to 14.5 s in the same measurements
START_S = 15.0
#: past this estimate the command says so on stderr before it starts
ANNOUNCE_AFTER_S = 5.0
#: past this estimate the command refuses, unless --max-wall-s allows it
DEFAULT_MAX_WALL_S = 3600.0
#: bytes held across both processes per byte of KV, about: the prefill side's paged cache, its
#: transformed copy, its send buffer and the plain payload; the decode side's read target,
#: its mechanism's receive buffers and its rebuilt copy
MEMORY_FACTOR = 8
#: a move may take this many times its estimate before its wait gives up (load, a slow
#: first use), and never less than ``MIN_WAIT_S``
WAIT_SLACK = 10.0
MIN_WAIT_S = 60.0
PLAIN_STEPS = ("raw socket", "pulls without MACs", "pulls with MACs")


@dataclass(frozen=True)
class Step:
    size_mb: float
    what: str                   # a key of SECONDS_PER_GB
    moves: int

    @property
    def label(self) -> str:
        return f"{self.size_mb:g} MB {self.what}"

    @property
    def mb(self) -> float:
        return self.size_mb * self.moves

    @property
    def wall_s(self) -> float:
        return self.moves * self.size_mb * MIB / 1e9 * SECONDS_PER_GB[self.what]


def steps(sizes_mb, mechanisms, repeats: int) -> list[Step]:
    """Every step of the run, in the order it runs them."""
    return [Step(s, what, repeats + 1 if what in PLAIN_STEPS else repeats)
            for s in sizes_mb for what in (*PLAIN_STEPS, *mechanisms)]


def wall_s(sizes_mb, mechanisms, repeats: int) -> float:
    return len(sizes_mb) * START_S + sum(s.wall_s for s in steps(sizes_mb, mechanisms, repeats))


def peak_bytes(sizes_mb) -> float:
    return MEMORY_FACTOR * max(sizes_mb) * MIB


def wait_s(size_mb: float, what: str = "GN-Host") -> float:
    """How long one move of ``size_mb`` may take before its wait fails (a bound, not a
    guess): ``WAIT_SLACK`` times its estimate, at least ``MIN_WAIT_S``."""
    return max(MIN_WAIT_S, WAIT_SLACK * Step(size_mb, what, 1).wall_s)


def _duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``1.5 h``: a rough duration."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.0f} s"


def estimate_line(sizes_mb, mechanisms, repeats: int) -> str:
    """``hawk real transfer-bench: 3 sizes x 5 mechanisms x 3 repeats, 16,230 MB moved,
    ~9 min on this machine, ~5.4 GB peak``."""
    todo = steps(sizes_mb, mechanisms, repeats)
    return (f"hawk real transfer-bench: {len(sizes_mb)} size{'s' * (len(sizes_mb) > 1)} x "
            f"{len(mechanisms)} mechanism{'s' * (len(mechanisms) > 1)} x {repeats} "
            f"repeat{'s' * (repeats > 1)}, {sum(s.mb for s in todo):,.0f} MB moved, "
            f"~{_duration(wall_s(sizes_mb, mechanisms, repeats))} on this machine, "
            f"~{peak_bytes(sizes_mb) / 1e9:.1f} GB peak")


class BenchFailed(Exception):
    """The benchmark could not run (bad input, a prefill process failing or not starting,
    a wait past its bound)."""


class TooLong(BenchFailed):
    """The run's estimate is past the wall-time limit."""


def check_memory(sizes_mb, available: int | None = None) -> None:
    """Refuse sizes whose run would not fit this machine's available memory."""
    if available is None:
        available = _available_bytes()
    need = peak_bytes(sizes_mb)
    if available is not None and need > available:
        raise BenchFailed(f"size {max(sizes_mb):g} MB needs about {need / 1e9:.1f} GB "
                          f"({MEMORY_FACTOR}x the KV size across both processes), but "
                          f"{available / 1e9:.1f} GB are available")


def _available_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check(sizes_mb, mechanisms, repeats: int, max_wall_s: float | None) -> float:
    """The run's estimated wall seconds; ``TooLong`` naming the estimate and ``--max-wall-s``
    past ``max_wall_s`` (None: no limit)."""
    wall = wall_s(sizes_mb, mechanisms, repeats)
    if max_wall_s is not None and wall > max_wall_s:
        raise TooLong(f"{estimate_line(sizes_mb, mechanisms, repeats)}: past the "
                      f"{_duration(max_wall_s)} limit; bench smaller --sizes or fewer "
                      f"--mechanisms/--repeats, or allow it with --max-wall-s "
                      f"{wall * 1.5:.0f}")
    return wall


class Progress:
    """MB moved so far out of the run's total, on stderr (tqdm when installed, plain lines
    otherwise). ``begin(step)`` names the step now running; ``moved(mb)`` counts one move as
    it ends; ``close()`` ends the bar. The count reaches the total only when the last move
    has ended, and the step shown is the one running, so a bar near its end with a large
    size showing still has that size's work left."""

    def __init__(self, todo: list[Step]) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.total = sum(s.mb for s in todo)
        self.done, self.step = 0.0, None
        self.bar = tqdm(total=round(self.total), desc="transfer-bench", unit="MB",
                        file=sys.stderr) if tqdm else None

    def begin(self, step: Step) -> None:
        self.step = step
        if self.bar is not None:
            self.bar.set_postfix_str(step.label)
        else:
            print(f"transfer-bench [{self.done:,.0f}/{self.total:,.0f} MB moved] {step.label}",
                  file=sys.stderr, flush=True)

    def moved(self) -> None:
        """One move of the running step's size has ended."""
        self.done += self.step.size_mb
        if self.bar is not None:
            self.bar.update(round(self.done) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"transfer-bench [{self.done:,.0f}/{self.total:,.0f} MB moved]",
                  file=sys.stderr, flush=True)
