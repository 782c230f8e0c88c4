"""``hawk bench``: how fast the simulator runs, against bare SimPy measured in the same run.

Prints, for a Chatbot run near the knee:

- simulated requests per wall-second, the event rate of a bare SimPy loop of plain timeouts
  (the ceiling for any SimPy model on this machine) and their ratio, simulated requests per
  bare event (target ``REQUESTS_PER_EVENT_TARGET``), with the decode instances' timer
  firings per request (``sim.engine.timers``: one per run that ends at a finish or a preemption);
- the wall-time ratio when every output is 10x longer (target ``LONG_OUTPUT_RATIO_TARGET``),
  twice: at the same offered load (arrivals at 1/10 the rate, the same output tokens per
  second, the like-for-like case: fast-forward keeps events per request O(1)) and at the
  same arrival rate. The latter is 10x the decode demand of a run at the knee: the queue
  grows without bound and the full KV pool preempts and restores requests over and over
  (``num_preemptions_per_request``), so its cost is per preemption, not per output token;
- for an aggregated cluster of one instance and of two (as many devices as the P/D
  cluster; ``aggregated_case``): requests per bare event at the same rate, the CPU per
  request against the P/D run of the same trace timed beside it (target
  ``AGGREGATED_VS_DISAGGREGATED_TARGET``), and with 10x outputs at equal offered load, the
  CPU ratio per request (target ``LONG_OUTPUT_RATIO_TARGET``) and per output token;
- the start-up of ``hawk simulate``: a fresh interpreter's seconds up to its first simulated
  event (imports, config, trace; ``startup_s`` in CPU seconds, ``startup_wall_s`` on the
  clock; target ``STARTUP_TARGET_S``);
- the peak resident memory of a fresh ``hawk simulate`` of ``memory_requests`` (10^6)
  requests, in memory (records as one table) and streamed (``--stream``, ``sim.engine.stream``).

Each timing is the best of a few interleaved runs, timed in CPU seconds; the headline
figures are ratios of those bests. Each repeat's own ratios (``per_repeat``; printed as a
range) show how much the machine moved them: on a shared machine the bare loop alone can vary
by a third between runs minutes apart. A repeat pairs its 1x run with the bare loop timed just
before and just after it (their geometric mean), and ``requests_per_bare_event_paired_median``
is the median of those pairs: a figure that slow drifts of the machine's speed move less.
"""

from __future__ import annotations

import math
import platform
import statistics
import subprocess
import sys
import time

import simpy

from sim.bench.speed_report import (AGGREGATED_VS_DISAGGREGATED_TARGET,  # noqa: F401
                                    LONG_OUTPUT_RATIO_TARGET, REQUESTS_PER_EVENT_TARGET,
                                    STARTUP_TARGET_S, format_report, missed_targets,
                                    target_checks)
from sim.engine.cluster import simulate
from sim.config import RunConfig
from sim.runs.sweep import summarize_sweep, sweep
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
# the interpreter started (CPU), since this script started (wall, imports onward) and the
# instant of the event (``time.time()``: the parent's clock too, for the wall time from spawn).
STARTUP_SCRIPT = """
import time
wall = time.perf_counter()
import simpy

class FirstEvent(Exception):
    pass

def first_step(env):
    raise FirstEvent

simpy.Environment.step = first_step
from sim.commands.main import main
try:
    main(["simulate", "--num-requests", "10", "--json"])
except FirstEvent:
    print(time.process_time(), time.perf_counter() - wall, time.time())
"""


def startup_seconds(timeout_s: float = 120.0) -> tuple[float, float]:
    """``(cpu_s, wall_s)`` a fresh ``hawk simulate`` spends before its first simulated event:
    CPU seconds since the interpreter started, wall seconds since its first import."""
    cpu_s, wall_s, _ = startup_probe(timeout_s=timeout_s)
    return cpu_s, wall_s


