"""``hawk real transfer-bench``: the five mechanisms of Figure 9 on real bytes, two processes.

For each size a prefill process is started (``python -m hardware.transfer_bench --serve``):
it builds a seeded GPU paged cache holding one request of that size, serves Algorithm 1 over
the chosen transport, and runs a raw TCP sender. The decode side (this process) measures, in
the same run and against the same peer:

- raw socket throughput: ``sendall`` -> ``recv_into`` of the whole size over loopback TCP,
  the ceiling for any TCP-based transport on this machine;
- transport throughput: one batch of 16 MiB one-sided reads of the whole size (the batch
  alone, from post to completion);
- the integrity cost: whole pulls of the same plain bytes with the per-segment MACs
  (``hardware.wire``) and without, as GB/s of payload;
- CPU seconds per GB that both processes spent on the raw socket and the transport (on a
  machine with few cores a TCP-based engine that copies through its own buffers is CPU-bound,
  not link-bound);
- each mechanism's latency, from the decode side's pull request to the KV cache usable in its
  pool (prefill-side transformation or staging copy, transfer, MAC check, decode-side
  re-layout).

Medians of ``repeats``. Latency rows are ``(size_mb, mechanism, latency_s)``. The run's steps,
estimate and progress counter are ``hardware.bench_plan``'s. Every wait is bounded and ends
in ``BenchFailed`` or a ``TransportError`` naming what did not answer: a prefill process
that fails shows its own error, one that does not start serving within ``start_timeout_s``
is stopped, a move (raw socket, pull) has ``bench_plan.wait_s`` of its size, and the
teardown (the prefill process's exit, the transport's close) ``TEARDOWN_S``. Progress (MB
moved) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from hardware import bench_plan, mechanisms
from hardware.bench_plan import BenchFailed, check_memory  # noqa: F401  (re-exported)
from hardware.bench_report import format_table, summarize  # noqa: F401  (format_table too)
from hardware.mechanisms import MIB

DEFAULT_SIZES_MB = (10, 20, 40, 80, 160, 320, 640, 1280)
CHUNK = 16 * MIB
START_TIMEOUT_S = 300.0
#: seconds the teardown may take: a SIGKILLed prefill process to be collected, the decode
#: side's transport to close
TEARDOWN_S = 30.0


def check_request(size_mb: float, num_layers: int) -> int:
    """The request's KV bytes for ``size_mb``; ``BenchFailed`` if it cannot be built."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise BenchFailed(f"num-layers {num_layers!r}: need a whole number >= 1")
    probe = mechanisms.make_request(MIB, num_layers=num_layers)
    per_token = probe.token_bytes // probe.num_tokens
    if not size_mb > 0 or size_mb * MIB < per_token:
        raise BenchFailed(f"size {size_mb:g} MB: smaller than one token's KV cache over "
                          f"{num_layers} layers ({per_token} B)")
    return per_token * max(1, int(size_mb * MIB) // per_token)


# -- the prefill process ---------------------------------------------------------------------
class PlainSource:
    """``"plain/<i>"`` is ``nbytes`` of fixed bytes; anything else goes to the mechanisms."""

    def __init__(self, nbytes: int, other) -> None:
        self.payload, self.other = np.full(nbytes, 7, np.uint8), other

    def __call__(self, request_id: str, dest: dict):
        from hardware.transport import Prepared
        if request_id.startswith("plain/"):
            return Prepared(self.payload, {"nbytes": self.payload.size})
        return self.other(request_id, dest)


def serve(size_bytes: int, transport: str, device: str, num_layers: int, seed: int) -> None:
    from hardware.protocol import PrefillServer
    from hardware.transport import make_transport

    req = mechanisms.make_request(size_bytes, num_layers=num_layers, seed=seed)
    layers = mechanisms.make_layers(req, seed=seed, device=device)
    if device == "cpu":
        from hardware import layout_kernel
        layout_kernel.warm_up()             # before serving: no timed pull waits on a compile
    t = make_transport(transport, host="127.0.0.1", protocol="tcp")
    largest = max(req.token_bytes, sum(req.tt.region_sizes),                # GN-HAWK
                  req.num_tensors * req.block_table.size * req.gpu.block_bytes)  # GG-Direct
    send = np.ones(largest + (1 << 16), np.uint8)
    source = PlainSource(req.token_bytes, mechanisms.MechanismSource(layers, req))
    server = PrefillServer(t, send, source, os.environ["HAWK_TOKEN"])
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


def cpu_per_gb(pids, fn, nbytes: int, repeats: int) -> tuple[object, float]:
    """Run ``fn`` (``repeats + 1`` moves of ``nbytes``); its result and the CPU seconds per GB
    both sides spent."""
    before = sum(cpu_s(p) for p in pids)
    median = fn()
    spent = sum(cpu_s(p) for p in pids) - before
    return median, spent / ((repeats + 1) * nbytes / 1e9)


def raw_socket_s(port: int, nbytes: int, repeats: int, timeout_s: float,
                 moved=lambda: None) -> float:
    """Median seconds of ``sendall`` -> ``recv_into`` of ``nbytes``; ``BenchFailed`` when
    the sender closes early or a move has not ended within ``timeout_s``."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    times = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            for _ in range(repeats + 1):                           # the first one warms up
                start = time.perf_counter()
                s.settimeout(timeout_s)
                s.sendall(struct.pack("!Q", nbytes))
                got = 0
                while got < nbytes:
                    s.settimeout(max(start + timeout_s - time.perf_counter(), 1e-3))
                    n = s.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise BenchFailed(f"raw sender on port {port} closed after {got} of "
                                          f"{nbytes} B")
                    got += n
                times.append(time.perf_counter() - start)
                moved()
    except socket.timeout as e:
        raise BenchFailed(f"raw sender on port {port}: {nbytes} B not received within "
                          f"{timeout_s:g} s") from e
    return statistics.median(times[1:])


class PlainSink:
    """Decode-side sink for ``plain/<i>``: one buffer, read in ``CHUNK`` writes; it records
    when the batch starts (``plan``) and when the bytes are usable (``complete``)."""

    def __init__(self, t, nbytes: int) -> None:
        self.t, self.dst = t, np.zeros(nbytes, np.uint8)
        self.regions = [t.register_buffer(self.dst)]
        self.marks: list[float] = []

    def reserve(self, request_id: str) -> dict:
        return {}

    def plan(self, request_id: str, dest: dict, meta: dict):
        from hardware.transfer_plan import TransferPlan
        n = self.dst.size
        starts = np.arange(0, n, CHUNK, dtype=np.int64)
        self.marks.append(time.perf_counter())
        return TransferPlan("plain", starts, np.zeros_like(starts), starts,
                            np.minimum(CHUNK, n - starts), n, (n,))

    def complete(self, request_id: str, meta: dict) -> None:
        self.marks.append(time.perf_counter())

    def release(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        self.t.release(self.regions[0])


def plain_pulls(t, address, token: str, nbytes: int, repeats: int, integrity: bool,
                moved=lambda: None):
    """Median seconds of whole pulls of ``nbytes`` plain bytes, and of their batches alone
    (from post to the bytes usable; with ``integrity`` that includes the MAC check)."""
    from hardware.protocol import DecodeClient

    sink = PlainSink(t, nbytes)
    try:
        with DecodeClient(t, sink, address, token, integrity=integrity,
                          timeout_s=bench_plan.wait_s(nbytes / MIB)) as client:
            pulls = []
            for i in range(repeats + 1):                     # the first one warms up
                start = time.perf_counter()
                client.pull(f"plain/{i}")
                pulls.append(time.perf_counter() - start)
                moved()
        batches = [b - a for a, b in zip(sink.marks[2::2], sink.marks[3::2])]
        return statistics.median(pulls[1:]), statistics.median(batches)
    finally:
        sink.close()


def mechanism_s(t, address, token: str, mechanism: str, req, repeats: int,
                moved=lambda: None) -> float:
    from hardware.protocol import DecodeClient

    sink = mechanisms.MechanismSink(mechanism, t, req)
    try:
        with DecodeClient(t, sink, address, token,
                          timeout_s=bench_plan.wait_s(req.token_bytes / MIB, mechanism)) \
                as client:
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                client.pull(f"{mechanism}/{i}")
                times.append(time.perf_counter() - start)
                moved()
        return statistics.median(times)
    finally:
        sink.close()


def start_prefill(size_mb: float, args, token: str, log) -> tuple:
    """Start the prefill process; ``(process, its hello)`` once it serves."""
    from hardware.lifecycle import child_env
    env = child_env({**os.environ, "HAWK_TOKEN": token, "GLOG_minloglevel": "2"})
    cmd = [sys.executable, "-m", "hardware.transfer_bench", "--serve",
           "--size-bytes", str(int(size_mb * MIB)), "--transport", args.transport,
           "--device", args.device, "--num-layers", str(args.num_layers), "--seed", str(args.seed)]
    return spawn(cmd, env, getattr(args, "start_timeout_s", START_TIMEOUT_S), log,
                 f"prefill process for {size_mb:g} MB")


def spawn(cmd: list, env: dict, timeout_s: float, log, what: str) -> tuple:
    """Run ``cmd`` (stderr to ``log``) until it prints its one-line JSON hello; a child that
    exits, or has not printed it within ``timeout_s``, is stopped and a ``BenchFailed``
    showing its stderr (and any other lines it printed)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log)
    deadline, buf, other = time.monotonic() + timeout_s, b"", []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while sel.select(max(deadline - time.monotonic(), 0)):
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:                                   # its stdout closed: exiting
                try:
                    code = proc.wait(timeout=TEARDOWN_S)
                except subprocess.TimeoutExpired:
                    stop(proc, what)
                    code = "its output closed"
                raise BenchFailed(f"{what} exited with {code} before serving"
                                  f"{_printed(other)}{_tail(log)}")
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                hello = _hello(line)
                if hello is not None:
                    return proc, hello
                other.append(line.decode(errors="replace"))
    stop(proc, what)
    raise BenchFailed(f"{what} did not start serving within {timeout_s:g} s"
                      f"{_printed(other)}{_tail(log)}")


