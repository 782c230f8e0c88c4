"""Capacity planning: the cheapest cluster, and the most power-efficient, that meet the SLOs.

``hawk plan --workload chatbot --rate 2`` searches two deployments together (``Space``,
``sim.runs.candidates``): disaggregated clusters (prefill and decode device kinds, TP degrees,
instance counts, decode batch sizes and transfer mechanisms: GPU prefill with NPU or GPU
decode) and aggregated ones (N instances of one device at one TP, GPU or NPU, each doing
both phases: ``sim.engine.aggregated``). It says which pays off (``sim.runs.verdict``). The
search is pruned before anything is simulated:

1. *Validity and memory*: a TP degree must divide the model's heads, the weights must fit the
   instance's devices (``sim.engine.cluster.kv_capacity_blocks``), the mechanism must join the two
   device kinds (GPU->GPU or GPU->NPU) and the config must resolve (``RunConfig``).
2. *Roofline bound*: one instance's best-case throughput in requests/s (``phase_capacity``:
   full prefill batches of the workload's mean prompt; a full decode batch, capped by KV
   memory, at the mean context). A phase needs ``ceil(rate * target / capacity)`` instances at
   least; fewer cannot keep up. That count and one more are tried (more only cost more). An
   aggregated instance does both phases' work: at best as fast as the slower phase alone,
   at worst as both one after the other (``aggregated_capacity``); from the count the best
   case needs up to the one the worst case needs (and one more), at most three counts.
3. *Cost bound*: each deployment's survivors are ordered by capital cost per second / rate, a
   lower bound on the cost per successful request; they are simulated cheapest first, and the
   search of a deployment stops once its next bound exceeds the cheapest cost found in it that
   meets the target (or after its share of ``max_candidates``: half for the aggregated ones,
   the rest for the disaggregated), so the verdict weighs each deployment's best.

Each simulated candidate gets its knee (the highest rate meeting the attainment target) by
bisection between the rates known to pass and to fail (the roofline bound above), not a grid
(``sim.runs.knee.bisect_knee``: geometric midpoints).
The Pareto frontier is over the simulated candidates: cost per successful request at the
asked rate vs goodput (the knee).

Cost per successful request is ``sim.models.cost``'s, the same figure as a run's summary: capital
(devices, hosts and NICs over the profile's amortisation period) per second x the run's span +
energy (the devices', the hosts' and the NICs') at the profile's price, over ok requests. The
inputs are the base profile's ``[cost]`` and ``[price]`` tables, with ``--catalog FILE`` laid over
``[cost]`` (``load_costs``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from sim.config import ConfigError, RunConfig, tomllib
from sim.models import cost
from sim.runs.candidates import (PREFERRED, Space, _mean_lengths,  # noqa: F401 (its API)
                                 aggregated_capacity, candidates, phase_capacity)
from sim.runs.plan_report import format_plan, plan_figure, plot_plan  # noqa: F401 (its API)
from sim.runs.verdict import (DEPLOYMENTS, best_by_deployment, binds, deployment_of, shape_of,
                              verdict)

BISECTION_STEPS = 5


def load_costs(path=None) -> dict:
    """A user's ``--catalog`` TOML: keys of a profile's ``[cost]`` table (``lifetime_years``,
    ``usd_per_kwh``, ``[host]``, ``[nic]`` ...) to lay over the base profile's, key by key
    (``cost_profile``), checked here against the paper profile's; no file, no overrides."""
    if path is None:
        return {}
    path = Path(path)
    try:
        overrides = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    cost_profile(RunConfig(), overrides, str(path))
    return overrides


def cost_profile(base: RunConfig, overrides: dict, where: str = "--catalog") -> dict:
    """The base config's profile tables with ``overrides`` laid over its ``[cost]`` table:
    what every candidate is priced under (``sim.models.cost``)."""
    from sim.models.predictor import load_profile_table

    try:
        return cost.with_overrides(load_profile_table(base.cluster.profile), overrides)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


# -- simulating a candidate ---------------------------------------------------------------

