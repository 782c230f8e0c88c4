"""``hawk simulate``: one run (in memory, streamed or in cells) of a config, a workload or a
trace file, and the summary it prints. ``add_parser`` adds its flags, ``run`` runs it."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from traces import metrics
from sim.config import ConfigError, RunConfig
from traces.trace_flags import add_columns_arg
from traces.jsonout import dumps, writable_dir
from sim.commands.args import (add_common, add_max_memory, add_max_wall, add_profile, add_ray,
                               add_workers, announce, config_from_args)
from sim.engine.pools import describe_pools


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_summary(summary: dict, config: RunConfig, trace_name: str | None = None) -> str:
    cl = config.cluster
    load = (f"trace {trace_name}" if trace_name else
            f"workload {config.workload.name} @ {config.workload.rate:g} req/s, seed {config.seed}")
    model = f"measured profile {cl.profile}" if "profile" in summary else cl.model
    head = (f"{model}: prefill {cl.prefill.num_instances}x({cl.prefill.tp}x {cl.prefill.device})"
            f" -> decode {cl.decode.num_instances}x({cl.decode.tp}x {cl.decode.device}) via "
            f"{cl.link.mechanism}, {load}")
    if cl.kind != "disaggregated":            # an aggregated pool (sim.engine.pools)
        head = f"{model}: {describe_pools(cl)}, {load}"
    rows = [("requests", summary["num_requests"]), ("finished ok", summary["num_finished"]),
            ("failed", summary["num_failed"]), ("unfinished", summary["num_unfinished"]),
            ("SLO attainment", f"{100 * summary['slo_attainment']:.1f}% "
                               f"(TTFT {summary['ttft_slo_s']:g} s, TPOT {summary['tpot_slo_s']:g} s)")]
    for name in ("ttft", "tpot", "e2e"):
        rows.append((f"{name.upper()} p50/p90/p99 (s)", " / ".join(
            _fmt(summary[f"{name}_p{q}_s"]) for q in (50, 90, 99))))
    if "percentiles" in summary:            # a streamed run (sim.engine.stream)
        rows.append(("percentiles", f"sketched ({summary['percentiles']['method']}), within "
                     f"{summary['percentiles']['relative_accuracy']:.0%} relative error"))
    rows += [("output tokens/s", _fmt(summary["output_tokens_per_s"])),
             ("tokens per joule", _fmt(summary["tokens_per_joule"])),
             ("tokens/s per $1k of devices", _fmt(1e3 * summary["tokens_per_s_per_dollar"])),
             ("$ per successful request", _fmt(summary["usd_per_request"])),
             ("simulated time (s)", _fmt(summary.get("simulated_time_s", math.nan))),
             ("wall time (s)", _fmt(summary.get("sim_wall_time_s", math.nan)))]
    rows += _capacity_rows(summary, cl.kind)
    if "prefix_cache_hit_rate" in summary:   # prefix caching on (sim.engine.prefix_cache)
        rows.append(("prefix cache hit rate", f"{percent(summary['prefix_cache_hit_rate'])} "
                     f"({summary['prefix_cache_hit_tokens']:,} of "
                     f"{summary['prefix_cache_query_tokens']:,} prompt tokens cached)"))
    if "decode_prefix_cache_hit_rate" in summary:
        rows.append(("decode prefix cache", f"{percent(summary['decode_prefix_cache_hit_rate'])}"
                     f" of the prompt tokens pulled were on the decode side already (not "
                     f"moved)"))
    rows += _offered_rows(summary)
    rows += _profile_rows(summary.get("profile"))
    for k, reason in enumerate(metrics.failure_reasons(summary["statuses"])):
        rows.append(("failures" if k == 0 else "", reason))
    width = max(len(k) for k, _ in rows)
    text = "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])
    if summary.get("tenants"):
        from traces.tenants import format_tenants

        text += "\n  per tenant:\n" + format_tenants(summary["tenants"])
    return text


#: TTFT stages that are zero by construction in the simulator, and why (shown as such, not
#: as a measured ``0 / 0``): the prefill side emits the first token, which reaches the client
#: as the request's KV cache lands on the decode side (``sim.engine.decode``)
ZERO_BY_CONSTRUCTION = {"first_decode": "none: the first token arrives with the KV cache "
                                        "(the prefill side computes it)"}


def _capacity_rows(summary: dict, kind: str = "disaggregated") -> list[tuple[str, str]]:
    """What limits capacity, and what each stage adds to TTFT (mean / P90).

    Busy share: the time a stage is working. A decode instance iterates whenever one request
    is in its batch, so its busy share nears 100% at any load; its load is the decode load:
    the time-averaged requests past their first token (decoding, or waiting on the decode
    side for a batch slot) per batch slot, which passes 100% when a queue waits there. The
    most loaded stage is the highest of prefill busy, link busy and decode load."""
    rows = []
    if "aggregated_utilization" in summary:   # an aggregated pool (sim.engine.pools.pool_use)
        rows.append(("utilisation" if kind == "aggregated" else
                     "aggregated pool", _pool_use(summary)))
    if "bottleneck" in summary and kind != "aggregated":
        shares = " / ".join(f"{name} {percent(summary[f'{name}_utilization'])}"
                            for name in ("prefill", "link", "decode"))
        rows.append(("utilisation", f"{shares} busy (share of the time working)"))
        if "decode_occupancy" in summary:
            load = summary["decode_occupancy"]
            rows.append(("decode load", f"{percent(load)} of batch slots (requests past their "
                         f"first token per slot" + ("; over 100%: a queue waits for slots)"
                                                    if load > 1 else ")")))
        rows.append(("most loaded", f"{summary['bottleneck']} (the highest of prefill busy, "
                     f"link busy and decode load)"))
    for stage, _, _ in metrics.TTFT_STAGES:
        mean, p90 = summary.get(f"ttft_{stage}_mean_s"), summary.get(f"ttft_{stage}_p90_s")
        name = f"TTFT {stage.replace('_', ' ')}"
        if stage in ZERO_BY_CONSTRUCTION and mean == 0 and p90 == 0:
            rows.append((name, ZERO_BY_CONSTRUCTION[stage]))
        elif mean is not None and not (math.isnan(mean) and math.isnan(p90)):
            rows.append((f"{name} mean/P90 (s)", f"{_fmt(mean)} / {_fmt(p90)}"))
    return rows


def _offered_rows(summary: dict) -> list[tuple[str, str]]:
    """A trace run's offered load (requests over the span of their arrivals) and, when a
    stage is saturated and attainment is low, the hint that the rate is past the cluster's
    capacity."""
    rows = []
    offered = summary.get("trace", {}).get("offered")
    if offered is not None:
        rows.append(("offered load", f"{offered['num_requests']:,} requests over "
                     f"{offered['span_s']:,.4g} s = {offered['rate']:.4g} req/s"))
    saturated = [name for name in ("prefill", "link")
                 if summary.get(f"{name}_utilization", 0) >= SATURATED]
    if summary.get("decode_occupancy", 0) >= 1:
        saturated.append("decode")
    if saturated and summary.get("slo_attainment", 1) < 0.5:
        rows.append(("hint", f"{', '.join(saturated)} saturated: the offered rate is past "
                     f"this cluster's capacity, so queues grow and SLOs are missed; offer "
                     f"less (--rate, --rate-scale below 1) or add instances (hawk sweep "
                     f"finds the knee of a config)"))
    return rows


#: a busy share at or past this is saturated (queues grow)
SATURATED = 0.95


def _pool_use(summary: dict) -> str:
    names = {"steps": "busy", "kv_blocks": "KV blocks", "batch_slots": "batch slots"}
    share = lambda v: "n/a" if v is None or math.isnan(v) else f"{100 * v:.2g}%"
    return (f"aggregated {percent(summary['aggregated_utilization'])} busy, KV blocks "
            f"{share(summary['aggregated_kv_use'])}, batch slots "
            f"{share(summary['aggregated_slot_use'])} (most loaded: "
            f"{names.get(summary['aggregated_bottleneck'], 'n/a')}; "
            f"{percent(summary.get('aggregated_compute_bound_share'))} of busy time "
            f"compute-bound)")


def _profile_rows(profile: dict | None) -> list[tuple[str, str]]:
    """A measured profile's run: whether the profile is whole, and where the run extrapolated."""
    if profile is None:
        return []
    rows = [] if profile["complete"] else [("profile", "incomplete (complete = false): some "
                                                      "points not measured yet")]
    for k, (axis, span) in enumerate(profile["extrapolated"].items()):
        (mlo, mhi), (ulo, uhi) = span["measured"], span["used"]
        rows.append(("extrapolated" if k == 0 else "",
                     f"{axis}: used {ulo:g}..{uhi:g}, measured {mlo:g}..{mhi:g}"))
    return rows


