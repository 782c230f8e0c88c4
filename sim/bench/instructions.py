"""Instructions per simulated request, counted by Valgrind's callgrind: a deterministic
measure of the simulator's speed, for comparing two versions on a busy machine where wall
times are noise. ``hawk bench``'s requests per bare SimPy event is the wall-clock goal; this
counts the same two things in instructions:

- the marginal cost of one simulated request: ``simulate()`` of ``large`` and of ``small``
  Chatbot requests at ``rate`` (default: 15,000 and 5,000 at 0.6 req/s, near the default
  scenario's knee), their difference over ``large - small`` (start-up and imports cancel);
- the marginal cost of one bare SimPy timeout event, the same way;

and their ratio. A bare event runs at more instructions per cycle than a simulated request
(fewer cache misses and mispredicted branches), so the ratio here is higher than the wall
clock's: about 1.5x on the machine it was written on.

    python -m sim.bench.instructions [--kind 1x|10x] [--rate R] [--json]

``10x``: every output 10x longer at the same arrival rate (``hawk bench``'s overloaded run).
Needs ``valgrind`` on the PATH; each count runs the interpreter under it (about 1.5 min).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

#: run by ``python -c`` under callgrind: ``kind n [rate]``
RUN = """
import sys
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "bare":
    import simpy
    env = simpy.Environment()
    def loop(env):
        for _ in range(n):
            yield env.timeout(1.0)
    env.process(loop(env))
    env.run()
else:
    from sim.bench.speed import _longer_outputs
    from sim.engine.cluster import simulate
    from sim.config import RunConfig
    from traces.workloads import make_workload
    rate = float(sys.argv[3])
    trace = (make_workload("chatbot", rate, n, seed=0) if kind == "1x"
             else _longer_outputs(rate, n, 0))
    simulate(RunConfig(seed=0), trace)
"""


class ValgrindMissing(RuntimeError):
    """No ``valgrind`` on the PATH."""


def instructions(*args: str) -> int:
    """Instructions a fresh interpreter runs for ``RUN`` with ``args`` (callgrind's Ir)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise ValgrindMissing("valgrind is not on the PATH (Debian: apt install valgrind)")
    env = {**os.environ, "PYTHONHASHSEED": "0"}      # string hashing: the same work each run
    done = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null",
                           sys.executable, "-c", RUN, *args], capture_output=True, text=True,
                          env=env)
    found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind run {args} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return int(found.group(1))


def measure(kind: str = "1x", rate: float = 0.6, small: int = 5000, large: int = 15000,
            events: tuple[int, int] = (50_000, 150_000)) -> dict:
    """Instructions per simulated request and per bare event, and their ratio."""
    if kind not in ("1x", "10x"):
        raise ValueError(f"kind must be 1x or 10x, got {kind!r}")
    if not 0 < small < large:
        raise ValueError(f"need 0 < small < large, got {small}, {large}")
    per_request = (instructions(kind, str(large), f"{rate:g}")
                   - instructions(kind, str(small), f"{rate:g}")) / (large - small)
    per_event = (instructions("bare", str(events[1]))
                 - instructions("bare", str(events[0]))) / (events[1] - events[0])
    return {"kind": kind, "rate": rate, "requests": [small, large],
            "instructions_per_request": per_request, "instructions_per_bare_event": per_event,
            "requests_per_bare_event": per_event / per_request}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.instructions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("1x", "10x"), default="1x")
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        r = measure(args.kind, args.rate)
    except ValgrindMissing as exc:
        print(f"sim.bench.instructions: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['kind']} at {r['rate']:g} req/s: {r['instructions_per_request']:,.0f} "
              f"instructions per simulated request, {r['instructions_per_bare_event']:,.0f} "
              f"per bare SimPy event: {r['requests_per_bare_event']:.4f} requests per bare "
              f"event in instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
