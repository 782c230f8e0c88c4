"""``hawk real run``: a trace through a local cluster, written as ``hawk simulate`` writes a run.

1. The trace's lengths are scaled down by one common factor so its longest request fits the
   model's context (the tiny model holds 512 tokens; the factor is reported, never hidden).
2. A ``LocalCluster`` starts; the trace is replayed open loop with real timing through
   ``traces.replay`` (token-id prompts, exactly ``num_output_tokens`` greedy tokens each);
   with ``warmup_requests``, that many requests of other prompts are served first, unrecorded.
3. Each trace request is found in the router's log by its prompt, and its record
   (``traces.schema``) takes every instant from the workers' clocks: arrival (router),
   prefill start and end (prefill worker), transfer start and end, first token and finish
   (decode worker; an aggregated worker stamps prefill and tokens, and nothing is transferred:
   no transfer instants, ``kv_bytes`` 0); seconds since the replay's start. A failure the
   client saw and the workers
   did not (a timeout) keeps the client's status.
4. ``records.parquet`` and ``summary.json`` (``traces.metrics.summarize`` plus power, the
   scaling and the cluster) go to ``out``. Ctrl-C stops the replay, and what finished is
   written, the rest ``unfinished``; so does SIGTERM (``timeout``, ``kill``), and the records
   of a run cut short are a dataset directory marked ``_INCOMPLETE`` (``write_run_records``).

Power: NVML's energy counter when a GPU is present, else RAPL's when readable, else an
estimate (``power_source`` says which): each worker's measured busy time at the catalog's
board power of the device it stands for (idle power not counted; an aggregated worker stands
for the prefill device, a GPU).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hardware.serve.cluster import ClusterConfig, LocalCluster
from hardware.serve.router import prompt_key
from traces.jsonout import dumps
from traces.prompts import PromptMaker, PromptSpec
from traces.schema import Status, records_frame
from traces.trace import Trace

RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")


@dataclass(frozen=True)
class RealRunConfig:
    cluster: ClusterConfig
    ttft_slo_s: float
    tpot_slo_s: float
    context_tokens: int = 512
    prefill_device: str = "a100-pcie"     # what the estimate prices a prefill worker as
    decode_device: str = "p150a"
    timeout_s: float = 600.0
    progress: bool = True
    warmup_requests: int = 0              # served before the trace, not recorded


def fit_to_context(trace: Trace, context_tokens: int) -> tuple[Trace, float]:
    """Lengths scaled by one factor (<= 1) so every prompt + output fits ``context_tokens``."""
    total = trace.num_prompt_tokens + trace.num_output_tokens
    scale = min(1.0, context_tokens / float(total.max()))
    if scale == 1.0:
        return trace, 1.0
    prompt = np.maximum(1, np.floor(trace.num_prompt_tokens * scale)).astype(np.int64)
    output = np.maximum(1, np.floor(trace.num_output_tokens * scale)).astype(np.int64)
    return dataclasses.replace(trace, num_prompt_tokens=prompt, num_output_tokens=output), scale


class EnergyMeter:
    """Joules over a window from NVML or RAPL, when either is readable."""

    def __init__(self):
        self.source, self._read = self._pick()
        self._start = self._read() if self._read else None

    @staticmethod
    def _pick():
        try:
            import pynvml
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(pynvml.nvmlDeviceGetCount())]
            if handles:
                return "nvml", lambda: sum(
                    pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3
        except Exception:  # noqa: BLE001  (no NVML, no GPU: try the next meter)
            pass
        try:
            RAPL.read_text()
            return "rapl", lambda: int(RAPL.read_text()) / 1e6
        except OSError:
            return None, None

    def joules(self) -> float | None:
        return None if self._read is None else self._read() - self._start


def estimated_energy(workers: list[dict], prefill_device: str, decode_device: str) -> dict:
    from hardware import catalog
    devices = catalog.devices()
    joules, parts = 0.0, []
    for w in workers:
        key = decode_device if w["role"] == "decode" else prefill_device
        busy = float(w.get("busy_s") or 0.0)
        joules += busy * devices[key].board_power_w
        parts.append(f"{w['role']} {w['index']}: {busy:.2f} s busy as {key}")
    return {"energy_j": joules, "power_source": "estimated: measured busy time at the "
            "catalog's board power (idle not counted); " + "; ".join(parts)}


def warmup_trace(trace: Trace, num_requests: int) -> Trace:
    """``num_requests`` requests at once, of the trace's longest prompt and 4 output tokens:
    the first prefill and decode batches of a fresh worker (its allocator, its kernels) are
    slow, and a measured profile excludes them too."""
    n = int(num_requests)
    prompt = np.full(n, int(trace.num_prompt_tokens.max()), dtype=np.int64)
    return Trace.from_columns(np.zeros(n), prompt, np.full(n, 4, dtype=np.int64),
                              name="warm-up")


def build_records(trace: Trace, prompts: list[list[int]], log: list[dict], t0: float,
                  client_status: list[str] | None):
    """The run's records: trace request i joined with the router's entry for its prompt."""
    by_key: dict[str, list[dict]] = {}
    for entry in sorted(log, key=lambda e: e["arrival_at"]):
        by_key.setdefault(entry["prompt_key"], []).append(entry)
    cols = {c: [] for c in ("status", "prefill_instance", "decode_instance", "prefill_start_at",
                            "prefill_end_at", "transfer_start_at", "transfer_end_at",
                            "first_token_at", "finished_at", "num_generated_tokens",
                            "kv_bytes", "arrival_at")}
    for i, prompt in enumerate(prompts):
        entries = by_key.get(prompt_key(prompt)) or [{}]
        e = entries.pop(0) if len(entries) > 1 else entries[0]
        status = e.get("status", Status.UNFINISHED.value)
        if client_status is not None and status == Status.OK.value \
                and client_status[i] != Status.OK.value:
            status = client_status[i]
        cols["status"].append(status)
        for name in ("prefill_instance", "decode_instance"):
            cols[name].append(int(e.get(name, -1)))
        for name in ("arrival_at", "prefill_start_at", "prefill_end_at", "transfer_start_at",
                     "transfer_end_at", "first_token_at", "finished_at"):
            value = e.get(name)
            cols[name].append(math.nan if value is None else float(value) - t0)
        if not e:
            cols["arrival_at"][-1] = float(trace.arrival_at[i])
        cols["num_generated_tokens"].append(int(e.get("num_generated_tokens", 0)))
        cols["kv_bytes"].append(int(e.get("kv_bytes", 0)))
    return records_frame({"request_id": trace.request_id, "tenant": trace.tenant,
                          "num_prompt_tokens": trace.num_prompt_tokens,
                          "num_output_tokens": trace.num_output_tokens, **cols})


def write_run_records(frame, path: Path, interrupted: bool) -> None:
    """The records at ``path``; a run cut short writes them as a dataset directory marked
    ``_INCOMPLETE`` (the streamed simulator's convention: ``traces.schema.read_records``
    refuses it, naming why, and ``pandas.read_parquet`` still reads what is there)."""
    from traces.schema import INCOMPLETE, clear_records, write_records

    if not interrupted:
        write_records(frame, path)
        return
    clear_records(path)
    path.mkdir(parents=True)
    write_records(frame, path / "part-00000.parquet")
    num_open = int((frame["status"] == Status.UNFINISHED.value).sum())
    (path / INCOMPLETE).write_text(f"the real run was stopped (SIGINT or SIGTERM) with "
                                   f"{num_open} of {len(frame)} requests unfinished\n")


def _progress(cluster: LocalCluster, total: int, stop: threading.Event) -> None:
    from tqdm import tqdm
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr) as bar:
        while not stop.wait(0.5):
            try:
                bar.update(cluster.health()["done"] - bar.n)
            except OSError:
                return


def _run(make_coro):
    """``asyncio.run`` here, or on a thread of its own inside a running loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def real_run(trace: Trace, config: RealRunConfig, out: Path | None = None) -> dict:
    """Run ``trace`` on a fresh local cluster; returns the summary (and writes it to ``out``)."""
    import aiohttp  # noqa: F401  (imported before the replay's clock starts)

    from traces.metrics import summarize
    from traces.tenants import by_tenant
    from traces.replay import ReplayConfig, replay_async
    from hardware.model.config import tiny_config

    trace, scale = fit_to_context(trace, config.context_tokens)
    vocab = tiny_config().vocab_size
    spec = PromptSpec(kind="token_ids", token_id_low=0, token_id_high=vocab)
    maker = PromptMaker(spec, int(trace.num_prompt_tokens.max()))
    prompts = [maker.prompt(i, int(n)) for i, n in enumerate(trace.num_prompt_tokens)]
    cluster = LocalCluster(config.cluster, log_dir=(out / "logs") if out else None)
    cluster.start()
    stop, interrupted, result = threading.Event(), False, None
    try:
        replay_config = ReplayConfig(cluster.endpoint, prompt=spec, timeout_s=config.timeout_s)
        if config.warmup_requests:          # other prompts (seed + 1): never a trace's
            warm = ReplayConfig(cluster.endpoint, timeout_s=config.timeout_s,
                                prompt=dataclasses.replace(spec, seed=spec.seed + 1))
            _run(lambda: replay_async(warmup_trace(trace, config.warmup_requests), warm))
        meter = EnergyMeter()
        if config.progress:
            threading.Thread(target=_progress, args=(cluster, len(trace), stop),
                             daemon=True).start()

        async def go():
            loop = asyncio.get_running_loop()
            offset = time.time() - loop.time()
            return offset + loop.time() + replay_config.start_delay_s, \
                await replay_async(trace, replay_config)
        start_wall = time.time()
        try:
            t0, result = _run(go)
        except KeyboardInterrupt:
            interrupted, t0 = True, start_wall + replay_config.start_delay_s
        stop.set()
        log, workers = cluster.get("/hawk/requests"), cluster.get("/hawk/workers")
        joules = meter.joules()
    finally:
        stop.set()
        cluster.stop()
    client = None if result is None else list(result.records["status"])
    frame = build_records(trace, prompts, log, t0, client)
    summary = summarize(frame, config.ttft_slo_s, config.tpot_slo_s)
    tenants = by_tenant(frame, config.ttft_slo_s, config.tpot_slo_s)
    if tenants is not None:
        summary["tenants"] = tenants
    energy = (estimated_energy(workers, config.prefill_device, config.decode_device)
              if joules is None else {"energy_j": joules, "power_source": meter.source})
    span = float(np.nanmax(frame["finished_at"])) if len(frame) else 0.0
    c = config.cluster
    shape = ({"mechanism": None, "kv_dtype": None, "num_aggregated_workers": c.num_aggregated}
             if c.shape == "aggregated" else
             {"mechanism": c.mechanism, "kv_dtype": c.kv_dtype,
              "num_prefill_workers": c.num_prefill, "num_decode_workers": c.num_decode})
    summary.update(energy, mode="real", interrupted=interrupted, length_scale=scale,
                   shape=c.shape, **shape, workers=workers,
                   real_time_s=span, trace={"name": trace.name, "num_requests": len(trace)})
    watts = summary["energy_j"] / span if span > 0 else 0.0
    summary["tokens_per_joule"] = summary["output_tokens_per_s"] / watts if watts > 0 else 0.0
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_run_records(frame, out / "records.parquet", interrupted)
        (out / "summary.json").write_text(dumps(summary, indent=2, sort_keys=True,
                                                default=str) + "\n")
    return summary
