"""``hawk real transfer-bench``: the five mechanisms of Figure 9 on real bytes, two processes.

For each size a prefill process is started (``python -m hardware.transfer_bench --serve``):
it builds a seeded GPU paged cache holding one request of that size, serves Algorithm 1 over
the chosen transport, and runs a raw TCP sender. The decode side (this process) measures, in
the same run and against the same peer:

- raw socket throughput: ``sendall`` -> ``recv_into`` of the whole size over loopback TCP,
  the ceiling for any TCP-based transport on this machine;
- transport throughput: one batch of 16 MiB one-sided reads of the whole size;
- CPU seconds per GB that both processes spent on each of those two (on a machine with few
  cores a TCP-based engine that copies through its own buffers is CPU-bound, not link-bound);
- each mechanism's latency, from the decode side's pull request to the KV cache usable in its
  pool (prefill-side transformation or staging copy, transfer, decode-side re-layout).

Medians of ``repeats``. Latency rows are ``(size_mb, mechanism, latency_s)``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from hardware import mechanisms
from hardware.mechanisms import MECHANISMS, MIB

DEFAULT_SIZES_MB = (10, 20, 40, 80, 160, 320, 640, 1280)
CHUNK = 16 * MIB


# -- the prefill process ---------------------------------------------------------------------
def serve(size_bytes: int, transport: str, device: str, num_layers: int, seed: int) -> None:
    from hardware.protocol import PrefillServer
    from hardware.transport import make_transport

    req = mechanisms.make_request(size_bytes, num_layers=num_layers, seed=seed)
    layers = mechanisms.make_layers(req, seed=seed, device=device)
    t = make_transport(transport, host="127.0.0.1", protocol="tcp")
    largest = max(req.token_bytes, sum(req.tt.region_sizes),                # GN-HAWK
                  req.num_tensors * req.block_table.size * req.gpu.block_bytes)  # GG-Direct
    send = np.ones(largest + (1 << 16), np.uint8)
    server = PrefillServer(t, send, mechanisms.MechanismSource(layers, req),
                           os.environ["HAWK_TOKEN"])
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sender, args=(raw, send), daemon=True).start()
    print(json.dumps({"address": list(server.address), "raw_port": raw.getsockname()[1],
                      "nbytes": req.token_bytes}), flush=True)
    server.serve_forever()


def _raw_sender(listener: socket.socket, buf: np.ndarray) -> None:
    """Answers each 8-byte length with that many bytes of ``buf``, until the peer closes."""
    view = memoryview(buf)
    while True:
        conn, _ = listener.accept()
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                conn.sendall(view[:struct.unpack("!Q", head)[0]])


# -- the decode side -------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_gb(pids, fn, nbytes: int, repeats: int) -> tuple[float, float]:
    """Run ``fn`` (which returns a median time); also the CPU seconds per GB both sides spent."""
    before = sum(cpu_s(p) for p in pids)
    median = fn()
    spent = sum(cpu_s(p) for p in pids) - before
    return median, spent / ((repeats + 1) * nbytes / 1e9)


def raw_socket_s(port: int, nbytes: int, repeats: int) -> float:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    times = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeats + 1):                           # the first one warms up
            start = time.perf_counter()
            s.sendall(struct.pack("!Q", nbytes))
            got = 0
            while got < nbytes:
                n = s.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("raw sender closed early")
                got += n
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def transport_s(t, client, nbytes: int, repeats: int) -> float:
    from hardware.plan import TransferPlan

    dst = np.zeros(nbytes, np.uint8)
    region = t.register_buffer(dst)
    try:
        starts = np.arange(0, nbytes, CHUNK, dtype=np.int64)
        plan = TransferPlan("raw", starts, np.zeros_like(starts), starts,
                            np.minimum(CHUNK, nbytes - starts), nbytes, (nbytes,))
        t.submit(plan, client.send_region, [region], op="read", timeout_s=600)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            t.submit(plan, client.send_region, [region], op="read", timeout_s=600)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        t.release(region)


def mechanism_s(t, address, token: str, mechanism: str, req, repeats: int) -> float:
    from hardware.protocol import DecodeClient

    sink = mechanisms.MechanismSink(mechanism, t, req)
    try:
        with DecodeClient(t, sink, address, token, timeout_s=600) as client:
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                client.pull(f"{mechanism}/{i}")
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        sink.close()


def bench_size(size_mb: float, args, t) -> dict:
    from hardware.protocol import DecodeClient

    token = secrets.token_hex(16)
    env = {**os.environ, "HAWK_TOKEN": token, "GLOG_minloglevel": "2"}
    cmd = [sys.executable, "-m", "hardware.transfer_bench", "--serve",
           "--size-bytes", str(int(size_mb * MIB)), "--transport", args.transport,
           "--device", args.device, "--num-layers", str(args.num_layers), "--seed", str(args.seed)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prefill process exited with {proc.wait()} before serving")
        hello = json.loads(line)
        address, nbytes = tuple(hello["address"]), hello["nbytes"]
        req = mechanisms.make_request(int(size_mb * MIB), num_layers=args.num_layers,
                                      seed=args.seed)
        pids = (os.getpid(), proc.pid)
        raw, raw_cpu = cpu_per_gb(pids, lambda: raw_socket_s(hello["raw_port"], nbytes,
                                                             args.repeats), nbytes, args.repeats)
        probe = mechanisms.MechanismSink("GN-HAWK", t, req)
        with DecodeClient(t, probe, address, token) as client:
            moved, moved_cpu = cpu_per_gb(pids, lambda: transport_s(t, client, nbytes,
                                                                    args.repeats),
                                          nbytes, args.repeats)
        probe.close()
        rows = [{"size_mb": size_mb, "mechanism": m,
                 "latency_s": mechanism_s(t, address, token, m, req, args.repeats)}
                for m in args.mechanisms]
        return {"rows": rows, "nbytes": nbytes, "raw_socket_s": raw, "transport_s": moved,
                "raw_socket_cpu_s_per_gb": raw_cpu, "transport_cpu_s_per_gb": moved_cpu}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def run(args) -> dict:
    from hardware.transport import make_transport

    t = make_transport(args.transport, host="127.0.0.1", protocol="tcp")
    try:
        per_size = [bench_size(s, args, t) for s in args.sizes]
    finally:
        t.close()
    total = sum(p["nbytes"] for p in per_size)
    raw = total / sum(p["raw_socket_s"] for p in per_size) / 1e9
    moved = total / sum(p["transport_s"] for p in per_size) / 1e9
    largest = per_size[-1]
    return {
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
                      "transport_cpu_s_per_gb": p["transport_cpu_s_per_gb"]}
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
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true")
    p.add_argument("--size-bytes", type=int)
    p.add_argument("--transport", default="mooncake")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.serve:
        p.error("only --serve is run this way; use `hawk real transfer-bench`")
    serve(args.size_bytes, args.transport, args.device, args.num_layers, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
