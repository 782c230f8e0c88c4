"""Capacity planning: the cheapest cluster, and the most power-efficient, that meet the SLOs.

``hawk plan --workload chatbot --rate 2`` searches prefill and decode device kinds, TP degrees,
instance counts, decode batch sizes and transfer mechanisms (``Space``). The search is pruned
before anything is simulated:

1. *Validity and memory*: a TP degree must divide the model's heads, the weights must fit the
   instance's devices (``sim.engine.cluster.kv_capacity_blocks``), the mechanism must join the two
   device kinds (GPU->GPU or GPU->NPU) and the config must resolve (``RunConfig``).
2. *Roofline bound*: one instance's best-case throughput in requests/s (``phase_capacity``:
   full prefill batches of the workload's mean prompt; a full decode batch, capped by KV
   memory, at the mean context). A phase needs ``ceil(rate * target / capacity)`` instances at
   least; fewer cannot keep up. That count and one more are tried (more only cost more).
3. *Cost bound*: the survivors are ordered by capital cost per second / rate, a lower bound on
   the cost per successful request; they are simulated cheapest first, and the search stops
   once the next bound exceeds the cheapest cost found that meets the target (or after
   ``max_candidates``).

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.config import ConfigError, RunConfig, tomllib
from sim.models import cost

BISECTION_STEPS = 5
#: mechanisms tried first on each hardware choice (the others only on the cheapest that meets
#: the target: a mechanism changes no price, only how well the hardware serves)
PREFERRED = ("GN-HAWK", "GG-Direct")


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


@dataclass(frozen=True)
class Space:
    """What the planner may choose from (None: every catalog device with a timing table)."""

    prefill_devices: tuple | None = None
    decode_devices: tuple | None = None
    tps: tuple = (1, 2, 4, 8)
    decode_batch_sizes: tuple | None = None     # None: the device's default
    mechanisms: tuple | None = None
    max_instances: int = 8
    max_candidates: int = 24         # configurations simulated at the asked rate, at most
    max_knees: int = 6               # of which knees are bisected (meeting the target first)


# -- bounds ---------------------------------------------------------------------------------

def phase_capacity(config: RunConfig, role: str, prompt: float, output: float) -> float:
    """Best-case requests/s of one ``role`` instance (raises ``ConfigError`` if the weights do
    not fit): full prefill batches of ``prompt``-token prompts, or a decode batch as large as
    its batch size and KV memory allow, at the mean context."""
    from hardware.kv_layout import blocks_for
    from sim.engine.cluster import kv_capacity_blocks, make_predictor

    inst = getattr(config.cluster, role)
    blocks = kv_capacity_blocks(config, inst)
    predictor = make_predictor(config, inst)
    if role == "prefill":
        k = max(1, min(inst.max_batch_size, int(inst.max_batch_tokens // prompt)))
        return k / predictor.prefill_time([int(prompt)] * k)
    per_request = blocks_for(int(prompt + output), inst.block_size)
    batch = min(inst.max_batch_size, blocks // per_request)
    if batch < 1:
        return 0.0
    step = predictor.decode_step_time(batch, int(prompt + output / 2))
    return batch / (output * step)


def _mean_lengths(workload: str) -> tuple[float, float]:
    from traces.workloads import length_table, workload_spec

    prompt, output = length_table(workload_spec(workload).lengths_file)
    return float(np.mean(prompt)), float(np.mean(output))


def candidates(base: RunConfig, space: Space, rate: float, target: float):
    """([(the hardware choice under each applicable mechanism, preferred first, its roofline
    rate bound)], counts of what each check pruned)."""
    from hardware.catalog import devices
    from sim.models.predictor import load_profile
    from sim.models.transfer import MECHANISMS

    timed = set(load_profile(base.cluster.profile))
    kinds = {name: d.kind for name, d in devices().items() if name in timed}
    prompt, output = _mean_lengths(base.workload.name)
    pruned = {"invalid": 0, "memory": 0, "roofline": 0}
    phases = {}
    for role, names in (("prefill", space.prefill_devices), ("decode", space.decode_devices)):
        options = []
        allowed = names or tuple(n for n in kinds if role == "decode" or kinds[n] == "gpu")
        sizes = space.decode_batch_sizes if role == "decode" else None
        for device in allowed:
            if device not in kinds:
                raise ConfigError(f"--devices: {device!r} has no timing table in profile "
                                  f"{base.cluster.profile!r}; choose from {sorted(kinds)}")
            for tp in space.tps:
                for size in sizes or (None,):
                    changes = {f"cluster.{role}.device": device, f"cluster.{role}.tp": tp}
                    if size is not None:
                        changes[f"cluster.{role}.max_batch_size"] = size
                    try:
                        cap = phase_capacity(base.replace(**changes), role, prompt, output)
                    except ConfigError as exc:
                        pruned["memory" if ("weights" in str(exc) or " fit" in str(exc)) else "invalid"] += 1
                        continue
                    need = math.ceil(rate * target / cap) if cap > 0 else math.inf
                    pruned["roofline"] += min(need, space.max_instances + 1) - 1
                    if need > space.max_instances:    # counts below need cannot keep up
                        continue
                    for n in (need, need + 1):
                        if n <= space.max_instances:
                            options.append(({**changes, f"cluster.{role}.num_instances": n},
                                            n * cap, kinds[device]))
        phases[role] = options
    out = []
    mechanisms = space.mechanisms or PREFERRED + tuple(m for m in MECHANISMS
                                                       if m not in PREFERRED)
    for pre, pre_cap, _ in phases["prefill"]:
        kv_dtype = base.replace(**pre).cluster.prefill.kv_dtype
        for dec, dec_cap, kind in phases["decode"]:
            same = {"cluster.decode.kv_dtype": kv_dtype} if kind == "gpu" else {}
            configs = []                  # a GPU->GPU copy keeps the prefill side's KV dtype
            for mech in (m for m in mechanisms if MECHANISMS[m].destination == kind):
                try:
                    configs.append(base.replace(**pre, **dec, **same,
                                                **{"cluster.link.mechanism": mech,
                                                   "workload.rate": rate}))
                except ConfigError:
                    pruned["invalid"] += 1
            if configs:
                out.append((configs, min(pre_cap, dec_cap)))
    return out, pruned


# -- simulating a candidate ---------------------------------------------------------------

def _evaluate(job) -> dict:
    """Simulate ``config`` at the asked rate (module level, for process pools)."""
    from sim.engine.cluster import simulate

    config, bound, target, profile = job
    try:
        s = simulate(config).summary
    except Exception as exc:               # one broken combination must not end the search;
        return {"config": _describe(config), "changes": _changes(config),   # it is reported
                "error": f"{type(exc).__name__}: {exc}", "meets_target": False,
                "knee_rate": None, "num_simulations": 1}
    return {"config": _describe(config), "changes": _changes(config),
            "rate": config.workload.rate, "slo_attainment": s["slo_attainment"],
            "meets_target": s["slo_attainment"] >= target,
            "usd_per_success": cost.usd_per_success(s, config, profile),
            "capital_usd_per_hour": 3600 * cost.capital_usd_per_s(config, profile),
            "tokens_per_joule": s["tokens_per_joule"], "bottleneck": s.get("bottleneck"),
            "roofline_rate": bound, "knee_rate": None, "num_simulations": 1}


def _knee(job) -> tuple[float, float, int]:
    """The knee of ``config`` by bisection (``sim.runs.knee.bisect_knee``): between the asked
    rate and 1.25x the roofline bound when it meets the target there, else between 0 and the
    asked rate."""
    from sim.engine.cluster import simulate
    from sim.runs.knee import bisect_knee

    config, bound, target, meets_at_rate = job

    def meets(rate: float) -> bool:
        run = simulate(config.replace(**{"workload.rate": rate}))
        return run.summary["slo_attainment"] >= target

    rate = config.workload.rate
    lo, hi = (rate, max(bound, rate) * 1.25) if meets_at_rate else (0.0, rate)
    return (*bisect_knee(meets, lo, hi, BISECTION_STEPS), BISECTION_STEPS)


def _changes(config: RunConfig) -> dict:
    cl = config.cluster
    out = {}
    for role in ("prefill", "decode"):
        inst = getattr(cl, role)
        for key in ("device", "tp", "num_instances", "max_batch_size"):
            out[f"cluster.{role}.{key}"] = getattr(inst, key)
    out["cluster.link.mechanism"] = cl.link.mechanism
    return out


def _describe(config: RunConfig) -> str:
    cl = config.cluster
    p, d = cl.prefill, cl.decode
    return (f"{p.num_instances}x({p.tp}x {p.device}) -> {d.num_instances}x({d.tp}x {d.device},"
            f" batch {d.max_batch_size}) via {cl.link.mechanism}")


def plan(base: RunConfig, rate: float, target: float = 0.9, space: Space = Space(),
         costs: dict | None = None, workers: int | None = None, progress: bool = True,
         ray_address: str | None = None) -> dict:
    """Search, prune, simulate cheapest-bound first, bisect knees; the frontier and picks."""
    from sim.runs.sweep import run_parallel

    profile = cost_profile(base, costs or {})
    capital = lambda config: cost.capital_usd_per_s(config, profile)
    found, pruned = candidates(base, space, rate, target)
    # cheapest capital first; among equals the one with the most roofline headroom
    ranked = sorted(found, key=lambda c: (capital(c[0][0]), -c[1],
                                          _describe(c[0][0])))
    configs: dict[str, tuple] = {}
    rows: list[dict] = []
    run = lambda jobs: run_parallel(_evaluate, [(c, b, target, profile) for c, b in jobs],
                                    workers, progress, ray_address, desc="plan: at the rate")
    batch = 2 * (workers or os.cpu_count() or 1)
    stopped = False
    while ranked and len(rows) < space.max_candidates:
        best = min((r["usd_per_success"] for r in rows if r["meets_target"]), default=math.inf)
        if capital(ranked[0][0][0]) / rate >= best:
            stopped = True                  # nothing left can be cheaper per success
            break
        take = min(batch, space.max_candidates - len(rows))
        taken, ranked = ranked[:take], ranked[take:]
        for cs, b in taken:                 # cs: the hardware under each mechanism
            configs[_describe(cs[0])] = (cs[0], b, cs[1:])
        rows += run([(cs[0], b) for cs, b in taken])
    meeting = [r for r in rows if r["meets_target"]]
    if meeting:                             # the other mechanisms on the cheapest hardware
        config, bound, others = configs[min(meeting, key=lambda r: r["usd_per_success"])
                                        ["config"]]
        rows += run([(c, bound) for c in others])
        configs.update({_describe(c): (c, bound, []) for c in others})
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    # knees for the cheapest that meet the target, then the closest to it
    chosen = sorted(rows, key=lambda r: (not r["meets_target"], r["usd_per_success"]
                                         if r["meets_target"] else -r["slo_attainment"]))
    chosen = chosen[:space.max_knees]
    knees = run_parallel(_knee, [(*configs[r["config"]][:2], target, r["meets_target"])
                                 for r in chosen], workers, progress, ray_address,
                         desc="plan: knees")
    for r, (lo, hi, steps) in zip(chosen, knees):
        r.update(knee_rate=lo, knee_bracket=[lo, hi], num_simulations=1 + steps)
    meeting = [r for r in rows if r["meets_target"]]
    return {"rate": rate, "target": target, "workload": base.workload.name,
            "slo": {"ttft_s": base.slo.ttft_s, "tpot_s": base.slo.tpot_s},
            "num_candidates": len(found), "pruned": pruned,
            "num_simulated": len(rows) + len(failed), "not_simulated": len(ranked),
            "stopped_by_cost_bound": stopped,
            "num_simulations": sum(r["num_simulations"] for r in rows) + len(failed),
            "cheapest": min(meeting, key=lambda r: r["usd_per_success"], default=None),
            "most_power_efficient": max(meeting, key=lambda r: r["tokens_per_joule"],
                                        default=None),
            "frontier": pareto([r for r in rows if r["knee_rate"] is not None]),
            "candidates": rows, "failed": failed,
            "costs": _costs_used(profile)}


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


def format_plan(result: dict) -> str:
    p = result["pruned"]
    lines = [f"{result['workload']} @ {result['rate']:g} req/s, attainment target "
             f"{100 * result['target']:.0f}% (TTFT {result['slo']['ttft_s']:g} s, TPOT "
             f"{result['slo']['tpot_s']:g} s)",
             f"before simulating, pruned {p['memory']} device/TP choices by memory, "
             f"{p['roofline']} instance counts by the roofline bound and {p['invalid']} "
             f"invalid pairings; {result['num_candidates']} configurations left, simulated "
             f"{result['num_simulated']} cheapest-bound first ({result['num_simulations']} "
             f"simulations with the knees)"
             + (f", {result['not_simulated']} left out by the cost bound"
                if result["stopped_by_cost_bound"] else
                f", {result['not_simulated']} left out (max candidates)"
                if result["not_simulated"] else "")]
    for title, key in (("cheapest per successful request", "cheapest"),
                       ("most power-efficient", "most_power_efficient")):
        r = result[key]
        lines.append(f"{title}: " + ("none meets the target; raise --max-candidates or "
                                     "--max-instances" if r is None else
                                     f"{r['config']}: ${r['usd_per_success']:.5f} per "
                                     f"successful request, {r['tokens_per_joule']:.3g} tokens/J,"
                                     f" knee {r['knee_rate']:.3g} req/s"))
    lines.append("Pareto frontier (cost per successful request vs goodput):")
    lines.append(f"  {'$/success':>10} {'knee req/s':>10} {'attain.':>8} {'tok/J':>7} "
                 f"{'$/hour':>8}  configuration")
    for r in result["frontier"]:
        lines.append(f"  {r['usd_per_success']:>10.5f} {r['knee_rate']:>10.3g} "
                     f"{100 * r['slo_attainment']:>7.1f}% {r['tokens_per_joule']:>7.3g} "
                     f"{r['capital_usd_per_hour']:>8.3f}  {r['config']}")
    for r in result["failed"]:
        lines.append(f"could not simulate {r['config']}: {r['error']}")
    lines.append(_describe_costs(result["costs"]))
    return "\n".join(lines)


def _describe_costs(c: dict) -> str:
    host, nic = c["host"], c["nic"]
    parts = ["devices from the catalog",
             f"host ${host['price_usd']:,.0f} per {host['devices_per_host']} devices"
             if host else "no hosts priced",
             f"NIC ${nic['price_usd']:,.0f} per instance" if nic else "no NICs priced"]
    held = (f"over {c['lifetime_years']:g} years" if c["model"] == "amortised"
            else "at the devices' hourly rates (hosts and NICs included)")
    return f"costs: {', '.join(parts)}, {held}, energy at ${c['usd_per_kwh']:g}/kWh"


def plot_plan(result: dict, path) -> None:
    """``plan_figure`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = plan_figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_figure(result: dict):
    """Cost per successful request vs goodput, every simulated candidate, the frontier joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in result["candidates"] if r["knee_rate"] is not None]
    front = result["frontier"]
    ax.scatter([r["knee_rate"] for r in rows], [r["usd_per_success"] for r in rows],
               color="grey", label="simulated")
    ax.plot([r["knee_rate"] for r in front], [r["usd_per_success"] for r in front],
            marker="o", color="tab:red", label="Pareto frontier")
    ax.axvline(result["rate"], color="grey", linestyle="--", label="asked rate")
    ax.set_xlabel("goodput: knee rate (req/s)")
    ax.set_ylabel("$ per successful request")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
