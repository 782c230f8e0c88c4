"""``hawk bench``: how fast the simulator runs, against bare SimPy measured in the same run.

Prints simulated requests per wall-second for a Chatbot run near the knee, the event rate of a
bare SimPy loop of plain timeouts (the ceiling for any SimPy model on this machine), their ratio
(simulated requests per bare event), and the wall-time ratio when every output is 10x longer
(fast-forward keeps events per request O(1), so it should stay well under 2x).
"""

from __future__ import annotations

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
    start = time.perf_counter()
    env.run()
    return num_events / (time.perf_counter() - start)


def find_knee(config: RunConfig, num_requests: int = 2000) -> float:
    """A quick knee estimate on a coarse grid (in this process)."""
    small = config.replace(**{"workload.num_requests": num_requests})
    rates = [round(0.1 * k, 2) for k in range(1, 31)]
    summary = summarize_sweep(sweep(small, rates, workers=1, progress=False))
    return summary["knee_rate"]


def _timed(config: RunConfig, trace: Trace) -> tuple[float, dict]:
    start = time.perf_counter()
    result = simulate(config, trace)
    return time.perf_counter() - start, result.summary


def run(num_requests: int = 100_000, rate: float | None = None, seed: int = 0) -> dict:
    config = RunConfig(seed=seed)
    rate = rate if rate is not None else find_knee(config)
    trace = make_workload("chatbot", rate, num_requests, seed=seed)
    long_trace = Trace(trace.arrival_at, trace.num_prompt_tokens, trace.num_output_tokens * 10,
                       trace.request_id, name="chatbot-10x-output")
    bare_before = bare_event_rate()
    wall, summary = _timed(config, trace)
    bare_after = bare_event_rate()
    long_wall, long_summary = _timed(config, long_trace)
    bare = (bare_before + bare_after) / 2
    sim_rate = num_requests / wall
    return {
        "num_requests": num_requests,
        "rate": rate,
        "slo_attainment": summary["slo_attainment"],
        "wall_s": wall,
        "simulated_requests_per_s": sim_rate,
        "bare_simpy_events_per_s": bare,
        "requests_per_bare_event": sim_rate / bare,
        "long_output_wall_s": long_wall,
        "long_output_wall_ratio": long_wall / wall,
        "long_output_slo_attainment": long_summary["slo_attainment"],
    }


def format_report(r: dict) -> str:
    return "\n".join([
        f"Chatbot, {r['num_requests']:,} requests at {r['rate']:g} req/s "
        f"(SLO attainment {100 * r['slo_attainment']:.1f}%)",
        f"  simulated requests/s     {r['simulated_requests_per_s']:>12,.0f}   "
        f"({r['wall_s']:.2f} s wall)",
        f"  bare SimPy events/s      {r['bare_simpy_events_per_s']:>12,.0f}",
        f"  requests per bare event  {r['requests_per_bare_event']:>12.4f}   (target >= 0.05)",
        f"  10x longer outputs       {r['long_output_wall_ratio']:>12.2f}x wall "
        f"({r['long_output_wall_s']:.2f} s; target < 2x)",
    ])
