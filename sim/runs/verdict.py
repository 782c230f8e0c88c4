"""Does disaggregation pay off? Deployments side by side: what a candidate is, what binds it,
and the one-line verdict of a plan (``sim.runs.capacity``) or of a map point
(``sim.runs.paymap``).

- *Deployment*: ``"aggregated"`` (one engine per instance does both phases,
  ``sim.engine.aggregated``) or ``"disaggregated"`` (prefill and decode pools joined by a KV
  link). ``with_kind`` turns a config into either shape, keeping its workload, SLOs, seed and
  policies (and only the tables the new shape has).
- *Shape*: the devices' kinds, ``"GPU aggregated"``, ``"NPU aggregated"``, ``"GPU+NPU"``
  (GPU prefill, NPU decode), ``"GPU+GPU"``.
- *What binds* (``binds``), from a run's summary and stats, first match wins:
  failures that name a stage (a KV budget that cannot hold a request: ``KV capacity``; a failed
  transfer: ``transfer``; a prompt too long for the prefill side: ``prefill``); preemptions
  above ``PREEMPTION_SHARE`` per request, or an aggregated pool's KV blocks the most used of
  its resources: ``KV capacity``; the KV link the most loaded stage: ``transfer``; else the
  phase whose SLO is nearer its limit at P90 (TTFT: ``prefill``, TPOT: ``decode``).
- *Verdict*: the cheapest candidate per successful request (and the one with most output
  tokens per joule) among those meeting the target, against the best of the other deployment,
  with the margin: ``(other - best) / other`` for cost, ``(best - other) / other`` for tokens
  per joule.
"""

from __future__ import annotations

import math

from sim.config import _roles, from_dict, user_settings

DEPLOYMENTS = ("aggregated", "disaggregated")
#: preemptions per request above which KV capacity is said to bind
PREEMPTION_SHARE = 0.05
#: keys of each shape's own tables (the other shape has no use for them)
_OWN = {"aggregated": ("aggregated", "pool_routing", "aggregated_share"),
        "disaggregated": ("prefill", "decode", "link", "decode_routing")}


def deployment_of(config) -> str:
    return "aggregated" if config.cluster.kind == "aggregated" else "disaggregated"


def with_kind(config, kind: str):
    """``config`` as a ``kind`` cluster ("aggregated" or "disaggregated"): the other shape's
    tables dropped, everything else kept."""
    if kind not in DEPLOYMENTS:
        raise ValueError(f"deployment {kind!r} must be one of {DEPLOYMENTS}")
    if config.cluster.kind == kind:
        return config
    given = user_settings(config)
    cluster = given.setdefault("cluster", {})
    for other in DEPLOYMENTS:
        if other != kind:
            for key in _OWN[other]:
                cluster.pop(key, None)
    if kind == "disaggregated":
        cluster.pop("kind", None)
    else:
        cluster["kind"] = kind
    return from_dict(given)


def shape_of(config) -> str:
    from hardware.catalog import devices

    kinds = {role: devices()[getattr(config.cluster, role).device].kind.upper()
             for role in _roles(config.cluster)}
    if config.cluster.kind == "aggregated":
        return f"{kinds['aggregated']} aggregated"
    return f"{kinds['prefill']}+{kinds['decode']}"


def describe(config) -> str:
    """One line: the deployment, its shape and its pools."""
    cl = config.cluster
    if cl.kind != "disaggregated":
        from sim.engine.pools import describe_pools

        return f"{shape_of(config)}: {describe_pools(cl)}"
    p, d = cl.prefill, cl.decode
    return (f"{shape_of(config)} disaggregated: prefill {p.num_instances}x({p.tp}x "
            f"{p.device}) -> decode {d.num_instances}x({d.tp}x {d.device}) via "
            f"{cl.link.mechanism}")