def _hello(line: bytes) -> dict | None:
    try:
        hello = json.loads(line)
    except ValueError:
        return None
    return hello if isinstance(hello, dict) and "address" in hello else None


def _printed(lines: list[str]) -> str:
    return f" (it printed {lines[-3:]!r})" if lines else ""


def _tail(log, lines: int = 12) -> str:
    """The end of a child's stderr, for an error message."""
    log.flush()
    log.seek(0)
    text = [ln.rstrip() for ln in log.read().decode(errors="replace").splitlines()
            if ln.strip()]
    return (":\n  " + "\n  ".join(text[-lines:])) if text else " (it wrote nothing to stderr)"


def bench_size(size_mb: float, args, t, progress) -> dict:
    from hardware.protocol import new_token

    token = new_token()
    with tempfile.TemporaryFile() as log:
        proc, hello = start_prefill(size_mb, args, token, log)
        try:
            return measure(size_mb, args, t, proc, hello, token, progress)
        except Exception as e:
            if proc.poll() is not None:
                raise BenchFailed(f"prefill process for {size_mb:g} MB exited with "
                                  f"{proc.returncode} during the run ({e}){_tail(log)}") from e
            raise
        finally:
            stop(proc, f"prefill process for {size_mb:g} MB")


def stop(proc, what: str, timeout_s: float = TEARDOWN_S) -> None:
    """SIGKILL ``proc`` and collect it; ``BenchFailed`` naming it if it is not gone within
    ``timeout_s`` (a process in uninterruptible sleep)."""
    proc.kill()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise BenchFailed(f"{what} (pid {proc.pid}) did not exit within {timeout_s:g} s of "
                          f"SIGKILL") from e


