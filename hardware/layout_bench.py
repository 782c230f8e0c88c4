"""Benchmark: one Llama-3.1-70B request's KV transfer, plan by plan, and the HAWK transformation.

Prints, for a request of ``tokens`` tokens on one GPU rank -> one NPU chip (TP ``tp`` on both
sides, the same rank on both), the number of writes each mechanism's plan needs, and the
transformation's throughput against a plain torch copy of the same bytes, measured in the same
run on the same device (CPU, or CUDA when asked and present).

    python -m hardware.layout_bench [--tokens 4096] [--device cpu|cuda] [--threads 1] [--json]
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
from hardware.plans import RequestTransfer, all_plans

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


def _timed(fns: dict, device: str, repeats: int) -> dict:
    """Median wall time of each function in ``fns``: one warm-up call each, then ``repeats``
    rounds calling them in turn, so that all of them see the same machine load."""
    import torch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def throughput(tokens: int, tp: int, dram: str, dtype: str, num_layers: int, device: str,
               repeats: int) -> dict:
    """HAWK transformation vs a plain torch copy of the same bytes, same device, same run.

    The baseline copies the request's GPU KV bytes (what the transformation reads: its blocks
    of every timed layer, K and V) once from one buffer to another with ``Tensor.copy_``.
    ``path`` says what ran: the fused C++ kernel (built before timing starts) or eager torch;
    with the kernel, the eager path is timed too (``eager_s``, ``eager_ratio``).
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
    fns = {"copy": lambda: dst.copy_(src),
           "transform": lambda: transform.hawk_transform(layers, req, out=out, gather=gather,
                                                         kernel=kernel)}
    if kernel:
        fns["eager"] = lambda: transform.hawk_transform(layers, req, out=out, gather=gather,
                                                        kernel=False)
    t = _timed(fns, device, repeats)
    row = dict(dtype=dtype, layers=num_layers, bytes_in=nbytes, bytes_out=out.numel(),
               path="fused C++ kernel" if kernel else "eager torch",
               prepare_s=prepare_s, transform_s=t["transform"], copy_s=t["copy"],
               transform_gbps=nbytes / t["transform"] / 1e9, copy_gbps=nbytes / t["copy"] / 1e9,
               ratio=t["copy"] / t["transform"])
    if kernel:
        row.update(build_s=layout_kernel.build_seconds(), eager_s=t["eager"],
                   eager_ratio=t["copy"] / t["eager"])
    return row


def run(tokens: int = 4096, device: str = "cpu", repeats: int = 5, tp: int = 4,
        dram: str = "p150a", dtypes=("bfloat16", "bfloat8_b", "bfloat4_b"), bench_layers: int = 8,
        threads: int | None = None) -> dict:
    """Write counts for the full 80-layer request; throughput over ``bench_layers`` layers."""
    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch.cuda is not available")
    if threads is not None:
        torch.set_num_threads(threads)
    req = make_transfer(tokens, tp, dram, "bfloat8_b", LLAMA_70B["num_layers"])
    return dict(tokens=tokens, tp=tp, dram=dram, device=device,
                threads=torch.get_num_threads(), kv_heads_per_chip=req.gpu.num_kv_heads,
                write_counts=write_counts(req, tp),
                throughput=[throughput(tokens, tp, dram, d, bench_layers, device, repeats)
                            for d in dtypes])


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
    lines.append(f"transformation on {result['device']} ({result['threads']} threads) vs a "
                 f"torch copy_ of the same bytes (the request's GPU KV blocks), medians:")
    for t in result["throughput"]:
        lines.append(f"  {t['dtype']:10s} {t['layers']} layers {t['bytes_in'] / 2**20:7.1f} MiB: "
                     f"transform {t['transform_gbps']:6.2f} GB/s, copy {t['copy_gbps']:6.2f} "
                     f"GB/s, ratio {t['ratio']:.3f} ({t['path']}; index build "
                     f"{t['prepare_s'] * 1e3:.1f} ms)")
        if "eager_ratio" in t:
            lines.append(f"  {'':10s} eager torch path: ratio {t['eager_ratio']:.3f} (kernel "
                         f"built or loaded in {t['build_s']:.1f} s, not timed)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dram", choices=sorted(DRAMS), default="p150a")
    parser.add_argument("--layers", type=int, default=8, help="layers timed (counts use 80)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads: the copy baseline and the fused kernel "
                             "(which splits the pages over them) both use them")
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
                     dram=args.dram, bench_layers=args.layers, threads=args.threads)
    except ValueError as e:
        print(f"layout_bench: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