def binds(summary: dict, stats: dict) -> tuple[str, str]:
    """(what binds, why) for one run (the module docstring's order)."""
    statuses = summary.get("statuses", {})
    for stage, names in (("KV capacity", ("rejected_decode_capacity", "failed_out_of_memory",
                                          "rejected_prefill_capacity")),
                         ("transfer", ("failed_transfer",)),
                         ("prefill", ("rejected_prompt_too_long",))):
        failed = sum(statuses.get(n, 0) for n in names)
        if failed:
            return stage, f"{failed} request(s) {', '.join(n for n in names if statuses.get(n))}"
    n = max(int(summary.get("num_requests", 0)), 1)
    preempted = sum(stats.get("aggregated_preemptions", stats.get("decode_preemptions", [])))
    if preempted / n > PREEMPTION_SHARE:
        return "KV capacity", f"{preempted / n:.2f} preemptions per request"
    if summary.get("aggregated_bottleneck") == "kv_blocks":
        return "KV capacity", f"KV blocks {100 * summary['aggregated_kv_use']:.0f}% in use"
    if summary.get("bottleneck") == "link" and "aggregated_utilization" not in summary:
        return "transfer", f"link {100 * summary['link_utilization']:.0f}% busy"
    ttft = summary["ttft_p90_s"] / summary["ttft_slo_s"]
    tpot = summary["tpot_p90_s"] / summary["tpot_slo_s"]
    if math.isnan(ttft) and math.isnan(tpot):
        return "none", "no request finished"
    if not tpot > ttft:
        return "prefill", f"TTFT P90 at {100 * ttft:.0f}% of its SLO"
    return "decode", f"TPOT P90 at {100 * tpot:.0f}% of its SLO"


def best_by_deployment(rows: list[dict]) -> dict:
    """Per deployment, the cheapest per successful request and the most output tokens per
    joule among the rows meeting the target (None where none does)."""
    out = {}
    for dep in DEPLOYMENTS:
        meeting = [r for r in rows if r.get("deployment") == dep and r["meets_target"]]
        out[dep] = {"cheapest": min(meeting, key=lambda r: (r["usd_per_success"], r["config"]),
                                    default=None),
                    "most_power_efficient": max(meeting, key=lambda r: (r["tokens_per_joule"],
                                                                       r["config"]),
                                                default=None)}
    return out


def verdict(rows: list[dict]) -> dict:
    """The winner on cost and on energy (deployment, margin, line), from ``rows``."""
    best = best_by_deployment(rows)
    return {"cost": _one(best, "cheapest", "usd_per_success", lower=True),
            "energy": _one(best, "most_power_efficient", "tokens_per_joule", lower=False)}


def _one(best: dict, pick: str, key: str, lower: bool) -> dict:
    a, d = best["aggregated"][pick], best["disaggregated"][pick]
    what = ("is {}% cheaper per successful request" if lower else
            "gets {}% more output tokens per joule")
    if a is None and d is None:
        return {"winner": None, "margin": math.nan,
                "line": "no candidate of either deployment meets the target"}
    if a is None or d is None:
        win = a or d
        dep = "aggregated" if a is not None else "disaggregated"
        other = "disaggregated" if a is not None else "aggregated"
        return {"winner": dep, "margin": math.nan, "best": win["config"],
                "line": f"only {dep} meets the target: {_name(win)} (no {other} candidate "
                        f"meets it)"}
    if lower:
        win, lose = (a, d) if a[key] <= d[key] else (d, a)
        margin = (lose[key] - win[key]) / lose[key]
    else:
        win, lose = (a, d) if a[key] >= d[key] else (d, a)
        margin = (win[key] - lose[key]) / lose[key] if lose[key] > 0 else math.inf
    other = "disaggregated" if win is a else "aggregated"
    return {"winner": win["deployment"], "margin": margin, "best": win["config"],
            "runner_up": lose["config"],
            "line": f"{_name(win)} {what.format(f'{100 * margin:.0f}')} than the "
                    f"{'cheapest' if lower else 'most efficient'} {other} candidate, "
                    f"{_name(lose)}"}


def _name(row: dict) -> str:
    config = row["config"]
    return config if config.startswith(row["deployment"]) else f"{row['deployment']} {config}"
