"""``hawk real ...``: the real-mode command group (registered by ``sim.commands.main`` when present)."""

from __future__ import annotations

import argparse
import sys

from hardware import bench_plan
from hardware.mechanisms import MECHANISMS
from hardware.transfer_bench import DEFAULT_SIZES_MB, START_TIMEOUT_S
from traces.jsonout import dumps


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"sizes {text!r}: comma-separated MB values") from e
    if not sizes or not all(0 < s < float("inf") for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes {text!r}: need one or more sizes > 0 MB, finite")
    return sorted(sizes)


def _whole(flag: str, why: str = "", minimum: int = 1):
    """An argparse type for ``flag``: a whole number >= ``minimum``, refused by the flag's name."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a whole number >= {minimum}") \
                from e
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{flag} {n}: need >= {minimum}{why}")
        return n
    return parse


#: ``--seed``: numpy's generators refuse a negative seed, which would otherwise fail inside a
#: child process
_seed = _whole("--seed", minimum=0)


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"start-timeout {text!r}: seconds > 0") from e
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"start-timeout {text}: seconds > 0")
    return s


def _max_wall(text: str) -> float:
    try:
        s = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--max-wall-s {text!r}: seconds > 0 (inf: no "
                                         f"limit)") from e
    if not s > 0:
        raise argparse.ArgumentTypeError(f"--max-wall-s {s:g}: must be > 0")
    return s


def _mechanisms(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MECHANISMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"mechanisms {bad or text!r}: allowed "
                                         f"{', '.join(MECHANISMS)}")
    return names


def cmd_transfer_bench(args) -> int:
    from hardware import transfer_bench
    from hardware.transport import TransportError

    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("transfer-bench: --device cuda asked for, but torch sees no CUDA device")
            return 2
    try:                                  # bad sizes, layer counts, memory, time: up front
        transfer_bench.check_memory(args.sizes)
        for size in args.sizes:
            transfer_bench.check_request(size, args.num_layers)
        bench_plan.check(args.sizes, args.mechanisms, args.repeats, args.max_wall_s)
    except transfer_bench.BenchFailed as e:         # TooLong too
        print(f"transfer-bench: {e}")
        return 2
    print(bench_plan.estimate_line(args.sizes, args.mechanisms, args.repeats),
          file=sys.stderr, flush=True)
    try:
        report = transfer_bench.run(args)
    except TransportError as e:
        print(f"transfer-bench: {type(e).__name__}: {e}")
        return 1
    except transfer_bench.BenchFailed as e:
        print(f"transfer-bench: {e}")
        return 1
    if args.json:
        keys = ("rows", "raw_socket_gb_per_s", "transport_gb_per_s", "transport_to_raw_socket",
                "integrity", "per_size", "transport", "device", "repeats")
        print(dumps({k: report[k] for k in keys}))
    else:
        print(transfer_bench.format_table(report))
    return 0


def _cluster_config(args):
    from hardware.serve.cluster import ClusterConfig
    extra = ["--num-tokens", str(args.decode_tokens), "--send-buffer-mb", str(args.send_buffer_mb),
             "--max-batch-tokens", str(args.max_batch_tokens)]
    if args.cuda_prefill is False:
        extra += ["--device", "cpu"]
    return ClusterConfig(num_prefill=args.num_prefill, num_decode=args.num_decode,
                         mechanism=args.mechanism, kv_dtype=args.kv_dtype, host=args.host,
                         model=args.model, seed=args.seed, worker_args=extra,
                         shape=args.shape, num_aggregated=args.num_aggregated)


def _workers_line(args) -> str:
    if args.shape == "aggregated":
        return f"{args.num_aggregated} aggregated, no KV transfer"
    return f"{args.num_prefill} prefill, {args.num_decode} decode, {args.mechanism}"


def cmd_serve(args) -> int:
    """Start a router and workers, print the endpoint once they are warm, serve until Ctrl-C
    or SIGTERM; a child that exits meanwhile is collected and named."""
    import time

    from hardware.serve.cluster import ClusterError, LocalCluster
    from hardware.lifecycle import terminate_as_interrupt

    from hardware.serve.cluster import shape_conflict

    conflict = shape_conflict(args)
    if conflict:
        print(f"real serve: {conflict}", file=sys.stderr)
        return 2
    terminate_as_interrupt()
    cluster = LocalCluster(_cluster_config(args), log_dir=args.logs)
    try:
        cluster.start()
    except ClusterError as e:
        print(f"real serve: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        print(f"serving on {cluster.endpoint}/v1/completions ({_workers_line(args)}); "
              f"Ctrl-C stops", flush=True)
        seen: set[str] = set()
        while cluster.router.poll() is None:
            time.sleep(1.0)
            for name in sorted(set(cluster.reap()) - seen):
                print(f"real serve: {name} exited", file=sys.stderr, flush=True)
                seen.add(name)
        print(f"real serve: the router exited with {cluster.router.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def cmd_run(args) -> int:
    """Replay a trace or workload through a local cluster; records and summary like simulate."""
    from pathlib import Path

    from hardware.serve.cluster import ClusterError
    from hardware.serve.run import RealRunConfig, fit_to_context, real_run
    from traces.commands import slos
    from traces.workloads import make_workload, workload_spec

    from hardware.serve.cluster import shape_conflict

    conflict = shape_conflict(args)
    if conflict:
        print(f"real run: {conflict}", file=sys.stderr)
        return 2
    try:
        if args.trace:
            from traces.loaders import load_trace
            trace, _ = load_trace(args.trace)
            if args.num_requests:
                trace = trace.head(args.num_requests)
        else:
            spec = workload_spec(args.workload)
            trace = make_workload(spec.name, args.rate, num_requests=args.num_requests,
                                  seed=args.seed)
        ttft, tpot = slos(args)
    except (ValueError, OSError) as e:
        print(f"real run: {e}")
        return 2
    _, scale = fit_to_context(trace, args.context)
    if scale < 1:
        print(f"real run: lengths scaled by {scale:.3f} to fit the tiny model's context of "
              f"{args.context} tokens", file=sys.stderr)
    config = RealRunConfig(_cluster_config(args), ttft, tpot, args.context,
                           progress=not args.json)
    out = Path(args.out) if args.out else None
    from hardware.lifecycle import terminate_as_interrupt
    terminate_as_interrupt()                # timeout(1), kill: as Ctrl-C, records written
    try:
        summary = real_run(trace, config, out)
    except ClusterError as e:
        print(f"real run: {e}")
        return 1
    except KeyboardInterrupt:
        print("real run: interrupted before the trace started; nothing recorded",
              file=sys.stderr)
        return 130
    if args.json:
        print(dumps(summary))
        return 0
    rows = [("requests", summary["num_requests"]), ("finished ok", summary["num_finished"]),
            ("failed", summary["num_failed"]), ("statuses", summary["statuses"]),
            ("SLO attainment", f"{100 * summary['slo_attainment']:.1f}%"),
            ("TTFT p50 / p90 (s)", f"{summary['ttft_p50_s']:.3f} / {summary['ttft_p90_s']:.3f}"),
            ("TPOT p50 / p90 (s)", f"{summary['tpot_p50_s']:.4f} / {summary['tpot_p90_s']:.4f}"),
            ("transfer share of TTFT", f"{summary['ttft_transfer_mean_s'] / summary['ttft_mean_s']:.1%}"
             if summary["ttft_mean_s"] > 0 and summary["shape"] != "aggregated" else "-"),
            ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
            ("energy (J)", f"{summary['energy_j']:.1f} ({summary['power_source'].split(';')[0]})"),
            ("length scale", f"{summary['length_scale']:.3f}")]
    for name, value in rows:
        print(f"{name:<26}{value}")
    if out:
        print(f"records and summary written to {out}/")
    return 0 if not summary["interrupted"] else 130


def cmd_profile(args) -> int:
    """Measure prefill, decode and the KV path (or the aggregated worker's steps) into a
    profile directory (resumable)."""
    from hardware.serve import profile, profile_aggregated
    from hardware.transfer_bench import BenchFailed
    from hardware.transport import TransportError

    common = dict(model_dir=args.model, seed=args.seed, quick=args.quick, repeats=args.repeats,
                  force=args.force, device="cpu" if args.cuda_prefill is False else "auto")
    try:
        if args.shape == "aggregated":
            if args.mechanisms is not None:
                print("real profile: --mechanisms is for --shape disaggregated; --shape "
                      "aggregated moves no KV", file=sys.stderr)
                return 2
            report = profile_aggregated.run(args.out, **common)
        else:
            report = profile.run(args.out, mechanisms=args.mechanisms or list(MECHANISMS),
                                 **common)
    except profile.ProfileError as e:
        print(f"real profile: {e}", file=sys.stderr)
        return 2
    except (TransportError, BenchFailed) as e:
        print(f"real profile: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"real profile: interrupted; what was measured is in {args.out}/, and the same "
              f"command measures the rest", file=sys.stderr)
        return 130
    print(report["summary"])
    print(f"profile written to {args.out}/ ({report['num_measured']} points measured now)")
    return 0


def _serving_args(p) -> None:
    from hardware.mechanisms import MECHANISMS
    p.add_argument("--shape", choices=("disaggregated", "aggregated"), default="disaggregated",
                   help="prefill and decode workers with KV transfer between them (default), "
                        "or aggregated workers serving both phases of each request")
    p.add_argument("--num-aggregated", type=_whole("--num-aggregated"),
                   help="aggregated workers (--shape aggregated; default 1)")
    p.add_argument("--num-prefill", type=_whole("--num-prefill"),
                   help="prefill workers (default 1)")
    p.add_argument("--num-decode", type=_whole("--num-decode"),
                   help="decode workers (default 1)")
    p.add_argument("--mechanism", choices=MECHANISMS, help="KV transfer mechanism (default "
                                                           "GN-HAWK)")
    p.add_argument("--kv-dtype", choices=("bfloat8_b", "bfloat16"),
                   help="decode side's NPU tile format (GN mechanisms; default bfloat8_b)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--model", help="Hugging Face-format directory (default: seeded tiny Llama)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--decode-tokens", type=_whole("--decode-tokens"), default=16384,
                   help="KV capacity of each decode (or aggregated) worker, tokens")
    p.add_argument("--send-buffer-mb", type=float,
                   help="each prefill worker's send buffer (back-pressure when full; default 16)")
    p.add_argument("--max-batch-tokens", type=_whole("--max-batch-tokens"), default=2048,
                   help="prefill token budget per batch (aggregated: per step)")
    p.add_argument("--cpu-prefill", dest="cuda_prefill", action="store_false", default=None,
                   help="run prefill (aggregated: the whole worker) on the CPU even where "
                        "CUDA is present")
    p.add_argument("--logs", help="directory for the processes' logs")


def register(subparsers) -> None:
    """Add ``real`` with its leaf commands to a ``hawk`` subparsers object."""
    real = subparsers.add_parser("real", help="real mode: KV transfer over real transports")
    leaves = real.add_subparsers(dest="real_command", required=True)
    p = leaves.add_parser("transfer-bench",
                          help="Figure 9 on real bytes between two processes, with a raw "
                               "socket baseline measured in the same run")
    p.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES_MB),
        help="comma-separated KV sizes in MB (default 10..1280, doubling)")
    p.add_argument("--mechanisms", type=_mechanisms, default=list(MECHANISMS),
                   help=f"comma-separated subset of {', '.join(MECHANISMS)}")
    p.add_argument("--repeats", type=_whole("--repeats", " to take a median"), default=3,
                   help="median of this many (default 3)")
    p.add_argument("--transport", choices=("mooncake",), default="mooncake",
                   help="transport between the processes (Mooncake over TCP here)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the prefill side's cache and transformation live")
    p.add_argument("--num-layers", type=_whole("--num-layers"), default=4,
                   help="layers of the synthetic request (size is split over them)")
    p.add_argument("--start-timeout", dest="start_timeout_s", type=_seconds,
                   default=START_TIMEOUT_S,
                   help="seconds a prefill process may take to start serving (default %(default)g)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--max-wall-s", type=_max_wall, default=bench_plan.DEFAULT_MAX_WALL_S,
                   metavar="SECONDS", help="refuse a run estimated to take longer on this "
                   "machine (default %(default)g, inf: no limit)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_transfer_bench)

    p = leaves.add_parser("profile", help="measure prefill, decode and KV transfer times on "
                                          "the workers' code paths into a profile directory")
    p.add_argument("--out", required=True, help="the profile directory (resumed if it holds "
                                                "one measured with the same settings)")
    p.add_argument("--shape", choices=("disaggregated", "aggregated"), default="disaggregated",
                   help="the prefill and decode workers and the KV path (default), or the "
                        "aggregated worker's steps (prefill, decode and mixed)")
    p.add_argument("--quick", action="store_true", help="a few points per axis and a short serving "
                                                       "session (about a minute on 2 cores)")
    p.add_argument("--mechanisms", type=_mechanisms,
                   help=f"comma-separated subset of {', '.join(MECHANISMS)} (default all)")
    p.add_argument("--repeats", type=_whole("--repeats"),
                   help="measured runs per point after a warm-up (default 15, --quick 3)")
    p.add_argument("--model", help="Hugging Face-format directory (default: the seeded tiny "
                                   "Llama the workers build)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the tiny model's weights")
    p.add_argument("--cpu-prefill", dest="cuda_prefill", action="store_false", default=None,
                   help="measure prefill on the CPU even where CUDA is present")
    p.add_argument("--force", action="store_true",
                   help="start over in a directory holding other settings' profile")
    p.set_defaults(func=cmd_profile)

    p = leaves.add_parser("serve", help="start a router and prefill/decode workers; print the "
                                        "endpoint")
    _serving_args(p)
    p.set_defaults(func=cmd_serve)

    from traces.workloads import WORKLOADS
    p = leaves.add_parser("run", help="replay a trace or workload through a local cluster; "
                                      "records.parquet and summary.json as simulate writes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file (any format hawk replay reads)")
    src.add_argument("--workload", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=_whole("--num-requests"), default=50)
    p.add_argument("--rate", type=float, default=0.5,
                   help="requests/s for --workload (default 0.5, as hawk simulate)")
    p.add_argument("--context", type=_whole("--context"), default=512,
                   help="tokens a request may hold; longer traces are scaled down to fit")
    p.add_argument("--ttft-slo", type=float)
    p.add_argument("--tpot-slo", type=float)
    p.add_argument("--out", help="write records.parquet, summary.json and logs here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _serving_args(p)
    p.set_defaults(func=cmd_run)

    from hardware.serve import aggregated_router, aggregated_worker, router, worker
    p = leaves.add_parser("router", help="the router process alone (token in HAWK_RUN_TOKEN)")
    router.add_arguments(p)
    p.add_argument("--shape", choices=("disaggregated", "aggregated"), default="disaggregated",
                   help="in front of prefill and decode workers (default), or aggregated ones")
    p.set_defaults(func=lambda a: (aggregated_router if a.shape == "aggregated" else router)
                   .main(_without(_argv(a), "--shape")))
    p = leaves.add_parser("worker", help="a prefill, decode or aggregated worker process alone")
    worker.add_arguments(p)
    p.set_defaults(func=lambda a: (aggregated_worker if a.role == "aggregated" else worker)
                   .main(_argv(a)))


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag VALUE`` and ``flag=VALUE``."""
    out, skip = [], False
    for x in argv:
        if skip or x.startswith(flag + "="):
            skip = False
            continue
        if x == flag:
            skip = True
            continue
        out.append(x)
    return out


def _argv(args) -> list[str]:
    """The process's own arguments after ``real router`` / ``real worker``."""
    argv = sys.argv[1:]
    return argv[argv.index(args.real_command) + 1:]