def close_within(t, timeout_s: float = TEARDOWN_S) -> None:
    """``t.close()`` on a daemon thread; ``BenchFailed`` if it has not returned within
    ``timeout_s`` (its error, if it raised, is re-raised)."""
    failed: list[BaseException] = []

    def close() -> None:
        try:
            t.close()
        except BaseException as e:          # noqa: BLE001  (re-raised below)
            failed.append(e)
    worker = threading.Thread(target=close, daemon=True, name="transport-close")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise BenchFailed(f"the decode side's {getattr(t, 'name', 'transport')} transport did "
                          f"not close within {timeout_s:g} s")
    if failed:
        raise failed[0]


def measure(size_mb: float, args, t, proc, hello: dict, token: str, progress) -> dict:
    address, nbytes = tuple(hello["address"]), hello["nbytes"]
    req = mechanisms.make_request(int(size_mb * MIB), num_layers=args.num_layers,
                                  seed=args.seed)
    pids, r, moved = (os.getpid(), proc.pid), args.repeats, progress.moved
    todo = iter(bench_plan.steps([size_mb], args.mechanisms, r))
    progress.begin(next(todo))
    raw, raw_cpu = cpu_per_gb(pids, lambda: raw_socket_s(
        hello["raw_port"], nbytes, r, bench_plan.wait_s(size_mb, "raw socket"), moved),
        nbytes, r)
    progress.begin(next(todo))
    (unchecked, moved_s), moved_cpu = cpu_per_gb(pids, lambda: plain_pulls(
        t, address, token, nbytes, r, integrity=False, moved=moved), nbytes, r)
    progress.begin(next(todo))
    checked, _ = plain_pulls(t, address, token, nbytes, r, integrity=True, moved=moved)
    rows = []
    for m, step in zip(args.mechanisms, todo):
        progress.begin(step)
        rows.append({"size_mb": size_mb, "mechanism": m,
                     "latency_s": mechanism_s(t, address, token, m, req, r, moved)})
    return {"rows": rows, "nbytes": nbytes, "raw_socket_s": raw, "transport_s": moved_s,
            "raw_socket_cpu_s_per_gb": raw_cpu, "transport_cpu_s_per_gb": moved_cpu,
            "checked_pull_s": checked, "unchecked_pull_s": unchecked}


def run(args) -> dict:
    from hardware.transport import make_transport

    if args.seed < 0:           # before any child starts: numpy refuses it there
        raise BenchFailed(f"--seed {args.seed}: need >= 0")
    check_memory(args.sizes)
    for size in args.sizes:
        check_request(size, args.num_layers)
    os.environ.setdefault("GLOG_minloglevel", "2")      # the engine's info lines, not ours
    progress = bench_plan.Progress(bench_plan.steps(args.sizes, args.mechanisms, args.repeats))
    t = make_transport(args.transport, host="127.0.0.1", protocol="tcp")
    try:
        per_size = [bench_size(s, args, t, progress) for s in args.sizes]
    finally:
        progress.close()
        close_within(t)
    return summarize(args, per_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--serve", action="store_true")
    p.add_argument("--size-bytes", type=int)
    p.add_argument("--transport", default="mooncake")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.serve:
        p.error("only --serve is run this way; use `hawk real transfer-bench`")
    from hardware.lifecycle import watch_parent
    watch_parent()                      # ends with the benchmark that started it
    serve(args.size_bytes, args.transport, args.device, args.num_layers, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
