"""Benchmark: one Llama-3.1-70B request's KV transfer, plan by plan, and the HAWK transformation.

Prints, for a request of ``tokens`` tokens on one GPU rank -> one NPU chip (TP ``tp`` on both
sides, the same rank on both), the number of writes each mechanism's plan needs, and the
transformation's throughput against a plain torch copy of the same bytes, measured in the same
run on the same device (CPU, or CUDA when asked and present).

    python -m hardware.layout_bench [--tokens 4096] [--device cpu|cuda] [--threads 1[,2...]]
                                    [--path auto|portable|avx2|avx512|all[,...]] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from hardware.allocator import ContiguousAllocator, ReceiveAllocator
from hardware.dram import blackhole_p150a, wormhole
from hardware.kv_layout import GpuKVSpec, TTKVSpec, kv_head_range
from hardware.mechanism_plans import RequestTransfer, all_plans

LLAMA_70B = dict(num_layers=80, num_kv_heads=8, head_dim=128)   # docs/facts.md 7
DRAMS = {"p150a": blackhole_p150a, "wormhole": wormhole}


def make_transfer(tokens: int, tp: int, dram: str, dtype: str, num_layers: int,
                  seed: int = 0) -> RequestTransfer:
    """Rank 0's share of a 70B request: GPU blocks scattered, TT blocks from the allocator."""
    heads = len(kv_head_range(LLAMA_70B["num_kv_heads"], tp, 0))
    n_gpu = -(-tokens // 16)
    gpu = GpuKVSpec(num_layers=num_layers, num_blocks=2 * n_gpu, num_kv_heads=heads,
                    head_size=LLAMA_70B["head_dim"])
    tt = TTKVSpec(num_layers=num_layers, max_num_blocks=2 * -(-tokens // 32),
                  num_kv_heads=heads, head_dim=LLAMA_70B["head_dim"], dram=DRAMS[dram](),
                  dtype=dtype)
    table = np.random.default_rng(seed).permutation(gpu.num_blocks)[:n_gpu]
    tt_blocks = ReceiveAllocator(tt).reserve("r", tokens)
    return RequestTransfer(gpu, tt, table, tt_blocks, tokens)


def write_counts(req: RequestTransfer, tp: int) -> dict:
    """Writes and bytes per plan kind: per tensor, per chip and for the whole request."""
    rows = {}
    for kind, plan in all_plans(req).items():
        rows[kind] = dict(per_tensor=plan.num_writes / req.num_tensors,
                          per_chip=plan.num_writes, request=plan.num_writes * tp,
                          bytes_per_chip=plan.total_bytes,
                          relayout_bytes=plan.extra.get("relayout_bytes", 0))
    single = ContiguousAllocator(req.tt.dram)
    single.reserve("r", req.token_bytes)
    aware = ReceiveAllocator(req.tt)
    aware.reserve("r", req.num_tokens)
    rows["bank_imbalance"] = dict(single_buffer=single.stats().imbalance,
                                  layout_aware=aware.stats().imbalance)
    return rows


def _timed(fns: dict, device: str, repeats: int, cpu: dict | None = None) -> dict:
    """Median wall time of each function in ``fns``: one warm-up call each, then ``repeats``
    rounds calling them in turn, so that all of them see the same machine load. ``cpu``, if
    given, receives each one's median CPU time of the process (all its threads): on one
    thread, the time it kept a core busy, which a loaded machine stretches far less than the
    wall time."""
    import torch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {name: [] for name in fns}
    busy = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
            busy[name].append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.update({name: float(np.median(t)) for name, t in busy.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


def _forced(fn, path: str | None):
    """``fn`` run with the kernel's block-float ``path`` forced (None: the fastest)."""
    from hardware import layout_kernel

    def call():
        with layout_kernel.forcing(path):
            return fn()
    return call


def throughput(tokens: int, tp: int, dram: str, dtype: str, num_layers: int, device: str,
               repeats: int, paths=(None,)) -> list[dict]:
    """HAWK transformation vs a plain torch copy of the same bytes, same device, same run: one
    row per kernel path in ``paths`` (None: the fastest the CPU has; one row for formats sent
    as they are, which no path packs).

    The baseline copies the request's GPU KV bytes (what the transformation reads: its blocks
    of every timed layer, K and V) once from one buffer to another with ``Tensor.copy_``.
    ``path`` says what ran: the fused C++ kernel (built before timing starts; ``kernel_path``:
    the block-float path, or "copy") or eager torch; with the kernel, the eager path is timed
    too (``eager_s``, ``eager_ratio``). All are timed in turn in every round. ``ratio`` is of
    wall times; ``cpu_ratio`` of the process's CPU times, the steadier figure on a loaded
    machine with one thread (with more it compares the work done, not the speed).
    """
    import torch
    from hardware import layout_kernel, transform
    req = make_transfer(tokens, tp, dram, dtype, num_layers)
    layers = transform.make_gpu_cache(req.gpu, torch.Generator().manual_seed(0), device=device)
    gather = transform.prepare(req, "hawk")
    kernel = transform.uses_kernel(layers, req, gather)                 # builds it, untimed
    out = transform.hawk_transform(layers, req, gather=gather)
    nbytes = req.num_tensors * req.block_table.size * req.gpu.block_bytes   # bytes read
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    prepare_s = _timed({"prepare": lambda: transform.prepare(req, "hawk")}, "cpu",
                       repeats)["prepare"]

    def run(kernel_used):
        return lambda: transform.hawk_transform(layers, req, out=out, gather=gather,
                                                kernel=kernel_used)
    block_float = layout_kernel.MAG_BITS[dtype] > 0
    paths = list(paths) if kernel and block_float else [None]
    fns = {"copy": lambda: dst.copy_(src)}
    for path in paths:
        fns[f"transform {path}"] = _forced(run(kernel), path)
    if kernel:
        fns["eager"] = run(False)
    busy = {}
    t = _timed(fns, device, repeats, busy)
    rows = []
    for path in paths:
        took = t[f"transform {path}"]
        row = dict(dtype=dtype, layers=num_layers, threads=torch.get_num_threads(),
                   bytes_in=nbytes, bytes_out=out.numel(),
                   path="fused C++ kernel" if kernel else "eager torch",
                   kernel_path=(path or layout_kernel.best_path() if block_float else "copy")
                   if kernel else None,
                   prepare_s=prepare_s, transform_s=took, copy_s=t["copy"],
                   transform_gbps=nbytes / took / 1e9, copy_gbps=nbytes / t["copy"] / 1e9,
                   ratio=t["copy"] / took,
                   cpu_ratio=busy["copy"] / max(busy[f"transform {path}"], 1e-9))
        if kernel:
            row.update(build_s=layout_kernel.build_seconds(), eager_s=t["eager"],
                       eager_ratio=t["copy"] / t["eager"])
        rows.append(row)
    return rows


def scaling(rows: list[dict]) -> list[dict]:
    """Speed-up of the transformation (and of the copy) at each thread count over the first
    one measured, per format and path."""
    first = {}
    out = []
    for row in rows:
        key = (row["dtype"], row["kernel_path"])
        base = first.setdefault(key, row)
        if row is not base:
            out.append(dict(dtype=row["dtype"], kernel_path=row["kernel_path"],
                            threads=row["threads"], base_threads=base["threads"],
                            speedup=base["transform_s"] / row["transform_s"],
                            copy_speedup=base["copy_s"] / row["copy_s"]))
    return out


def run(tokens: int = 4096, device: str = "cpu", repeats: int = 5, tp: int = 4,
        dram: str = "p150a", dtypes=("bfloat16", "bfloat8_b", "bfloat4_b"), bench_layers: int = 8,
        threads=None, paths=(None,)) -> dict:
    """Write counts for the full 80-layer request; throughput over ``bench_layers`` layers at
    each thread count in ``threads`` (an int, a list, or None: torch's own) and each kernel
    path in ``paths`` (None: the one ``HAWK_TRANSFORM_PATH`` forces, else the fastest; refused
    by name where the CPU lacks one)."""
    import torch
    from hardware import layout_kernel
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch.cuda is not available")
    paths = [path or layout_kernel.forced_path() for path in paths]
    for path in paths:
        if path is not None:
            layout_kernel.check_path(path)
    counts = [threads] if isinstance(threads, int) else list(threads or [None])
    if any(n is not None and n < 1 for n in counts):
        raise ValueError(f"threads {counts}: each must be at least 1")
    before = torch.get_num_threads()
    rows, used = [], []
    try:
        for n in counts:
            if n is not None:
                torch.set_num_threads(n)
            used.append(torch.get_num_threads())
            for d in dtypes:
                rows += throughput(tokens, tp, dram, d, bench_layers, device, repeats, paths)
    finally:
        torch.set_num_threads(before)
    req = make_transfer(tokens, tp, dram, "bfloat8_b", LLAMA_70B["num_layers"])
    return dict(tokens=tokens, tp=tp, dram=dram, device=device,
                threads=used[0] if len(used) == 1 else used,
                kv_heads_per_chip=req.gpu.num_kv_heads, write_counts=write_counts(req, tp),
                throughput=rows, scaling=scaling(rows))


def format_table(result: dict) -> str:
    lines = [f"Llama-3.1-70B, {result['tokens']} tokens, TP {result['tp']} "
             f"({result['kv_heads_per_chip']} KV heads per chip), {result['dram']}, bfloat8_b",
             f"{'plan':22s} {'writes/tensor':>13s} {'writes/chip':>11s} {'writes/request':>14s}"]
    for kind, row in result["write_counts"].items():
        if kind != "bank_imbalance":
            lines.append(f"{kind:22s} {row['per_tensor']:13.1f} {row['per_chip']:11d} "
                         f"{row['request']:14d}")
    imb = result["write_counts"]["bank_imbalance"]
    lines.append(f"bank imbalance (max/mean): single buffer {imb['single_buffer']:.2f}, "
                 f"layout-aware {imb['layout_aware']:.2f}")
    lines.append(f"transformation on {result['device']} vs a torch copy_ of the same bytes (the "
                 f"request's GPU KV blocks), medians:")
    threads = None
    for t in result["throughput"]:
        if t["threads"] != threads:
            threads = t["threads"]
            lines.append(f" {threads} thread{'s' if threads > 1 else ''}:")
        how = t["path"] + (f", {t['kernel_path']}" if t["kernel_path"] else "")
        lines.append(f"  {t['dtype']:10s} {t['layers']} layers {t['bytes_in'] / 2**20:7.1f} MiB: "
                     f"transform {t['transform_gbps']:6.2f} GB/s, copy {t['copy_gbps']:6.2f} "
                     f"GB/s, ratio {t['ratio']:.3f} (of CPU time {t['cpu_ratio']:.3f}; "
                     f"{how}; index build "
                     f"{t['prepare_s'] * 1e3:.1f} ms)")
        if "eager_ratio" in t:
            lines.append(f"  {'':10s} eager torch path: ratio {t['eager_ratio']:.3f} (kernel "
                         f"built or loaded in {t['build_s']:.1f} s, not timed)")
    if result["scaling"]:
        lines.append("thread scaling: speed-up of the transformation over the first thread "
                     "count (time there / time here; the copy's in brackets):")
    for s in result["scaling"]:
        lines.append(f"  {s['dtype']:10s} {s['kernel_path'] or 'eager':8s} {s['base_threads']} -> "
                     f"{s['threads']} threads: {s['speedup']:.2f}x (copy {s['copy_speedup']:.2f}x)")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, comma-separated, "
                                         f"e.g. 1,2") from None


def _paths(text: str) -> list[str | None]:
    names = [v.strip().lower() for v in text.split(",")]
    allowed = ("auto", "all", "portable", "avx2", "avx512")
    bad = [v for v in names if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: allowed: {', '.join(allowed)}")
    return [None if v == "auto" else v for v in names]


def _all_paths(paths: list) -> list:
    """``all`` -> every path the CPU has, fastest first (none without a kernel)."""
    if "all" not in paths:
        return paths
    from hardware import layout_kernel
    return list(reversed(layout_kernel.supported_paths())) or [None]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dram", choices=sorted(DRAMS), default="p150a")
    parser.add_argument("--layers", type=int, default=8, help="layers timed (counts use 80)")
    parser.add_argument("--threads", type=_ints, default=None,
                        help="torch's intra-op threads: the copy baseline and the fused kernel "
                             "(which splits the pages over them) both use them; a list (1,2) "
                             "measures each and prints the speed-up")
    parser.add_argument("--path", type=_paths, default=[None],
                        help="the kernel's block-float path(s): auto (the fastest this CPU "
                             "has), portable, avx2, avx512, or all that the CPU has; "
                             "comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401  (the transformation is timed with torch)
    except ImportError:
        print("layout_bench: needs torch, which is not installed; install the extra: "
              "pip install -e '.[torch]'", file=sys.stderr)
        return 2
    try:
        result = run(tokens=args.tokens, device=args.device, repeats=args.repeats, tp=args.tp,
                     dram=args.dram, bench_layers=args.layers, threads=args.threads,
                     paths=_all_paths(args.path))
    except ValueError as e:
        print(f"layout_bench: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
