"""``hawk real transfer-bench``'s report: the per-size measurements
(``hardware.transfer_bench.measure``) summed into throughputs and ratios, and the table in
Figure 9's shape."""

from __future__ import annotations

import os

from hardware.mechanisms import MECHANISMS


def summarize(args, per_size: list[dict]) -> dict:
    """The report of a run over ``args.sizes``: latency rows, raw socket and transport
    throughput over all sizes and the largest, CPU per GB, the integrity check's cost."""
    total = sum(p["nbytes"] for p in per_size)
    raw = total / sum(p["raw_socket_s"] for p in per_size) / 1e9
    moved = total / sum(p["transport_s"] for p in per_size) / 1e9
    largest = per_size[-1]
    checked = total / sum(p["checked_pull_s"] for p in per_size) / 1e9
    unchecked = total / sum(p["unchecked_pull_s"] for p in per_size) / 1e9
    return {
        "integrity": {"check": "HMAC-SHA256 per segment, keyed by the run token",
                      "checked_pull_gb_per_s": checked, "unchecked_pull_gb_per_s": unchecked,
                      "checked_to_unchecked": checked / unchecked},
        "rows": [r for p in per_size for r in p["rows"]],
        "raw_socket_gb_per_s": raw,
        "transport_gb_per_s": moved,
        "transport_to_raw_socket": moved / raw,
        "largest_size_mb": args.sizes[-1],
        "largest_raw_socket_gb_per_s": largest["nbytes"] / largest["raw_socket_s"] / 1e9,
        "largest_transport_gb_per_s": largest["nbytes"] / largest["transport_s"] / 1e9,
        "per_size": [{"size_mb": s, "nbytes": p["nbytes"],
                      "raw_socket_gb_per_s": p["nbytes"] / p["raw_socket_s"] / 1e9,
                      "transport_gb_per_s": p["nbytes"] / p["transport_s"] / 1e9,
                      "raw_socket_cpu_s_per_gb": p["raw_socket_cpu_s_per_gb"],
                      "transport_cpu_s_per_gb": p["transport_cpu_s_per_gb"],
                      "checked_pull_gb_per_s": p["nbytes"] / p["checked_pull_s"] / 1e9,
                      "unchecked_pull_gb_per_s": p["nbytes"] / p["unchecked_pull_s"] / 1e9}
                     for s, p in zip(args.sizes, per_size)],
        "transport": args.transport, "device": args.device, "repeats": args.repeats,
    }


def format_table(report: dict) -> str:
    """Figure 9's shape: latency per size and mechanism, and the paper's ratios."""
    rows = report["rows"]
    mechs = [m for m in MECHANISMS if any(r["mechanism"] == m for r in rows)]
    sizes = sorted({r["size_mb"] for r in rows})
    lat = {(r["size_mb"], r["mechanism"]): r["latency_s"] for r in rows}
    ratios = [("GN-Host/GG-Host", "GN-Host", "GG-Host", "x"),
              ("GG-Direct/GG-Host", "GG-Direct", "GG-Host", "%"),
              ("GN-HAWK/GG-Host", "GN-HAWK", "GG-Host", "%")]
    ratios = [r for r in ratios if r[1] in mechs and r[2] in mechs]
    head = f"{'size MB':>8} " + " ".join(f"{m + ' ms':>13}" for m in mechs) + \
        "".join(f" {name:>18}" for name, *_ in ratios)
    lines = [f"KV transfer latency ({report['transport']}, prefill on {report['device']}, "
             f"median of {report['repeats']})", head]
    for s in sizes:
        cells = " ".join(f"{1e3 * lat[(s, m)]:>13.2f}" for m in mechs)
        for _, a, b, unit in ratios:
            q = lat[(s, a)] / lat[(s, b)]
            cells += f" {q:>17.2f}x" if unit == "x" else f" {100 * q:>17.2f}%"
        lines.append(f"{s:>8g} {cells}")
    lines.append(f"raw loopback socket {report['raw_socket_gb_per_s']:.3f} GB/s, transport "
                 f"{report['transport_gb_per_s']:.3f} GB/s, ratio "
                 f"{report['transport_to_raw_socket']:.2f}x (largest size "
                 f"{report['largest_size_mb']:g} MB: "
                 f"{report['largest_transport_gb_per_s']:.3f} / "
                 f"{report['largest_raw_socket_gb_per_s']:.3f} GB/s)")
    last = report["per_size"][-1]
    raw_cpu, moved_cpu = last["raw_socket_cpu_s_per_gb"], last["transport_cpu_s_per_gb"]
    lines.append(f"CPU seconds per GB moved, both processes, largest size: raw socket "
                 f"{raw_cpu:.3f}, transport {moved_cpu:.3f} (transport "
                 f"{moved_cpu / raw_cpu if raw_cpu > 0 else float('nan'):.2f}x the raw "
                 f"socket's CPU per GB, on {os.cpu_count()} cores)")
    if "integrity" in report:
        i = report["integrity"]
        lines.append(f"integrity ({i['check']}): whole pulls {i['checked_pull_gb_per_s']:.3f} "
                     f"GB/s checked, {i['unchecked_pull_gb_per_s']:.3f} GB/s unchecked "
                     f"({i['checked_to_unchecked']:.2f}x)")
    return "\n".join(lines)