def _evaluate(job) -> dict:
    """Simulate ``config`` at the asked rate (module level, for process pools)."""
    from sim.engine.cluster import simulate

    config, bound, target, profile = job
    who = {"config": _describe(config), "changes": _changes(config),
           "deployment": deployment_of(config), "shape": shape_of(config)}
    try:
        run = simulate(config)
    except Exception as exc:               # one broken combination must not end the search;
        return {**who, "error": f"{type(exc).__name__}: {exc}",   # it is reported
                "meets_target": False, "knee_rate": None, "num_simulations": 1}
    s = run.summary
    stage, why = binds(s, run.stats)
    return {**who, "rate": config.workload.rate, "slo_attainment": s["slo_attainment"],
            "meets_target": s["slo_attainment"] >= target,
            "usd_per_success": cost.usd_per_success(s, config, profile),
            "capital_usd_per_hour": 3600 * cost.capital_usd_per_s(config, profile),
            "tokens_per_joule": s["tokens_per_joule"], "bottleneck": s.get("bottleneck"),
            "binds": stage, "binds_why": why,
            "roofline_rate": bound, "knee_rate": None, "num_simulations": 1}


def _knee(job) -> tuple[float, float, int, tuple | None]:
    """The knee of ``config`` by bisection (``sim.runs.knee.bisect_knee``): between the asked
    rate and 1.25x the roofline bound when it meets the target there, else between 0 and the
    asked rate; and what binds at the lowest rate found to miss (None if none was run)."""
    from sim.engine.cluster import simulate
    from sim.runs.knee import bisect_knee

    config, bound, target, meets_at_rate = job
    missed: dict = {}

    def meets(rate: float) -> bool:
        run = simulate(config.replace(**{"workload.rate": rate}))
        ok = run.summary["slo_attainment"] >= target
        if not ok and rate < missed.get("rate", math.inf):
            stage, why = binds(run.summary, run.stats)
            missed.update(rate=rate, binds=(stage, f"{why} at {rate:.3g} req/s"))
        return ok

    rate = config.workload.rate
    lo, hi = (rate, max(bound, rate) * 1.25) if meets_at_rate else (0.0, rate)
    return (*bisect_knee(meets, lo, hi, BISECTION_STEPS), BISECTION_STEPS,
            missed.get("binds"))


def _changes(config: RunConfig) -> dict:
    """The settings that make the candidate, to ``replace`` onto the base."""
    cl = config.cluster
    if cl.kind == "aggregated":
        a = cl.aggregated
        return {"cluster.kind": "aggregated", **{f"cluster.aggregated.{key}": getattr(a, key)
                for key in ("device", "tp", "num_instances", "max_batch_size", "kv_dtype")}}
    out = {}
    for role in ("prefill", "decode"):
        inst = getattr(cl, role)
        for key in ("device", "tp", "num_instances", "max_batch_size"):
            out[f"cluster.{role}.{key}"] = getattr(inst, key)
    out["cluster.link.mechanism"] = cl.link.mechanism
    return out


def _describe(config: RunConfig) -> str:
    cl = config.cluster
    if cl.kind == "aggregated":
        a = cl.aggregated
        return f"aggregated {a.num_instances}x({a.tp}x {a.device}, batch {a.max_batch_size})"
    p, d = cl.prefill, cl.decode
    return (f"{p.num_instances}x({p.tp}x {p.device}) -> {d.num_instances}x({d.tp}x {d.device},"
            f" batch {d.max_batch_size}) via {cl.link.mechanism}")


