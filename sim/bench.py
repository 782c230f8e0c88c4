"""``hawk bench``: how fast the simulator runs, against bare SimPy measured in the same run.

Prints simulated requests per wall-second for a Chatbot run near the knee, the event rate of a
bare SimPy loop of plain timeouts (the ceiling for any SimPy model on this machine), their ratio
(simulated requests per bare event), and the wall-time ratio when every output is 10x longer
(fast-forward keeps events per request O(1), so it should stay well under 2x), and the
start-up of ``hawk simulate``: a fresh interpreter's seconds up to its first simulated event
(imports, config, trace; ``startup_s`` in CPU seconds, ``startup_wall_s`` on the clock). Each
figure is the best of a few interleaved runs, timed in CPU seconds.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import simpy

from sim.cluster import simulate
from sim.config import RunConfig
from sim.sweep import summarize_sweep, sweep
from traces.trace import Trace
from traces.workloads import make_workload


def bare_event_rate(num_events: int = 400_000) -> float:
    """Timeouts per wall-second of a SimPy process that only yields plain timeouts."""
    env = simpy.Environment()

    def loop(env):
        for _ in range(num_events):
            yield env.timeout(1.0)

    env.process(loop(env))
    start = time.process_time()
    env.run()
    return num_events / (time.process_time() - start)


# Run by a fresh interpreter: ``hawk simulate`` up to its first event, then the seconds since
# the interpreter started (CPU) and since this script started (wall, imports onward).
STARTUP_SCRIPT = """
import time
wall = time.perf_counter()
import simpy

class FirstEvent(Exception):
    pass

def first_step(env):
    raise FirstEvent

simpy.Environment.step = first_step
from sim.cli import main
try:
    main(["simulate", "--num-requests", "10", "--json"])
except FirstEvent:
    print(time.process_time(), time.perf_counter() - wall)
"""
STARTUP_TARGET_S = 0.5


def startup_seconds(timeout_s: float = 120.0) -> tuple[float, float]:
    """``(cpu_s, wall_s)`` a fresh ``hawk simulate`` spends before its first simulated event:
    CPU seconds since the interpreter started, wall seconds since its first import."""
    done = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], capture_output=True,
                          text=True, timeout=timeout_s)
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 2:
        raise RuntimeError(f"start-up probe failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return float(fields[0]), float(fields[1])


def find_knee(config: RunConfig, num_requests: int = 2000) -> float:
    """A quick knee estimate on a coarse grid (in this process)."""
    small = config.replace(**{"workload.num_requests": num_requests})
    rates = [round(0.1 * k, 2) for k in range(1, 31)]
    summary = summarize_sweep(sweep(small, rates, workers=1, progress=False))
    return summary["knee_rate"]


def _timed(config: RunConfig, trace: Trace) -> tuple[float, dict]:
    start = time.process_time()
    result = simulate(config, trace)
    return time.process_time() - start, result.summary


def run(num_requests: int = 100_000, rate: float | None = None, seed: int = 0,
        repeats: int = 3) -> dict:
    """Each figure is the best of ``repeats`` interleaved runs (CPU time of this process), so
    a noisy machine slows neither side of a ratio more than the other."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    config = RunConfig(seed=seed)
    rate = rate if rate is not None else find_knee(config)
    trace = make_workload("chatbot", rate, num_requests, seed=seed)
    long_trace = Trace(trace.arrival_at, trace.num_prompt_tokens, trace.num_output_tokens * 10,
                       trace.request_id, name="chatbot-10x-output")
    bare, wall, long_wall = 0.0, math.inf, math.inf
    startup, startup_wall = math.inf, math.inf
    for _ in range(repeats):
        cpu_s, wall_s = startup_seconds()
        startup, startup_wall = min(startup, cpu_s), min(startup_wall, wall_s)
        bare = max(bare, bare_event_rate())
        w, summary = _timed(config, trace)
        wall = min(wall, w)
        w, long_summary = _timed(config, long_trace)
        long_wall = min(long_wall, w)
    sim_rate = num_requests / wall
    return {
        "num_requests": num_requests,
        "rate": rate,
        "repeats": repeats,
        "slo_attainment": summary["slo_attainment"],
        "wall_s": wall,
        "simulated_requests_per_s": sim_rate,
        "bare_simpy_events_per_s": bare,
        "requests_per_bare_event": sim_rate / bare,
        "long_output_wall_s": long_wall,
        "long_output_wall_ratio": long_wall / wall,
        "long_output_slo_attainment": long_summary["slo_attainment"],
        "startup_s": startup,
        "startup_wall_s": startup_wall,
    }


def format_report(r: dict) -> str:
    return "\n".join([
        f"Chatbot, {r['num_requests']:,} requests at {r['rate']:g} req/s "
        f"(SLO attainment {100 * r['slo_attainment']:.1f}%); best of {r['repeats']} "
        f"interleaved runs, CPU time",
        f"  simulated requests/s     {r['simulated_requests_per_s']:>12,.0f}   "
        f"({r['wall_s']:.2f} s wall)",
        f"  bare SimPy events/s      {r['bare_simpy_events_per_s']:>12,.0f}",
        f"  requests per bare event  {r['requests_per_bare_event']:>12.4f}   (target >= 0.05)",
        f"  10x longer outputs       {r['long_output_wall_ratio']:>12.2f}x wall "
        f"({r['long_output_wall_s']:.2f} s; target < 2x)",
        f"  start-up to first event  {r['startup_s']:>12.3f} s CPU "
        f"({r['startup_wall_s']:.3f} s wall; target < {STARTUP_TARGET_S:g} s)",
    ])
