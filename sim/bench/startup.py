"""``python -m sim.bench.startup``: how long the ``hawk`` command line takes to start, beside a
bare interpreter, each in fresh processes.

Prints the median wall time over ``--runs`` fresh processes of

- ``python -c pass``: the interpreter alone (its own start-up and ``site``);
- ``import numpy.random, simpy``: the libraries no simulation starts without, from the spawn
  to the end of those imports: the floor for the first event;
- ``python -m sim.commands.main --help``: spawn to exit (target ``HELP_TARGET_S``);
- ``hawk simulate`` up to its first simulated event, from the spawn (the probe of
  ``sim.bench.speed.STARTUP_SCRIPT``; target ``FIRST_EVENT_TARGET_S``);

and each one's ratio to the bare interpreter, the figure that moves least with the machine's
load. The kinds are interleaved run by run, so a slow spell hits each alike.

Modules are read from cached bytecode, as an installed package's are: the runs share a scratch
``PYTHONPYCACHEPREFIX``, filled by one round of runs that is not counted. ``--from-source``
compiles every module in every run instead (no bytecode written), what a checkout run with
``PYTHONDONTWRITEBYTECODE`` pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sim.bench.speed import startup_probe

HELP_TARGET_S = 0.3
FIRST_EVENT_TARGET_S = 0.25
KINDS = ("bare", "floor", "help", "first_event")
FLOOR = "import numpy.random, simpy"
FLOOR_SCRIPT = FLOOR + "\nimport time\nprint(time.time())"


def _exit_wall_s(args: list[str], env: dict) -> float:
    """Wall seconds from spawning ``python ARGS`` to its exit (it must succeed)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return wall


def _floor_s(env: dict) -> float:
    """Wall seconds from spawning ``python -c FLOOR_SCRIPT`` to the end of its imports."""
    spawned_at = time.time()
    done = subprocess.run([sys.executable, "-c", FLOOR_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{FLOOR} failed (exit {done.returncode}): {done.stderr[-500:]}")
    return float(done.stdout) - spawned_at


def one_round(env: dict) -> dict[str, float]:
    """One fresh process of each kind: its wall seconds."""
    return {"bare": _exit_wall_s(["-c", "pass"], env),
            "floor": _floor_s(env),
            "help": _exit_wall_s(["-m", "sim.commands.main", "--help"], env),
            "first_event": startup_probe(env)[2]}


def measure(runs: int = 10, from_source: bool = False) -> dict:
    """The medians of ``runs`` rounds, their ratios to the bare interpreter, the targets."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hawk-pycache-") as cache:
        if from_source:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = cache
            one_round(env)                  # fills the cache; not counted
        rounds = [one_round(env) for _ in range(runs)]
    report = {"runs": runs, "bytecode": "compiled from source" if from_source else "cached",
              "python": sys.version.split()[0]}
    for kind in KINDS:
        values = [r[kind] for r in rounds]
        report[f"{kind}_s"] = statistics.median(values)
        report[f"{kind}_range_s"] = [min(values), max(values)]
    for kind in KINDS[1:]:
        report[f"{kind}_per_bare"] = report[f"{kind}_s"] / report["bare_s"]
    report.update(help_target_s=HELP_TARGET_S, first_event_target_s=FIRST_EVENT_TARGET_S)
    return report


def format_report(r: dict) -> str:
    rows = (("python -c pass", "bare", ""),
            (FLOOR, "floor", "(no simulation starts faster)"),
            ("hawk --help", "help", f"target < {HELP_TARGET_S:g} s"),
            ("hawk simulate to first event", "first_event",
             f"target < {FIRST_EVENT_TARGET_S:g} s"))
    lines = [f"start-up, median of {r['runs']} fresh processes (Python {r['python']}, "
             f"bytecode {r['bytecode']}):",
             f"  {'':30} {'wall s':>8} {'range s':>15} {'x bare':>7}"]
    for label, kind, target in rows:
        low, high = r[f"{kind}_range_s"]
        ratio = f"{r[f'{kind}_per_bare']:.2f}" if kind != "bare" else "1"
        lines.append(f"  {label:30} {r[f'{kind}_s']:>8.3f} {low:>7.3f}-{high:<7.3f} "
                     f"{ratio:>7}  {target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="fresh processes of each kind (default 10)")
    p.add_argument("--from-source", action="store_true",
                   help="compile every module in every run (no bytecode cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    report = measure(args.runs, args.from_source)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
