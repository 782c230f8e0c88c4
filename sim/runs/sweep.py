"""Rate sweeps: one simulation per (rate, seed), run in parallel, and the knee.

Each point is independent and deterministic (its own seed), so points run in a process pool
or on Ray (``run_parallel``, shared with ``hawk compare`` and ``hawk plan``) and come back in
the order they were asked for, with the same results either way.
The knee is the highest rate whose SLO attainment is >= the target (90% by default). When
attainment is still >= the target at the highest swept rate, the knee lies beyond the swept
range (``knee_beyond_range``): the sweep shows a lower bound, not the knee.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces import metrics
from sim.config import ConfigError, RunConfig


#: per-rate means over seeds kept in a sweep's rows
ROW_MEANS = ("slo_attainment", "ttft_p90_s", "tpot_p90_s", "output_tokens_per_s", "num_failed",
             "prefill_utilization", "link_utilization", "decode_utilization", "decode_occupancy",
             *(f"ttft_{stage}_mean_s" for stage, _, _ in metrics.TTFT_STAGES))


#: the most rates one sweep may have (each is a simulation per seed)
MAX_POINTS = 10_000


def parse_rates(text: str) -> list[float]:
    """``"0.1:1.0:0.05"`` (start:stop:step, stop included) or ``"0.2,0.4,0.8"``; more than
    ``MAX_POINTS`` rates are refused before any is listed."""
    try:
        if ":" in text:
            start, stop, step = (float(x) for x in text.split(":"))
            if step <= 0 or stop < start:
                raise ValueError
            n = int(round((stop - start) / step)) + 1
        else:
            values = [float(x) for x in text.split(",") if x.strip()]
            n = len(values)
    except ValueError:
        raise ConfigError(f"--rates {text!r}: expected start:stop:step with step > 0 and "
                          f"stop >= start, or a comma-separated list") from None
    if n > MAX_POINTS:
        raise ConfigError(f"--rates {text!r}: {n:,} rates, more than the {MAX_POINTS:,} a sweep "
                          f"may have; take a larger step")
    rates = [round(start + k * step, 10) for k in range(n)] if ":" in text else values
    if not rates or min(rates) <= 0:
        raise ConfigError(f"--rates {text!r}: rates must be > 0 requests/s")
    return rates


@dataclass(frozen=True)
class SweepPoint:
    rate: float
    seed: int
    summary: dict


def _run_point(args: tuple[RunConfig, float, int]) -> SweepPoint:
    from sim.engine.cluster import simulate

    config, rate, seed = args
    result = simulate(config.replace(**{"workload.rate": rate, "seed": seed}))
    return SweepPoint(rate, seed, result.summary)


def sweep(config: RunConfig, rates, seeds=(0,), workers: int | None = None,
          progress: bool = True, ray_address: str | None = None) -> list[SweepPoint]:
    """Simulate every (rate, seed); ``workers=1`` runs in this process."""
    jobs = [(config, float(r), int(s)) for r in rates for s in seeds]
    return run_parallel(_run_point, jobs, workers, progress, ray_address, desc="sweep")


def run_parallel(fn, jobs: list, workers: int | None = None, progress: bool = True,
                 ray_address: str | None = None, desc: str = "runs") -> list:
    """``[fn(job) for job in jobs]``, in that order, on a local process pool (``workers``
    processes; 1: in this process) or on Ray (``ray_address``: ``"local"`` starts a local
    cluster of ``workers`` CPUs, anything else is the address of a running one). ``fn`` must be
    a module-level function and every job deterministic, so the results are the same whichever
    runs them (tested). A progress bar counts finished jobs on stderr."""
    results = [None] * len(jobs)
    for k, result in iter_parallel(fn, jobs, workers, progress, ray_address, desc):
        results[k] = result
    return results


def iter_parallel(fn, jobs: list, workers: int | None = None, progress: bool = True,
                  ray_address: str | None = None, desc: str = "runs"):
    """``(k, fn(jobs[k]))`` for every job as it finishes, on the backends of ``run_parallel``
    (in job order when run in this process). A caller that keeps only part of each result
    holds no more than that. An error, or leaving the loop early, cancels the jobs not yet
    started (those already running on a pool are waited for)."""
    if ray_address is not None:
        yield from _iter_ray(fn, jobs, workers, ray_address, progress, desc)
        return
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    bar = _progress(len(jobs), progress, desc)
    try:
        if workers <= 1 or len(jobs) <= 1:
            for k, job in enumerate(jobs):
                yield k, fn(job)
                bar.update()
            return
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(fn, job): k for k, job in enumerate(jobs)}
            try:
                for future in as_completed(futures):
                    yield futures.pop(future), future.result()
                    bar.update()
            finally:
                pool.shutdown(cancel_futures=True)
    finally:
        bar.close()


def _iter_ray(fn, jobs, workers: int | None, address: str, progress: bool, desc: str):
    ray = _ray_init(workers, address)
    remote = ray.remote(fn)
    refs = {remote.remote(job): k for k, job in enumerate(jobs)}
    bar = _progress(len(refs), progress, desc)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs.pop(ref), ray.get(ref)
                bar.update()
    finally:
        for ref in pending:
            ray.cancel(ref)
        bar.close()


def _ray_init(workers: int | None, address: str):
    """The ``ray`` module, connected: to a local cluster of ``workers`` CPUs (``"local"``) or
    to the running one at ``address``."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("--ray needs the optional dependency: pip install 'hawk-sim[ray]'") from exc
    if not ray.is_initialized():
        if address == "local":
            # workers import this very package (a checkout may shadow the installed one)
            root = str(Path(__file__).resolve().parents[2])
            path = os.environ.get("PYTHONPATH")
            ray.init(num_cpus=workers or os.cpu_count() or 1, include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": root + (os.pathsep + path
                                                                     if path else "")}})
        else:
            try:
                ray.init(address=address, logging_level="ERROR")
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise ConfigError(f"--ray {address}: cannot reach a Ray cluster there "
                                  f"({exc})") from None
    return ray


