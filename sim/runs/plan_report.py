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


# -- the map of ``sim.runs.paymap`` -----------------------------------------------------------

#: a map cell's colour by its winner (None: no candidate of either deployment meets the target)
WINNER_COLOURS = {"aggregated": "tab:blue", "disaggregated": "tab:orange", None: "lightgrey"}
_MAP_METRICS = (("cost", "$/success", "{:.5f}"), ("energy", "tok/J", "{:.3g}"))


def margin_text(winner, margin) -> str:
    """``+12%`` (the winner's margin), ``only`` (the other deployment meets no target) or
    ``none`` (neither does)."""
    if winner is None:
        return "none"
    return "only" if margin != margin else f"+{100 * margin:.0f}%"


def format_map(rows: list[dict]) -> str:
    """The map as a table: per point and metric the winner, its margin and both deployments'
    best values; then each point's best configurations on cost."""
    head = f"{'workload':<14} {'req/s':>6}"
    for metric, unit, _ in _MAP_METRICS:
        head += (f"  {metric + ' winner':<15} {'margin':>6} {'agg ' + unit:>12} "
                 f"{'disagg ' + unit:>13}")
    lines = [head]
    for r in rows:
        line = f"{r['workload']:<14} {r['rate']:>6g}"
        for metric, _, fmt in _MAP_METRICS:
            values = [r[f"{metric}_{d}"] for d in ("aggregated", "disaggregated")]
            shown = ["-" if v != v else fmt.format(v) for v in values]
            line += (f"  {r[f'{metric}_winner'] or '-':<15} "
                     f"{margin_text(r[f'{metric}_winner'], r[f'{metric}_margin']):>6} "
                     f"{shown[0]:>12} {shown[1]:>13}")
        lines.append(line)
    lines.append("margin: the winner's advantage over the other deployment's best (only: the "
                 "other meets no target; none: neither does)")
    lines.append("best on cost at each point (aggregated | disaggregated):")
    for r in rows:
        lines.append(f"  {r['workload']} @ {r['rate']:g}: {r['cost_aggregated_config'] or '-'}"
                     f" | {r['cost_disaggregated_config'] or '-'}")
    return "\n".join(lines)


def plot_map(rows: list[dict], path) -> None:
    """``map_figure`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = map_figure(rows)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def map_figure(rows: list[dict]):
    """Two panels, cost and energy: x the rate, y the workload, each cell coloured by the
    winning deployment and labelled with its margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rates = sorted({r["rate"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(rates), 1.5 + 0.6 * len(workloads)),
                             sharey=True)
    for ax, (metric, unit, _) in zip(axes, _MAP_METRICS):
        for r in rows:
            x, y, win = rates.index(r["rate"]), workloads.index(r["workload"]), \
                r[f"{metric}_winner"]
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=WINNER_COLOURS[win],
                                   edgecolor="white", linewidth=2))
            ax.text(x, y, margin_text(win, r[f"{metric}_margin"]), ha="center", va="center",
                    fontsize=9)
        ax.set_xlim(-0.5, len(rates) - 0.5)
        ax.set_ylim(-0.5, len(workloads) - 0.5)
        ax.set_xticks(range(len(rates)), [f"{x:g}" for x in rates])
        ax.set_yticks(range(len(workloads)), workloads)
        ax.set_xlabel("rate (req/s)")
        ax.set_title(f"{metric} ({unit})", fontsize=10)
    axes[0].invert_yaxis()                  # the first workload on top
    fig.legend(handles=[Patch(color=c, label=w or "neither meets the target")
                        for w, c in WINNER_COLOURS.items()], loc="lower center", ncol=3,
               fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig
