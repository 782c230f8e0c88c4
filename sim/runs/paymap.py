"""Does disaggregation pay off? The map: over workload shapes and rates, which deployment the
planner (``sim.runs.capacity.plan``) finds best at each point, on cost per successful request
and on output tokens per joule, and by how much.

A *point* is a workload (its length table and its own SLOs, ``traces.workloads``; ``slo``
sets one pair for all) at one rate, on the base config. At each point the planner searches
aggregated and disaggregated candidates in ``space`` and gives its verdict
(``sim.runs.verdict``): per metric, the winning deployment, each deployment's best value
and config, and the margin, the winner's advantage over the other deployment's best as a
share of the other's (always >= 0; NaN where only one deployment, or none, meets the
target). A point's row is exactly what ``plan`` says at that point: the map bisects no
knees (they do not enter the verdict, only what is said to bind), so ``space.max_knees``
is set to 0.

The points are independent: they run in parallel (``sim.runs.sweep.run_parallel``, one plan
per worker, each plan in its worker's process), in the order asked for, with the same rows
whichever runs them. Rows are flat dicts (``format_map`` and ``map_figure`` in
``sim.runs.plan_report`` print and draw them; ``pandas.DataFrame(rows)`` tabulates them).
"""

from __future__ import annotations

import dataclasses
import math

from sim.config import ConfigError, RunConfig
from sim.runs.capacity import Space, plan
from sim.runs.verdict import DEPLOYMENTS

#: the map of ``hawk plan --map`` unless told otherwise: small enough for a few minutes
DEFAULT_WORKLOADS = ("chatbot", "summarization", "code")
DEFAULT_RATES = (1.0, 2.0, 4.0)
#: metric -> (the candidate rows' key, the pick of ``best_by_deployment``)
METRICS = {"cost": ("usd_per_success", "cheapest"),
           "energy": ("tokens_per_joule", "most_power_efficient")}


def parse_workloads(text: str) -> tuple[str, ...]:
    """``"chatbot,code"`` -> its workload names, each known, none twice."""
    from traces.workloads import WORKLOADS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise ConfigError(f"--workloads {text!r}: choose from {sorted(WORKLOADS)} "
                          f"(comma-separated)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--workloads {text!r}: a workload is named twice")
    return names


def point_config(base: RunConfig, workload: str, rate: float,
                 slo: tuple[float, float] | None = None) -> RunConfig:
    """The base config at one point: ``workload`` at ``rate`` requests/s, under ``slo``
    (TTFT s, TPOT s) or the workload's own SLOs."""
    from traces.workloads import workload_spec

    try:
        spec = workload_spec(workload)
    except ValueError as exc:
        raise ConfigError(f"workloads: {exc}") from None
    if not rate > 0:
        raise ConfigError(f"rates: {rate!r} must be > 0 req/s")
    ttft, tpot = slo if slo is not None else (spec.ttft_slo_s, spec.tpot_slo_s)
    return base.replace(**{"workload.name": workload, "workload.rate": float(rate),
                           "slo.ttft_s": ttft, "slo.tpot_s": tpot})


def map_space(space: Space) -> Space:
    """``space`` as the map searches it: the same candidates, no knees bisected."""
    return dataclasses.replace(space, max_knees=0)


def paymap(base: RunConfig, workloads=DEFAULT_WORKLOADS, rates=DEFAULT_RATES,
           target: float = 0.9, space: Space = Space(), costs: dict | None = None,
           slo: tuple[float, float] | None = None, workers: int | None = None,
           progress: bool = True, ray_address: str | None = None) -> list[dict]:
    """One row per (workload, rate), workloads outer, in the order given (``point_row``)."""
    from sim.runs.sweep import run_parallel

    if not workloads or not len(rates):
        raise ConfigError("the map needs at least one workload and one rate")
    jobs = [(point_config(base, w, r, slo), target, map_space(space), costs or {})
            for w in workloads for r in rates]
    return run_parallel(_point, jobs, workers, progress, ray_address, desc="paymap: points")


def _point(job) -> dict:
    """The planner at one point, in this process (module level, for process pools)."""
    config, target, space, costs = job
    result = plan(config, config.workload.rate, target, space, costs, workers=1,
                  progress=False)
    return point_row(result)


def point_row(result: dict) -> dict:
    """A plan's verdict as one flat row: per metric (``cost``, ``energy``) the winner, the
    margin, and each deployment's best value and config (NaN and None where none meets the
    target)."""
    row = {"workload": result["workload"], "rate": result["rate"],
           "ttft_slo_s": result["slo"]["ttft_s"], "tpot_slo_s": result["slo"]["tpot_s"],
           "target": result["target"], "num_simulations": result["num_simulations"]}
    for metric, (key, pick) in METRICS.items():
        v = result["verdict"][metric]
        row[f"{metric}_winner"] = v["winner"]
        row[f"{metric}_margin"] = v["margin"]
        for dep in DEPLOYMENTS:
            best = result["by_deployment"][dep][pick]
            row[f"{metric}_{dep}"] = best[key] if best is not None else math.nan
            row[f"{metric}_{dep}_config"] = best["config"] if best is not None else None
    return row


def plan_runs_at_most(space: Space) -> int:
    """Simulations one point's plan runs at most: its candidates at the rate and the other
    mechanisms on the disaggregated cheapest (no knees), as ``hawk plan`` counts them."""
    from sim.models.transfer import MECHANISMS

    return space.max_candidates + len(MECHANISMS)