def plan(base: RunConfig, rate: float, target: float = 0.9, space: Space = Space(),
         costs: dict | None = None, workers: int | None = None, progress: bool = True,
         ray_address: str | None = None) -> dict:
    """Search, prune, simulate cheapest-bound first (each deployment on its own: the
    aggregated candidates take up to half of ``max_candidates``, the disaggregated ones the
    rest), bisect knees; the frontier, the picks and the verdict (``sim.runs.verdict``)."""
    from sim.runs.sweep import run_parallel

    profile = cost_profile(base, costs or {})
    capital = lambda config: cost.capital_usd_per_s(config, profile)
    found, pruned = candidates(base, space, rate, target)
    configs: dict[str, tuple] = {}
    run = lambda jobs, dep: run_parallel(
        _evaluate, [(c, b, target, profile) for c, b in jobs], workers, progress,
        ray_address, desc=f"plan: {dep} at the rate")
    rows, left, stopped = [], 0, False
    for dep in (d for d in DEPLOYMENTS if d in space.deployments):
        mine = [c for c in found if deployment_of(c[0][0]) == dep]
        share = space.max_candidates - len(rows)
        if dep == "aggregated" and "disaggregated" in space.deployments:
            share = -(-space.max_candidates // 2)
        got, rest, stop = _search(mine, share, run, capital, rate, configs, dep, workers)
        rows, left, stopped = rows + got, left + rest, stopped or stop
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    chosen = _rows_to_bisect(rows, space.max_knees)
    knees = run_parallel(_knee, [(*configs[r["config"]][:2], target, r["meets_target"])
                                 for r in chosen], workers, progress, ray_address,
                         desc="plan: knees")
    for r, (lo, hi, steps, missed) in zip(chosen, knees):
        r.update(knee_rate=lo, knee_bracket=[lo, hi], num_simulations=1 + steps)
        if missed is not None and r["meets_target"]:   # what gives way first above the rate
            r.update(binds=missed[0], binds_why=missed[1])
    meeting = [r for r in rows if r["meets_target"]]
    return {"rate": rate, "target": target, "workload": base.workload.name,
            "slo": {"ttft_s": base.slo.ttft_s, "tpot_s": base.slo.tpot_s},
            "deployments": [d for d in DEPLOYMENTS if d in space.deployments],
            "num_candidates": len(found), "pruned": pruned,
            "num_simulated": len(rows) + len(failed), "not_simulated": left,
            "stopped_by_cost_bound": stopped,
            "num_simulations": sum(r["num_simulations"] for r in rows) + len(failed),
            "cheapest": min(meeting, key=lambda r: r["usd_per_success"], default=None),
            "most_power_efficient": max(meeting, key=lambda r: r["tokens_per_joule"],
                                        default=None),
            "by_deployment": best_by_deployment(rows), "verdict": verdict(rows),
            "frontier": pareto([r for r in rows if r["knee_rate"] is not None]),
            "candidates": rows, "failed": failed,
            "costs": _costs_used(profile)}


def _search(found: list, limit: int, run, capital, rate: float, configs: dict, dep: str,
            workers) -> tuple[list, int, bool]:
    """One deployment's candidates simulated cheapest capital first (among equals the most
    roofline headroom), until ``limit`` or until nothing left can be cheaper per success
    than the cheapest meeting the target; then the other mechanisms on the cheapest
    hardware. (rows, candidates left, stopped by the cost bound)."""
    ranked = sorted(found, key=lambda c: (capital(c[0][0]), -c[1], _describe(c[0][0])))
    rows: list[dict] = []
    batch = 2 * (workers or os.cpu_count() or 1)
    stopped = False
    while ranked and len(rows) < limit:
        best = min((r["usd_per_success"] for r in rows if r["meets_target"]), default=math.inf)
        if capital(ranked[0][0][0]) / rate >= best:
            stopped = True                  # nothing left can be cheaper per success
            break
        take = min(batch, limit - len(rows))
        taken, ranked = ranked[:take], ranked[take:]
        for cs, b in taken:                 # cs: the hardware under each mechanism
            configs[_describe(cs[0])] = (cs[0], b, cs[1:])
        rows += run([(cs[0], b) for cs, b in taken], dep)
    meeting = [r for r in rows if r["meets_target"]]
    if meeting:                             # the other mechanisms on the cheapest hardware
        config, bound, others = configs[min(meeting, key=lambda r: r["usd_per_success"])
                                        ["config"]]
        rows += run([(c, bound) for c in others], dep) if others else []
        configs.update({_describe(c): (c, bound, []) for c in others})
    return rows, len(ranked), stopped


def _rows_to_bisect(rows: list, max_knees: int) -> list:
    """The rows whose knees are bisected: each deployment's cheapest meeting the target,
    then the cheapest others that meet it, then the closest to it."""
    order = sorted(rows, key=lambda r: (not r["meets_target"], r["usd_per_success"]
                                        if r["meets_target"] else -r["slo_attainment"],
                                        r["config"]))
    firsts = [p["cheapest"] for p in best_by_deployment(rows).values() if p["cheapest"]]
    chosen = sorted(firsts, key=order.index) + [r for r in order if r not in firsts]
    return chosen[:max_knees]


def _costs_used(profile: dict) -> dict:
    inputs = cost.cost_inputs(profile)
    return {"model": inputs.model, "lifetime_years": inputs.lifetime_years,
            "usd_per_kwh": inputs.usd_per_kwh, "host": inputs.host, "nic": inputs.nic,
            "devices": "hardware/catalog/devices.toml price_usd, the profile's [price] "
                       "overrides"}


def pareto(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both cost per successful request (lower) and goodput
    (knee, higher), cheapest first."""
    front = [r for r in rows if not any(
        o["usd_per_success"] <= r["usd_per_success"] and o["knee_rate"] >= r["knee_rate"]
        and (o["usd_per_success"], o["knee_rate"]) != (r["usd_per_success"], r["knee_rate"])
        for o in rows)]
    return sorted(front, key=lambda r: (r["usd_per_success"], -r["knee_rate"]))
