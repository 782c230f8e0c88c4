"""``hawk bench``'s goals and its report (``sim.bench.speed`` measures the figures).

Each goal's line ends MET or MISSED, and the report's last line lists the goals missed;
``hawk bench --strict`` exits 1 when there is one. The goals:

- ``REQUESTS_PER_EVENT_TARGET``: simulated requests per bare SimPy event, P/D at the knee;
- ``LONG_OUTPUT_RATIO_TARGET``: CPU per request when every output is 10x longer at the same
  offered load (the same requests at 1/10 the rate, the same output tokens per second), for
  the P/D cluster and each aggregated one: the cost of a request stays flat in its output
  length (fast-forward prices a run of decodes at once);
- ``STARTUP_TARGET_S``: CPU seconds of a fresh ``hawk simulate`` up to its first event;
- ``AGGREGATED_VS_DISAGGREGATED_TARGET``: CPU per request of an aggregated cluster over the
  P/D cluster's, the same trace, timed beside it: an aggregated request costs no more.
"""

from __future__ import annotations

#: the goals of ``hawk bench`` (printed beside the measured figures, each MET or MISSED)
REQUESTS_PER_EVENT_TARGET = 0.06
LONG_OUTPUT_RATIO_TARGET = 2.0
STARTUP_TARGET_S = 0.5
AGGREGATED_VS_DISAGGREGATED_TARGET = 1.0


def target_checks(r: dict) -> list[tuple[str, float, str, bool]]:
    """``(what, measured, target, met)`` for each goal of report ``r``, in printed order."""
    pd_10x, agg, long = (r["long_output_wall_ratio"], AGGREGATED_VS_DISAGGREGATED_TARGET,
                         LONG_OUTPUT_RATIO_TARGET)
    checks = [("requests per bare event", r["requests_per_bare_event"],
               f">= {REQUESTS_PER_EVENT_TARGET:g}",
               r["requests_per_bare_event"] >= REQUESTS_PER_EVENT_TARGET),
              ("10x longer outputs", pd_10x, f"< {long:g}x", pd_10x < long),
              ("start-up to first event", r["startup_s"], f"< {STARTUP_TARGET_S:g} s",
               r["startup_s"] < STARTUP_TARGET_S)]
    for a in r.get("aggregated", ()):
        name, vs, ratio = (f"aggregated {a['num_instances']}x", a["per_request_vs_disaggregated"],
                           a["long_output_wall_ratio"])
        checks += [(f"{name} per request vs P/D", vs, f"<= {agg:g}x", vs <= agg),
                   (f"{name} 10x longer outputs", ratio, f"< {long:g}x", ratio < long)]
    return checks


def missed_targets(r: dict) -> list[str]:
    """The goals report ``r`` misses, each as ``what measured (target ...)``."""
    return [f"{what} {value:.4g} (target {target})"
            for what, value, target, met in target_checks(r) if not met]


def format_report(r: dict) -> str:
    verdicts = iter(["MET" if met else "MISSED" for *_, met in target_checks(r)])
    lines = [
        f"Chatbot, {r['num_requests']:,} requests at {r['rate']:g} req/s "
        f"(SLO attainment {100 * r['slo_attainment']:.1f}%); best of {r['repeats']} "
        f"interleaved runs, CPU time"
        + (f", Python {r['python']}, SimPy {r['simpy']}" if "python" in r else ""),
        f"  simulated requests/s     {r['simulated_requests_per_s']:>12,.0f}   "
        f"({r['wall_s']:.2f} s wall)",
        f"  bare SimPy events/s      {r['bare_simpy_events_per_s']:>12,.0f}",
        f"  requests per bare event  {r['requests_per_bare_event']:>12.4f}   "
        f"(target >= {REQUESTS_PER_EVENT_TARGET:g}; "
        f"{r['decode_wakeups_per_request']:.2f} decode timer firings per request)  "
        f"{next(verdicts)}",
        f"  10x longer outputs       {r['long_output_wall_ratio']:>12.2f}x wall "
        f"({r['long_output_wall_s']:.2f} s at {r['long_output_rate']:g} req/s, the same "
        f"output tokens/s; target < {LONG_OUTPUT_RATIO_TARGET:g}x)  {next(verdicts)}",
        f"    at the same req/s      {r['long_output_same_rate_wall_ratio']:>12.2f}x wall "
        f"({r['long_output_same_rate_wall_s']:.2f} s; 10x the decode demand, overloaded: "
        f"{r['long_output_same_rate_preemptions_per_request']:.2f} preemptions per request)",
        f"  start-up to first event  {r['startup_s']:>12.3f} s CPU "
        f"({r['startup_wall_s']:.3f} s wall; target < {STARTUP_TARGET_S:g} s)  "
        f"{next(verdicts)}",
    ]
    for a in r.get("aggregated", ()):
        lines += _aggregated_lines(a, verdicts)
    spread = r.get("per_repeat")
    if spread and len(spread["requests_per_bare_event"]) > 1:
        def span(key: str, fmt: str) -> str:
            return f"{min(spread[key]):{fmt}}-{max(spread[key]):{fmt}}"

        lines.append(f"  each repeat on its own   requests per bare event "
                     f"{span('requests_per_bare_event', '.4f')} "
                     f"(median {r['requests_per_bare_event_paired_median']:.4f}), 10x "
                     f"{span('long_output_wall_ratio', '.2f')}x, at the same req/s "
                     f"{span('long_output_same_rate_wall_ratio', '.2f')}x")
    if "peak_rss_mb" in r:
        lines.append(f"  peak memory, {r['memory_requests']:,} requests "
                     f"{r['peak_rss_mb']:>7,.0f} MB in memory, "
                     f"{r['peak_rss_mb_streamed']:,.0f} MB streamed")
    checks, missed = target_checks(r), missed_targets(r)
    lines.append(f"  targets: all {len(checks)} met" if not missed else
                 f"  targets: {len(checks) - len(missed)} of {len(checks)} met; MISSED: "
                 + "; ".join(missed))
    return "\n".join(lines)


def _aggregated_lines(a: dict, verdicts) -> list[str]:
    """An aggregated case's lines: its rate, its cost per request against the P/D run of the
    same trace, and with 10x outputs (``verdicts``: MET or MISSED for the two goals)."""
    spread = a["per_repeat"]["per_request_vs_disaggregated"]
    each = (f"; each repeat {min(spread):.2f}-{max(spread):.2f}x" if len(spread) > 1 else "")
    return [
        f"  {'aggregated %dx A100 TP4' % a['num_instances']:<25}"
        f"{a['requests_per_bare_event']:>12.4f}   requests per bare event (SLO attainment "
        f"{100 * a['slo_attainment']:.1f}%; {a['wakeups_per_request']:.2f} timer firings "
        f"per request)",
        f"    per request vs P/D     {a['per_request_vs_disaggregated']:>12.2f}x CPU "
        f"({a['wall_s']:.2f} s vs {a['disaggregated_wall_s']:.2f} s for the P/D run of the "
        f"same trace, timed beside it{each}; target <= "
        f"{AGGREGATED_VS_DISAGGREGATED_TARGET:g}x)  {next(verdicts)}",
        f"    10x longer outputs     {a['long_output_wall_ratio']:>12.2f}x CPU per request "
        f"(the same requests at 1/10 the rate, the same output tokens/s; "
        f"{a['long_output_per_token_ratio']:.3f}x per output token; "
        f"{a['long_output_wakeups_per_request']:.2f} firings per request; target < "
        f"{LONG_OUTPUT_RATIO_TARGET:g}x per request)  {next(verdicts)}"]
