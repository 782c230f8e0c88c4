"""``hawk real ...``: the real-mode command group (registered by ``sim.cli`` when present)."""

from __future__ import annotations

import argparse
import json

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


def _repeats(text: str) -> int:
    try:
        n = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"repeats {text!r}: a whole number >= 1") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"repeats {n}: need >= 1 to take a median")
    return n


def _layers(text: str) -> int:
    try:
        n = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"num-layers {text!r}: a whole number >= 1") from e
    if n < 1:
        raise argparse.ArgumentTypeError(f"num-layers {n}: need >= 1")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"start-timeout {text!r}: seconds > 0") from e
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"start-timeout {text}: seconds > 0")
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
    try:                                  # bad sizes, layer counts, memory: before starting
        transfer_bench.check_memory(args.sizes)
        for size in args.sizes:
            transfer_bench.check_request(size, args.num_layers)
    except transfer_bench.BenchFailed as e:
        print(f"transfer-bench: {e}")
        return 2
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
    p.add_argument("--repeats", type=_repeats, default=3, help="median of this many (default 3)")
    p.add_argument("--transport", choices=("mooncake",), default="mooncake",
                   help="transport between the processes (Mooncake over TCP here)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the prefill side's cache and transformation live")
    p.add_argument("--num-layers", type=_layers, default=4,
                   help="layers of the synthetic request (size is split over them)")
    p.add_argument("--start-timeout", dest="start_timeout_s", type=_seconds,
                   default=START_TIMEOUT_S,
                   help="seconds a prefill process may take to start serving (default %(default)g)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_transfer_bench)