def _progress(total: int, enabled: bool, desc: str = "sweep"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, leave=False)


def summarize_sweep(points: list[SweepPoint], target: float = 0.9) -> dict:
    """Per-rate means over seeds, the knee of those means, and each seed's own knee (the
    spread shows how much one seed's arrivals move it)."""
    rates = sorted({p.rate for p in points})
    rows = []
    for rate in rates:
        group = [p.summary for p in points if p.rate == rate]
        row = {"rate": rate, "num_seeds": len(group)}
        for key in ROW_MEANS:
            values = [g[key] for g in group if g.get(key) is not None]
            row[key] = float(np.mean(values)) if values else math.nan
        row["statuses"] = _summed([g.get("statuses", {}) for g in group])
        rows.append(row)
    knee = metrics.knee([r["rate"] for r in rows], [r["slo_attainment"] for r in rows], target)
    at_knee = next((r for r in rows if r["rate"] == knee), None)
    by_seed = {}
    for seed in sorted({p.seed for p in points}):
        mine = [p for p in points if p.seed == seed]
        by_seed[seed] = metrics.knee([p.rate for p in mine],
                                     [p.summary["slo_attainment"] for p in mine], target)
    seed_knees = [k for k in by_seed.values() if not math.isnan(k)]
    return {"target": target, "knee_rate": knee,
            "output_tokens_per_s_at_knee": at_knee["output_tokens_per_s"] if at_knee else None,
            "knee_by_seed": by_seed,
            "knee_seed_min": min(seed_knees) if seed_knees else math.nan,
            "knee_seed_max": max(seed_knees) if seed_knees else math.nan,
            "knee_beyond_range": bool(rows) and rows[-1]["slo_attainment"] >= target,
            "statuses": _summed([r["statuses"] for r in rows]), "rows": rows}


def _summed(counts: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            total[k] = total.get(k, 0) + n
    return total


def describe_knee(summary: dict) -> str:
    """One line on the knee: where it is, its spread across seeds, or that it lies beyond
    (or below) the swept range."""
    target, knee, rows = summary["target"], summary["knee_rate"], summary["rows"]
    head = f"knee (attainment >= {100 * target:.0f}%): "
    if summary["knee_beyond_range"]:
        return (head + f"beyond the swept range: attainment is still "
                f"{100 * rows[-1]['slo_attainment']:.1f}% at {rows[-1]['rate']:g} req/s, the "
                f"highest rate swept; sweep higher rates to find it")
    if math.isnan(knee):
        return head + f"none of the rates (already below the target at {rows[0]['rate']:g} req/s)"
    spread = ""
    if len(summary["knee_by_seed"]) > 1:
        spread = (f"; across {len(summary['knee_by_seed'])} seeds "
                  f"{_rate(summary['knee_seed_min'])} to {_rate(summary['knee_seed_max'])}")
    return head + f"{knee:g} req/s{spread}"


def _rate(value: float) -> str:
    return "none" if math.isnan(value) else f"{value:g}"


def plot_sweep(summary: dict, path, title: str = "") -> None:
    """SLO attainment and P90 latencies vs rate, as a PNG (``sweep_figure``)."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(summary, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_figure(summary: dict, title: str = ""):
    """The sweep plot: attainment with the target, the knee marked (a line at the knee of the
    means, a band over the seeds' knees, or an arrow when it lies beyond the swept range),
    and P90 TTFT / TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].plot(rates, [100 * r["slo_attainment"] for r in rows], marker="o")
    axes[0].axhline(100 * summary["target"], color="grey", linestyle="--")
    axes[0].set_ylabel("SLO attainment (%)")
    _mark_knee(axes[0], summary)
    axes[1].plot(rates, [r["ttft_p90_s"] for r in rows], marker="o")
    axes[1].set_ylabel("P90 TTFT (s)")
    axes[2].plot(rates, [1e3 * r["tpot_p90_s"] for r in rows], marker="o")
    axes[2].set_ylabel("P90 TPOT (ms)")
    for ax in axes:
        ax.set_xlabel("rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _mark_knee(ax, summary: dict) -> None:
    knee, top = summary["knee_rate"], summary["rows"][-1]["rate"]
    if summary["knee_beyond_range"]:
        ax.annotate(f"knee beyond {top:g} req/s", xy=(top, 100 * summary["target"]),
                    xytext=(-110, -30), textcoords="offset points", color="tab:red",
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})
        return
    if math.isnan(knee):
        return
    ax.axvline(knee, color="tab:red", linestyle=":", label=f"knee {knee:g} req/s")
    low, high = summary["knee_seed_min"], summary["knee_seed_max"]
    if len(summary["knee_by_seed"]) > 1 and high > low:
        ax.axvspan(low, high, color="tab:red", alpha=0.15,
                   label=f"seeds' knees {low:g}-{high:g}")
    ax.legend(loc="lower left", fontsize=8)
