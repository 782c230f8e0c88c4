"""What a step costs inside the serving loop: ``hawk real profile``'s short real-cluster session.

The tables time one engine step alone. A worker serving requests does more per step, on cores
it shares with the other worker, the router and the decode worker's puller thread: it sends
each step's tokens to the router (which streams them to clients), reads the router's messages
and takes landed requests. So the profile ends with a session: a ``LocalCluster`` of the
profile's own model and [serving] settings serves ``num_requests`` synthetic requests (Poisson
arrivals, lengths uniform over the workers' range, seed ``SEED``: never a trace ``hawk
validate`` replays), its workers logging every step (``worker --step-log``, ``StepLog``).

``loop.csv`` holds every logged step: ``phase,batch,longest,total,seconds``, where ``seconds``
is, for a prefill batch, the engine's span (what a prefill worker reports); for a decode
step, the loop's period while it kept stepping (end of one iteration, tokens sent, to the end
of the next); for a transfer (``batch`` 1, ``longest`` = ``total`` = the prompt's tokens),
the pull as the decode worker stamps it, its puller thread beside the decode loop.
``sim.models.profile_dir`` prices each row by the tables and scales the simulator's prefill, decode
and transfer times by the median ratio per phase. Rows of the session's first requests (the
warm-up) are kept: the medians are robust to them.
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path

import numpy as np

COLUMNS = ("phase", "batch", "longest", "total", "seconds")
SEED = 7919
WARMUP_REQUESTS = 4
#: mean decode batches the session's arrival rates aim at, one half of the requests each
#: (Little's law on the decode table): a light and a busy stretch, since the cost of sharing
#: the cores grows with how often prefill and decode run at once
TARGET_BATCHES = (2, 8)


def session_trace(decode_rows: list[dict], max_tokens: int, num_requests: int):
    """Synthetic requests: prompt and output lengths uniform in 1..max_tokens/2, Poisson
    arrivals, each half of them at the rate that keeps about one of ``TARGET_BATCHES``
    requests decoding (the measured step of the batch and context nearest that)."""
    from traces.trace import Trace

    rng = np.random.default_rng(SEED)
    half = max(1, max_tokens // 2)
    prompts = rng.integers(1, half + 1, num_requests)
    outputs = rng.integers(1, half + 1, num_requests)
    context = float(prompts.mean() + outputs.mean() / 2)
    gaps, rates = [], []
    for k, target in enumerate(TARGET_BATCHES):
        row = min(decode_rows, key=lambda r: (abs(r["batch"] - target),
                                              abs(r["context_per_request"] - context)))
        rates.append(target / (float(outputs.mean()) * row["seconds_p50"]))
        n = num_requests // len(TARGET_BATCHES) + (k < num_requests % len(TARGET_BATCHES))
        gaps.append(rng.exponential(1.0 / rates[-1], n))
    arrivals = np.cumsum(np.concatenate(gaps))
    return Trace.from_columns(arrivals, prompts, outputs, name="profile-loop@" + ",".join(
        f"{r:.3g}" for r in rates) + "/s")


def measure_loop(out: Path, decode_rows: list[dict], serving, mechanism: str, device: str,
                 max_tokens: int, num_requests: int) -> int:
    """Serve the session and write ``out/loop.csv`` (whole, or not at all); the rows written."""
    from hardware.serve.cluster import ClusterConfig
    from hardware.serve.run import RealRunConfig, real_run

    trace = session_trace(decode_rows, max_tokens, num_requests)
    with tempfile.TemporaryDirectory(prefix="hawk-profile-loop-") as scratch:
        logs = Path(scratch) / "steps"
        args = ["--max-batch-tokens", str(serving.prefill_max_batch_tokens),
                "--num-blocks", str(serving.prefill_num_blocks),
                "--max-batch-size", str(serving.decode_max_batch),
                "--num-tokens", str(serving.num_kv_tokens),
                "--max-request-tokens", str(serving.max_request_tokens),
                "--threads", str(serving.threads),
                "--device", "cpu" if device == "cpu" else "cuda", "--step-log", str(logs)]
        cluster = ClusterConfig(mechanism=mechanism, kv_dtype=serving.kv_dtype,
                                model=str(out / "model"), worker_args=args)
        real_run(trace, RealRunConfig(cluster, 1e9, 1e9, max_tokens, progress=False,
                                      warmup_requests=WARMUP_REQUESTS), Path(scratch) / "run")
        rows = [("prefill", r["batch"], r["longest"], r["total"], r["engine_s"])
                for r in _read(logs, "prefill")]
        rows += [("decode", r["batch"], r["longest"], r["total"], r["period_s"])
                 for r in _read(logs, "decode") if r["period_s"]]
        rows += _transfers(Path(scratch) / "run" / "records.parquet")
        write_loop_csv(out, rows)
    return len(rows)


def write_loop_csv(out: Path, rows: list[tuple]) -> None:
    """``out/loop.csv`` whole, or not at all (written aside, then renamed)."""
    partial = out / "loop.csv.partial"
    with partial.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    os.replace(partial, out / "loop.csv")


def _transfers(records: Path) -> list[tuple]:
    """One row per transferred request: ``transfer,1,tokens,tokens,seconds`` (its pull as the
    decode worker stamped it, beside the other processes)."""
    from traces.schema import Status, read_records

    frame = read_records(records)
    done = frame[frame["status"] == Status.OK.value].dropna(subset=["transfer_start_at", "transfer_end_at"])
    return [("transfer", 1, int(n), int(n), repr(float(b - a))) for n, a, b in zip(
        done["num_prompt_tokens"], done["transfer_start_at"], done["transfer_end_at"])
        if b > a]


def _read(logs: Path, role: str) -> list[dict]:
    out = []
    for path in sorted(logs.glob(f"{role}*.csv")):
        with path.open(newline="") as f:
            out += list(csv.DictReader(f))
    return out


def summary(out: Path) -> str:
    """One line: how many steps the session logged and their median seconds."""
    path = out / "loop.csv"
    if not path.is_file():
        return "serving loop: not measured"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    parts = []
    for phase in ("prefill", "decode", "transfer"):
        s = [float(r["seconds"]) for r in rows if r["phase"] == phase]
        if s:
            parts.append(f"{len(s)} {phase} steps, median {1e3 * float(np.median(s)):.1f} ms")
    return "serving loop (loop.csv): " + "; ".join(parts)
