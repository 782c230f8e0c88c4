"""What ``hawk plan`` prints and draws from a plan (``sim.runs.capacity.plan``): the picks
with what binds them, the verdict of aggregated against disaggregated serving
(``sim.runs.verdict``), the Pareto frontier and its figure."""

from __future__ import annotations

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
        lines.append(f"{title}: " + _pick(result[key]))
    for dep, picks in result.get("by_deployment", {}).items():
        if dep in result.get("deployments", ()):
            lines.append(f"  best {dep}: {_pick(picks['cheapest'])}")
    if len(result.get("deployments", ())) > 1:
        lines.append(f"verdict (cost): {result['verdict']['cost']['line']}")
        lines.append(f"verdict (energy): {result['verdict']['energy']['line']}")
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


def _pick(r: dict | None) -> str:
    if r is None:
        return "none meets the target; raise --max-candidates or --max-instances"
    knee = "not bisected" if r["knee_rate"] is None else f"{r['knee_rate']:.3g} req/s"
    return (f"{r['config']}: ${r['usd_per_success']:.5f} per successful request, "
            f"{r['tokens_per_joule']:.3g} tokens/J, knee {knee}; binds: {r['binds']} "
            f"({r['binds_why']})")


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