def percent(value) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate one run (default: the paper's Chatbot scenario)")
    add_common(p)
    p.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (default 0.5)")
    p.add_argument("--trace", type=Path, help="replay a trace file instead of Poisson arrivals; "
                   "a bare name may be a bundled trace: azure-llm-2023-conv.csv, "
                   "azure-llm-2023-code.csv (traces/data/)")
    p.add_argument("--trace-format", help="trace format (default: detected from the header)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream records to --out/records.parquet (a dataset of row groups) as "
                        "requests end and summarise from streaming aggregates, in bounded "
                        "memory (percentiles within 1%%); default: only runs over 1,000,000 "
                        "requests stream")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed trace rows, reported")
    add_columns_arg(p)
    p.add_argument("--rate-scale", type=float, metavar="FACTOR",
                   help="replay the trace FACTOR times as fast (2 = twice the request rate)")
    p.add_argument("--window", metavar="START:END",
                   help="seconds of the trace to keep (re-based to 0), before --rate-scale")
    p.add_argument("--oracle", action="store_true", help="iteration-by-iteration decode (slow)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep prompts' KV blocks for prompts that share their prefix (the "
                        "trace's hash_ids) on every instance; a decode instance pulls only "
                        "what it lacks (prefix_caching = true in [cluster.prefill], "
                        "[cluster.decode], [cluster.aggregated])")
    p.add_argument("--show-config", action="store_true",
                   help="print every resolved setting and where it came from (the config "
                        "file, the device's default or the scenario's), then stop")
    p.add_argument("--out", type=Path, help="write records.parquet and summary.json here")
    p.add_argument("--cells", type=int, metavar="N",
                   help="simulate the cluster as N independent cells (router domains), the "
                        "requests split by a hash of their id ([cells] in the config)")
    p.add_argument("--cell-instances", choices=("split", "per-cell"),
                   help="split: the cluster's instances divided among the cells (default); "
                        "per-cell: every cell has the cluster's instances")
    add_workers(p, "processes running cells")
    add_ray(p, "the cells")
    add_profile(p)
    add_max_wall(p)
    add_max_memory(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.engine.cluster import simulate, workload_trace
    from traces.schema import write_records

    config = config_from_args(args)
    if args.show_config:
        from sim.config import format_provenance, provenance

        from sim.models.profile_dir import describe_ranges, is_profile_dir

        ranges = describe_ranges(config) if is_profile_dir(config.cluster.profile) else None
        if args.json:
            print(dumps({**provenance(config), **({"measured_ranges": ranges} if ranges else {})}))
        else:
            print(format_provenance(config))
            if ranges:
                print("# measured ranges (" + config.cluster.profile + "); past them the run "
                      "extrapolates:\n" + "\n".join(f"#   {line}" for line in ranges))
        return 0
    if args.out is not None:
        writable_dir(args.out)
    trace, trace_info = _trace_for(args, config)
    if config.cells.count > 1:
        return _simulate_cells(args, config, trace, trace_info)
    if args.workers is not None or args.ray is not None:
        raise ConfigError("--workers and --ray run cells side by side; give --cells N "
                          "(or [cells] count in the config)")
    stream = _stream_for(args, config, trace)
    _announce(args, config, trace, streamed=stream is not None)
    if trace is None and stream is None:
        trace = workload_trace(config)
    result = simulate(config, trace, progress=not args.json, stream=stream)
    if trace_info is not None:
        result.summary["trace"] = trace_info
    if args.out is not None:
        if stream is None:
            write_records(result.records, args.out / "records.parquet")
        (args.out / "summary.json").write_text(dumps(result.summary, indent=2) + "\n")
    if args.json:
        print(dumps(result.summary))
    else:
        print(format_summary(result.summary, config,
                             Path(trace_info["path"]).name if trace_info else None))
        if args.out is not None:
            print(f"records and summary written to {args.out}/")
    return 0


def _simulate_cells(args, config: RunConfig, trace, trace_info) -> int:
    """``hawk simulate`` of a cluster of cells (``sim.runs.cells.run``): the merged records and
    summary, and the run's timing (``cells.json``: wall-clock times stay out of the summary,
    which is the same bytes however the cells ran)."""
    from functools import partial

    from sim.runs.cells.run import simulate_cells
    from sim.runs.cells.stream import simulate_cells_streamed

    import os

    stream = _stream_for(args, config, trace)       # each cell streams; aggregates merge
    count = config.cells.count
    _announce(args, config, trace, streamed=stream is not None, cells=count,
              in_parallel=min(count, args.workers or os.cpu_count() or 1))
    run = simulate_cells if stream is None else partial(simulate_cells_streamed, stream=stream)
    result = run(config, trace, workers=args.workers, ray_address=args.ray,
                 records_path=args.out / "records.parquet" if args.out else None,
                 progress=not args.json)
    summary = result.summary
    if trace_info is not None:
        summary["trace"] = trace_info
    if args.out is not None:
        (args.out / "summary.json").write_text(dumps(summary, indent=2) + "\n")
        (args.out / "cells.json").write_text(dumps(result.timing, indent=2) + "\n")
    shown = {**summary, "sim_wall_time_s": result.timing["wall_time_s"]}
    if args.json:
        print(dumps(shown))
        return 0
    cells = summary["cells"]
    from sim.runs.cells.run import whole_cluster

    print(format_summary(shown, whole_cluster(config),
                         Path(trace_info["path"]).name if trace_info else None))
    print(f"  cells: {cells['count']} of {cells['prefill_instances_per_cell']} prefill + "
          f"{cells['decode_instances_per_cell']} decode instances, {cells['split_rule']}; "
          f"{result.timing['backend']}, workers {args.workers or 'one per core'}")
    if args.out is not None:
        print(f"records (with a cell column), summary and cells.json written to {args.out}/")
    return 0


def _announce(args, config: RunConfig, trace, streamed: bool, cells: int = 1,
              in_parallel: int = 1) -> None:
    """The run's estimate (requests, wall time, peak memory) on stderr when it is long, and
    refused past ``--max-wall-s``; a trace file read in blocks is counted once it is read."""
    from sim.config.run_size import expected_num_requests, run_bytes
    from traces.chunks import RequestSource

    n = len(trace) if trace is not None else expected_num_requests(config.workload)
    if n is None:
        return
    held = trace is not None and not isinstance(trace, RequestSource)
    peak = in_parallel * run_bytes(n / cells, streamed, trace_held=held)
    announce("hawk simulate", n / cells, args.max_wall_s, copies_in_turn=cells,
             in_parallel=in_parallel, peak_bytes=peak, quiet=args.json)


def _announce_file(args, config: RunConfig, path: Path, num: int | None,
                   whole_file: bool) -> None:
    """Before a trace file is read: its rows estimated from its size, read twice (the scan
    and the run's read) or once (``--no-stream``), and the run; refused past --max-wall-s,
    and, loaded whole (``--no-stream``), past --max-memory-gb."""
    import os

    from sim.config.run_size import SECONDS_PER_TRACE_ROW, check_trace_load, run_bytes
    from traces.trace_stream import estimate_rows

    rows = estimate_rows(path)
    n = rows if num is None else min(rows, num)
    reads = 1 if args.stream is False else 2
    read_s = reads * (rows if whole_file else n) * SECONDS_PER_TRACE_ROW
    cells = config.cells.count
    in_parallel = min(cells, args.workers or os.cpu_count() or 1)
    what = (f"hawk simulate --trace {path.name} (about {rows:,} rows by its size, read "
            f"{'once' if reads == 1 else 'twice'})")
    peak = None
    if args.stream is False:                # loaded whole: its rows, then the run
        peak = check_trace_load(rows if whole_file else n, in_parallel * run_bytes(n / cells),
                                args.max_memory_bytes, what, "read it in blocks (--stream), "
                                "or load fewer rows (--num-requests)")
    announce(what, n / cells, args.max_wall_s, copies_in_turn=cells, quiet=args.json,
             in_parallel=in_parallel, what=what, extra_s=read_s, peak_bytes=peak)


def _stream_for(args, config: RunConfig, trace):
    """How ``simulate`` streams (``sim.engine.stream``): records into ``--out``/records.parquet as a
    dataset; None for the in-memory path. ``--stream``/``--no-stream`` decide, else size."""
    from sim.config.run_size import expected_num_requests
    from sim.engine.stream import Stream, use_streaming
    from traces.chunks import RequestSource

    n = len(trace) if trace is not None else expected_num_requests(config.workload)
    if n is None:                           # the config's trace file, not yet read
        n = config.workload.num_requests
    in_blocks = isinstance(trace, RequestSource)    # a trace file that _trace_for streams
    if not (in_blocks or use_streaming(n, args.stream)):
        return None
    return Stream(args.out / "records.parquet" if args.out is not None else None)


def _trace_for(args, config: RunConfig):
    """The trace ``simulate`` replays (``--trace``, else the config's ``workload.trace``),
    shaped by ``--window`` then ``--rate-scale`` and cut by ``--num-requests`` /
    ``--duration``, with what loading and shaping did; ``(None, None)`` for Poisson arrivals.

    Only the rows needed are read when no window is cut (``--num-requests`` streams)."""
    path = args.trace or (Path(config.workload.trace) if config.workload.trace else None)
    if path is None:
        for flag in ("--rate-scale", "--window"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise ConfigError(f"{flag} shapes a trace's arrivals; give --trace (Poisson "
                                  f"arrivals take --rate)")
        return None, None
    from dataclasses import asdict

    from traces.shaping import ShapeSpec, offered_load, parse_window, shape

    if args.rate is not None:
        raise ConfigError(f"--rate sets a Poisson arrival rate, but the arrivals come from the "
                          f"trace {path.name}; use --rate-scale to replay it faster or slower "
                          f"(2 = twice the request rate)")
    from traces.loaders import load_trace

    from_flags = args.trace is not None
    num = args.num_requests if from_flags else config.workload.num_requests
    duration = args.duration if from_flags else config.workload.duration_s
    start, end = parse_window(args.window)
    spec = ShapeSpec(start_s=start, end_s=end,
                     rate_scale=1.0 if args.rate_scale is None else args.rate_scale)
    _announce_file(args, config, path, num, whole_file=args.window is not None)
    if args.stream is not False:            # read in blocks, never whole (traces.trace_stream)
        from sim.config.run_size import STREAM_MIN_REQUESTS
        from traces.trace_stream import open_stream

        streamed = open_stream(path, args.trace_format, args.skip_bad, num, duration, spec,
                               args.window is not None, quiet=args.json,
                               longer_than=None if args.stream else STREAM_MIN_REQUESTS,
                               mapping=args.columns)
        if streamed is not None:            # else short (or unsorted): loaded whole below
            return streamed
    trace, report = load_trace(path, args.trace_format, skip_bad=args.skip_bad,
                               mapping=args.columns,
                               max_requests=num if args.window is None else None)
    trace, shaped = shape(trace, spec)
    if num is not None:
        trace = trace.head(num)
    if duration is not None:
        trace = trace.until(duration)
    if len(trace) == 0:
        raise ConfigError(f"{path}: no requests left to simulate after --window {args.window} "
                          f"and --duration {duration} ({shaped.describe()})")
    if not args.json:
        print(report.describe() + "\n  shaping: " + shaped.describe(), file=sys.stderr)
    return trace, {"path": str(path), "load": report.as_dict(), "shaping": asdict(shaped),
                   "num_simulated": len(trace), "offered": offered_load(
                       len(trace), float(trace.arrival_at[-1] - trace.arrival_at[0]))}