def startup_probe(env: dict | None = None, timeout_s: float = 120.0) -> tuple[float, float, float]:
    """``startup_seconds``, and the wall seconds from spawning the fresh interpreter (in
    environment ``env``) to its first simulated event."""
    spawned_at = time.time()
    done = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 3:
        raise RuntimeError(f"start-up probe failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return float(fields[0]), float(fields[1]), float(fields[2]) - spawned_at


# Run by a fresh interpreter: ``hawk simulate`` with the given arguments, then its peak
# resident memory in kilobytes as the last line (``sim.bench.speed.own_peak_rss_kb``).
MEMORY_SCRIPT = """
import sys
from sim.commands.main import main
code = main(sys.argv[1:])
from sim.bench.speed import own_peak_rss_kb
print(own_peak_rss_kb())
sys.exit(code)
"""


def own_peak_rss_kb() -> int:
    """This process's peak resident memory in kilobytes, since it last exec'd.

    Linux keeps ``getrusage``'s ``ru_maxrss`` across ``fork`` and ``exec``: a probe started
    by a large process (``hawk bench`` holding its runs' records) would report that process's
    resident set, not its own. The memory map's high-water mark (``VmHWM`` in
    ``/proc/self/status``) starts afresh at ``exec``; ``ru_maxrss`` only where there is no
    ``/proc`` (macOS reports it in bytes)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def peak_memory_mb(num_requests: int, rate: float, stream: bool, seed: int = 0,
                   timeout_s: float = 1800.0) -> float:
    """Peak resident MB of a fresh ``hawk simulate --num-requests N --rate R``, streamed or
    in memory."""
    args = ["simulate", "--num-requests", str(num_requests), "--rate", f"{rate:g}",
            "--seed", str(seed), "--json", "--stream" if stream else "--no-stream"]
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, *args], capture_output=True,
                          text=True, timeout=timeout_s)
    lines = done.stdout.split()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"memory probe failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return int(lines[-1]) / 1024


#: the coarse grid of the benchmark's default rate, req/s: 0.1 to 3.0
DEFAULT_RATE_GRID = tuple(round(0.1 * k, 2) for k in range(1, 31))


def default_rate(config: RunConfig, num_requests: int = 2000) -> float:
    """The rate the benchmark runs at unless given one: the knee of a sweep over
    ``DEFAULT_RATE_GRID`` (``traces.metrics.knee``, by ``summarize_sweep``; in this process).
    A grid, not a bisection, so the benchmark's load stays a round rate."""
    small = config.replace(**{"workload.num_requests": num_requests})
    summary = summarize_sweep(sweep(small, list(DEFAULT_RATE_GRID), workers=1, progress=False))
    return summary["knee_rate"]


def _timed(config: RunConfig, trace: Trace):
    start = time.process_time()
    result = simulate(config, trace)
    return time.process_time() - start, result


def _longer_outputs(rate: float, num_requests: int, seed: int) -> Trace:
    trace = make_workload("chatbot", rate, num_requests, seed=seed)
    return Trace(trace.arrival_at, trace.num_prompt_tokens, trace.num_output_tokens * 10,
                 trace.request_id, name="chatbot-10x-output")


def run(num_requests: int = 100_000, rate: float | None = None, seed: int = 0,
        repeats: int = 3, memory_requests: int = 1_000_000) -> dict:
    """Each timing is the best of ``repeats`` interleaved runs (CPU time of this process), so
    a noisy machine slows neither side of a ratio more than the other. ``memory_requests``
    0 skips the memory probes."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if memory_requests < 0:
        raise ValueError(f"memory_requests must be >= 0, got {memory_requests}")
    config = RunConfig(seed=seed)
    rate = rate if rate is not None else default_rate(config)
    trace = make_workload("chatbot", rate, num_requests, seed=seed)
    runs = {"1x": trace,                                                 # at the knee
            "10x": _longer_outputs(rate / 10, num_requests, seed),       # same offered load
            "10x_same_rate": _longer_outputs(rate, num_requests, seed)}  # 10x the demand
    simulate(config, make_workload("chatbot", rate, 200, seed=seed))   # imports, e.g. pandas
    walls = dict.fromkeys(runs, math.inf)
    results: dict = {}
    bare, startup, startup_wall = 0.0, math.inf, math.inf
    per_repeat: dict[str, list[float]] = {"requests_per_bare_event": [],
                                          "long_output_wall_ratio": [],
                                          "long_output_same_rate_wall_ratio": []}
    for _ in range(repeats):
        cpu_s, wall_s = startup_seconds()
        startup, startup_wall = min(startup, cpu_s), min(startup_wall, wall_s)
        bare_before = bare_event_rate()
        bare = max(bare, bare_before)
        now: dict[str, float] = {}
        for name, t in runs.items():
            now[name], results[name] = _timed(config, t)
            walls[name] = min(walls[name], now[name])
            if name == "1x":            # the bare loop again: the run's pair is both sides of it
                bare_now = math.sqrt(bare_before * bare_event_rate())
        per_repeat["requests_per_bare_event"].append(num_requests / now["1x"] / bare_now)
        per_repeat["long_output_wall_ratio"].append(now["10x"] / now["1x"])
        per_repeat["long_output_same_rate_wall_ratio"].append(now["10x_same_rate"] / now["1x"])
    sim_rate = num_requests / walls["1x"]

    def per_request(name: str, key: str) -> float:
        return sum(results[name].stats[key]) / num_requests

    report = {
        "num_requests": num_requests,
        # both sides of every ratio run on this interpreter, and their ratio depends on it:
        # on one machine, Python 3.12 ran the bare loop about 25% slower than 3.11 and a
        # simulated request about 10% slower
        "python": platform.python_version(),
        "simpy": simpy.__version__,
        "rate": rate,
        "repeats": repeats,
        "slo_attainment": results["1x"].summary["slo_attainment"],
        "wall_s": walls["1x"],
        "simulated_requests_per_s": sim_rate,
        "bare_simpy_events_per_s": bare,
        "requests_per_bare_event": sim_rate / bare,
        "requests_per_bare_event_target": REQUESTS_PER_EVENT_TARGET,
        # the median of each repeat's 1x run over the bare loop timed on both sides of it
        "requests_per_bare_event_paired_median": statistics.median(
            per_repeat["requests_per_bare_event"]),
        "decode_wakeups_per_request": per_request("1x", "decode_wakeups"),
        "long_output_rate": rate / 10,
        "long_output_wall_s": walls["10x"],
        "long_output_wall_ratio": walls["10x"] / walls["1x"],
        "long_output_slo_attainment": results["10x"].summary["slo_attainment"],
        "long_output_preemptions_per_request": per_request("10x", "decode_preemptions"),
        "long_output_same_rate_wall_s": walls["10x_same_rate"],
        "long_output_same_rate_wall_ratio": walls["10x_same_rate"] / walls["1x"],
        "long_output_same_rate_slo_attainment":
            results["10x_same_rate"].summary["slo_attainment"],
        "long_output_same_rate_preemptions_per_request":
            per_request("10x_same_rate", "decode_preemptions"),
        "long_output_ratio_target": LONG_OUTPUT_RATIO_TARGET,
        "startup_s": startup,
        "startup_wall_s": startup_wall,
        "startup_target_s": STARTUP_TARGET_S,
        "memory_requests": memory_requests,
        # each repeat's own figures (its bare loop, its runs): how much the machine moved them
        "per_repeat": per_repeat,
    }
    report["aggregated"] = [aggregated_case(rate, num_requests, seed, repeats, k)
                            for k in (1, 2)]
    if memory_requests:
        report["peak_rss_mb"] = peak_memory_mb(memory_requests, rate, stream=False, seed=seed)
        report["peak_rss_mb_streamed"] = peak_memory_mb(memory_requests, rate, stream=True,
                                                        seed=seed)
    report["targets_missed"] = missed_targets(report)
    return report


def aggregated_config(seed: int = 0, num_instances: int = 1) -> RunConfig:
    """The aggregated case: A100 TP4 instances, the default P/D cluster's prefill device
    (one instance: one router domain of one instance, as the P/D cluster has one per phase;
    two: as many devices as the P/D cluster)."""
    from sim.config import from_dict

    return from_dict({"seed": seed, "cluster": {
        "kind": "aggregated", "aggregated": {"num_instances": num_instances}}})


def aggregated_case(rate: float, num_requests: int, seed: int, repeats: int,
                    num_instances: int = 1) -> dict:
    """An aggregated Chatbot run at ``rate`` (the P/D run's): its requests per bare event,
    its CPU per request against the P/D run of the same trace (the default cluster, timed
    beside it in every repeat: ``per_request_vs_disaggregated``, target
    ``AGGREGATED_VS_DISAGGREGATED_TARGET``), and the same requests with 10x outputs at 1/10
    the rate (the same output tokens per second, the simulated span 10x as long): the
    CPU ratio per request (``long_output_wall_ratio``, target ``LONG_OUTPUT_RATIO_TARGET``)
    and per output token simulated (``long_output_per_token_ratio``; about a tenth of the
    former: fast-forward prices a run of decodes at once, whatever its length). Best of
    ``repeats``, each beside its own bare loop; ``per_repeat``: each repeat's own ratios."""
    config = aggregated_config(seed, num_instances)
    trace = make_workload("chatbot", rate, num_requests, seed=seed)
    runs = {"1x": (config, trace),
            "10x": (config, _longer_outputs(rate / 10, num_requests, seed)),
            "disaggregated": (RunConfig(seed=seed), trace)}
    simulate(config, make_workload("chatbot", rate, 200, seed=seed))   # imports, e.g. pandas
    walls = dict.fromkeys(runs, math.inf)
    results: dict = {}
    bare = 0.0
    per_repeat: dict[str, list[float]] = {"per_request_vs_disaggregated": [],
                                          "long_output_wall_ratio": []}
    for _ in range(repeats):
        bare = max(bare, bare_event_rate())
        now: dict[str, float] = {}
        for name, (c, t) in runs.items():
            now[name], results[name] = _timed(c, t)
            walls[name] = min(walls[name], now[name])
        per_repeat["per_request_vs_disaggregated"].append(now["1x"] / now["disaggregated"])
        per_repeat["long_output_wall_ratio"].append(now["10x"] / now["1x"])

    def per_request(name: str, key: str) -> float:
        return sum(results[name].stats[key]) / num_requests

    tokens = {name: _output_tokens(results[name]) for name in ("1x", "10x")}
    return {
        "num_instances": num_instances,
        "requests_per_bare_event": num_requests / walls["1x"] / bare,
        "wall_s": walls["1x"],
        "slo_attainment": results["1x"].summary["slo_attainment"],
        "wakeups_per_request": per_request("1x", "aggregated_wakeups"),
        "preemptions_per_request": per_request("1x", "aggregated_preemptions"),
        "disaggregated_wall_s": walls["disaggregated"],
        "per_request_vs_disaggregated": walls["1x"] / walls["disaggregated"],
        "long_output_wall_s": walls["10x"],
        "long_output_wall_ratio": walls["10x"] / walls["1x"],
        "output_tokens": tokens["1x"],
        "long_output_output_tokens": tokens["10x"],
        "long_output_per_token_ratio": (walls["10x"] / max(tokens["10x"], 1))
                                       / (walls["1x"] / max(tokens["1x"], 1)),
        "long_output_wakeups_per_request": per_request("10x", "aggregated_wakeups"),
        "per_repeat": per_repeat,
    }


def _output_tokens(result) -> int:
    """Output tokens the run generated (its finished requests')."""
    rec = result.records
    return int(rec.loc[rec["status"] == "ok", "num_output_tokens"].sum())
