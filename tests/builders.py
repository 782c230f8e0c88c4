"""Builders for simulator tests: small clusters and traces with known behaviour."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sim.config import RunConfig
from sim.models.table import TablePredictor
from sim.models.transfer import TransferCost
from traces.trace import Trace


def make_config(**changes) -> RunConfig:
    """The default run config with dotted-path changes."""
    return RunConfig().replace(**changes) if changes else RunConfig()


def make_trace(arrivals, prompts, outputs, name: str = "test") -> Trace:
    return Trace.from_columns(np.asarray(arrivals, dtype=float), prompts, outputs, name=name)


def random_trace(rng: np.random.Generator, n: int, rate: float, max_prompt: int = 3000,
                 max_output: int = 400) -> Trace:
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(1, max_prompt, n)
    outputs = rng.integers(1, max_output, n)
    return make_trace(arrivals, prompts, outputs, name="random")


class FreeTransfer:
    """A transfer pricing with no cost at all (the link's bandwidth still applies)."""

    host_slowdown = 1.0

    def price(self, num_tokens: int) -> TransferCost:
        return TransferCost(0.0, float(num_tokens), 0.0, 0.0, 1)


def queue_cluster(prefill_service_per_token: float = 0.0, prefill_fixed_s: float = 0.0,
                  **changes) -> tuple[RunConfig, dict]:
    """A cluster whose only delay is prefill: one request per batch, service time
    ``fixed + per_token * prompt``; link and decode are (nearly) instantaneous.
    A single-server FCFS queue, for checks against queueing theory. Returns the config and the
    keyword arguments for ``simulate``."""
    config = make_config(**{
        "cluster.model": "llama-3.1-8b",
        "cluster.prefill.max_batch_size": 1,
        "cluster.prefill.max_batch_tokens": 10_000_000,
        "cluster.link.bandwidth_gb_s": 1e5,
        "cluster.link.latency_s": 0.0,
        **changes,
    })
    top = 1_000_000
    prefill = TablePredictor([1, top], [prefill_fixed_s + prefill_service_per_token,
                                        prefill_fixed_s + prefill_service_per_token * top],
                             [1, 1000], [0, 1e9], [[1e-9, 1e-9], [1e-9, 1e-9]])
    return config, {"predictors": (prefill, prefill), "pricing": FreeTransfer()}


@contextmanager
def run_stub_server(*flags: str, ttft_s: float = 0.02, tpot_s: float = 0.005):
    """Start ``traces.stub_server`` with ``flags`` in its own process; yield its base URL."""
    command = [sys.executable, "-m", "traces.stub_server", "--ttft", str(ttft_s),
               "--tpot", str(tpot_s), *flags]
    proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), f"stub server did not start: {line!r}"
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def assert_sketched_percentiles(summary: dict, records) -> dict[str, float]:
    """Every percentile a streamed summary says it sketched (``summary["percentiles"]``) lies
    within the sketch's relative accuracy of the exact rank-floor value over ``records``'
    successful requests. Returns those exact values by key."""
    from traces import metrics

    note = summary["percentiles"]
    alpha = note["relative_accuracy"]
    ok = metrics.ok_mask(records)
    values = {"ttft": metrics.ttft(records), "tpot": metrics.tpot(records),
              "e2e": metrics.e2e(records)}
    for stage, start, end in metrics.TTFT_STAGES:
        values[f"ttft_{stage}"] = (records[end] - records[start]).to_numpy(dtype=float)
    exact = {}
    for key in note["approximate"]:
        name, q = key[:-2].rsplit("_p", 1)
        v = values[name][ok]
        lower = exact[key] = np.percentile(v[~np.isnan(v)], int(q), method="lower")
        assert abs(summary[key] - lower) <= alpha * abs(lower) + 1e-12, key
    return exact


def checked_simulate(config=None, trace=None, **options):
    """``simulate`` whose decode instances check their state's invariants
    (``sim.engine.decode_state``) after every timer firing, and hold nothing at the end of
    a run to its end (``DecodeInstance.check``)."""
    import sim.engine.cluster as cluster
    from sim.engine.decode import DecodeInstance

    made = []

    class Checked(DecodeInstance):
        check_every_step = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    base, cluster.DecodeInstance = cluster.DecodeInstance, Checked
    try:
        result = cluster.simulate(config, trace, **options)
    finally:
        cluster.DecodeInstance = base
    assert made
    for d in made:
        d.check(ended=options.get("until") is None)
    return result
