"""Synthetic workloads: arrival processes over empirical or fitted length distributions.

Arrival processes (``ArrivalSpec.kind``), each at long-run mean rate ``rate`` requests/s
except ``onoff``:

- ``poisson``: exponential gaps with mean 1/rate (coefficient of variation 1).
- ``gamma``: gamma gaps with mean 1/rate and coefficient of variation ``cv``
  (shape k = 1/cv^2, scale = cv^2/rate). cv > 1 is burstier than Poisson, cv < 1 more regular,
  cv = 1 is Poisson.
- ``onoff``: Poisson at ``rate`` during on-periods of ``on_s`` seconds separated by silent
  off-periods of ``off_s`` seconds, starting "on" at 0; long-run mean rate
  rate * on_s / (on_s + off_s).

The first request arrives after one gap (as in ``traces.workloads``).

Several customers (``Customer``: a tenant name, an arrival process and lengths) merge into one
trace with a ``tenant`` column (``multi_tenant``); ``bursty_customers`` is the worked example
of a service that slows down when one customer bursts: quiet Poisson customers beside one
that sends on/off bursts far above its long-run rate.

Length sources, each with ``sample(n, rng) -> (prompt, output)`` int64 arrays:

- ``EmpiricalLengths``: (prompt, output) pairs drawn with replacement from a table -- a paper
  workload's, a CSV with ``input_tokens,output_tokens`` or a loaded ``Trace`` -- so the
  correlation between prompt and output length is kept.
- ``WorkloadLengths``: a paper workload exactly as ``traces.workloads`` samples it.
- ``FittedLengths``: a ``scipy.stats`` family fitted to prompt and output lengths separately
  (``fit_lengths``); draws are independent and rounded *up* to integers, so every length is
  >= 1. Nothing is capped here; use ``traces.shaping.cap_lengths`` and read its counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.trace import Trace
from traces.workloads import length_table, sample_lengths, workload_spec

ARRIVAL_KINDS = ("poisson", "gamma", "onoff")
FAMILIES = ("lognorm", "gamma", "weibull_min", "expon")


@dataclass(frozen=True)
class ArrivalSpec:
    """An arrival process; see the module docstring for each kind's parameters."""

    kind: str = "poisson"
    rate: float = 1.0
    cv: float = 1.0
    on_s: float = 1.0
    off_s: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival kind {self.kind!r} is not one of {list(ARRIVAL_KINDS)}")
        for name in ("rate", "cv", "on_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if not (math.isfinite(self.off_s) and self.off_s >= 0):
            raise ValueError(f"off_s must be finite and >= 0, got {self.off_s}")

    @property
    def mean_rate(self) -> float:
        if self.kind == "onoff":
            return self.rate * self.on_s / (self.on_s + self.off_s)
        return self.rate


def arrival_times(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival instants (seconds, non-decreasing) of process ``spec``."""
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    return _to_wall_clock(spec, np.cumsum(_gaps(spec, n, rng)))


def _gaps(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Gaps of the underlying renewal process (for ``onoff``: in on-time)."""
    if spec.kind == "gamma":
        return rng.gamma(1.0 / spec.cv ** 2, spec.cv ** 2 / spec.rate, size=n)
    return rng.exponential(1.0 / spec.rate, size=n)


def _to_wall_clock(spec: ArrivalSpec, times: np.ndarray) -> np.ndarray:
    """Insert the off-periods: on-time t lands in on-period floor(t / on_s)."""
    if spec.kind != "onoff":
        return times
    return times + np.floor(times / spec.on_s) * spec.off_s


@dataclass(frozen=True)
class EmpiricalLengths:
    """(prompt, output) pairs drawn with replacement from a table of observed pairs."""

    prompt: np.ndarray   # [m] int64 >= 1
    output: np.ndarray   # [m] int64 >= 1

    def __post_init__(self) -> None:
        prompt = np.asarray(self.prompt, dtype=np.int64)
        output = np.asarray(self.output, dtype=np.int64)
        if prompt.shape != output.shape or prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError(f"length table needs two equal, non-empty columns, got "
                             f"{prompt.shape} and {output.shape}")
        for name, values in (("prompt", prompt), ("output", output)):
            if np.any(values < 1):
                i = int(np.flatnonzero(values < 1)[0])
                raise ValueError(f"length table row {i}: {name} length {values[i]} must be >= 1")
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "output", output)

    @classmethod
    def from_workload(cls, name: str) -> "EmpiricalLengths":
        return cls(*length_table(workload_spec(name).lengths_file))

    @classmethod
    def from_trace(cls, trace: Trace) -> "EmpiricalLengths":
        return cls(trace.num_prompt_tokens, trace.num_output_tokens)

    @classmethod
    def from_csv(cls, path, skip_bad: bool = False) -> "EmpiricalLengths":
        """A CSV with ``input_tokens,output_tokens`` columns (as the tables in traces/data).

        A row with a length < 1 is an error naming its line, or with ``skip_bad`` left out.
        """
        from traces.loaders import load_trace

        mapping = {"arrival_at": "input_tokens", "num_prompt_tokens": "input_tokens",
                   "num_output_tokens": "output_tokens"}
        trace, _ = load_trace(Path(path), "csv", mapping=mapping, skip_bad=skip_bad)
        return cls.from_trace(trace)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        rows = rng.integers(0, len(self.prompt), size=n)
        return self.prompt[rows], self.output[rows]


@dataclass(frozen=True)
class WorkloadLengths:
    """A paper workload's lengths, sampled exactly as ``traces.workloads`` does."""

    name: str

    def __post_init__(self) -> None:
        workload_spec(self.name)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return sample_lengths(self.name, n, rng)


@dataclass(frozen=True)
class FittedLengths:
    """Independent prompt and output lengths from a fitted ``scipy.stats`` family."""

    family: str
    prompt_params: tuple[float, ...]
    output_params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {list(FAMILIES)}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        import scipy.stats

        dist = getattr(scipy.stats, self.family)
        prompt = dist.rvs(*self.prompt_params, size=n, random_state=rng)
        output = dist.rvs(*self.output_params, size=n, random_state=rng)
        return _ceil_positive(prompt), _ceil_positive(output)


def fit_lengths(prompt, output, family: str = "lognorm") -> FittedLengths:
    """Fit ``family`` (location fixed at 0) to observed prompt and output lengths."""
    import scipy.stats

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {list(FAMILIES)}")
    dist = getattr(scipy.stats, family)
    params = []
    for name, values in (("prompt", prompt), ("output", output)):
        values = np.asarray(values, dtype=float)
        if len(values) < 2 or np.any(~np.isfinite(values)) or np.any(values <= 0):
            raise ValueError(f"fit_lengths: {name} lengths must be >= 2 positive finite values")
        params.append(tuple(float(p) for p in dist.fit(values, floc=0)))
    return FittedLengths(family, params[0], params[1])


def synthesize(arrivals: ArrivalSpec, lengths, num_requests: int | None = None,
               duration_s: float | None = None, seed: int = 0, name: str = "synthetic") -> Trace:
    """A trace of ``arrivals`` over ``lengths``; stops at ``num_requests`` or ``duration_s``.

    One ``numpy.random.Generator`` seeded from ``seed`` draws arrivals, then lengths.
    """
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests or duration_s")
    rng = np.random.default_rng(seed)
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        times = arrival_times(arrivals, num_requests, rng)
    else:
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be finite and > 0, got {duration_s}")
        times = _arrivals_until(arrivals, duration_s, rng)
    prompt, output = lengths.sample(len(times), rng)
    return Trace.from_columns(times, prompt, output, name=name)


def _arrivals_until(spec: ArrivalSpec, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    chunk = int(spec.mean_rate * duration_s * 1.2) + 64
    times = np.cumsum(_gaps(spec, chunk, rng))
    while _to_wall_clock(spec, times[-1:])[0] < duration_s:
        times = np.concatenate([times, times[-1] + np.cumsum(_gaps(spec, chunk, rng))])
    wall = _to_wall_clock(spec, times)
    return wall[wall < duration_s]


def _ceil_positive(values: np.ndarray) -> np.ndarray:
    out = np.ceil(values)
    if np.any(out < 1):
        raise ValueError("fitted distribution drew a length < 1; use a positive family")
    return out.astype(np.int64)


@dataclass(frozen=True)
class Customer:
    """One tenant of a multi-tenant trace: its name, arrival process and lengths."""

    tenant: str
    arrivals: ArrivalSpec
    lengths: object          # EmpiricalLengths, WorkloadLengths or FittedLengths

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"customer tenant must be a non-empty string, got {self.tenant!r}")


def multi_tenant(customers: list[Customer], duration_s: float, seed: int = 0,
                 name: str = "multi-tenant") -> Trace:
    """Each customer's requests over ``duration_s`` seconds, merged in arrival order (ties in
    customer order), with a ``tenant`` column and ids 0..n-1 in arrival order. Customer k
    draws from its own generator (``SeedSequence(seed).spawn``), so adding a customer leaves
    the others' requests as they were."""
    if not customers:
        raise ValueError("multi_tenant needs at least one customer")
    names = [c.tenant for c in customers]
    if len(set(names)) != len(names):
        raise ValueError(f"customer tenants must be unique, got {names}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s}")
    parts = []
    for customer, child in zip(customers, np.random.SeedSequence(seed).spawn(len(customers))):
        rng = np.random.default_rng(child)
        times = _arrivals_until(customer.arrivals, duration_s, rng)
        prompt, output = customer.lengths.sample(len(times), rng)
        parts.append((times, prompt, output, np.full(len(times), customer.tenant, dtype=object)))
    times, prompt, output, tenant = (np.concatenate(cols) for cols in zip(*parts))
    order = np.argsort(times, kind="stable")
    return Trace(times[order], prompt[order], output[order], np.arange(len(times)), name=name,
                 tenant=tenant[order])


def bursty_customers(rate: float = 0.5, num_quiet: int = 3, on_s: float = 30.0,
                     off_s: float = 90.0, workload: str = "chatbot", duration_s: float = 1200.0,
                     seed: int = 0) -> Trace:
    """Customers ``quiet-1..num_quiet`` at ``rate / (num_quiet + 1)`` req/s each (Poisson) and
    one ``bursty`` customer with the same long-run rate sent as bursts: ``on_s`` seconds at
    ``(on_s + off_s) / on_s`` times that rate, then ``off_s`` seconds of silence. The long-run
    total is ``rate``; during a burst the total is higher by the bursty customer's excess.
    Lengths from the paper workload ``workload``."""
    if num_quiet < 1:
        raise ValueError(f"num_quiet must be >= 1, got {num_quiet}")
    share = rate / (num_quiet + 1)
    lengths = WorkloadLengths(workload)
    quiet = [Customer(f"quiet-{k + 1}", ArrivalSpec("poisson", share), lengths)
             for k in range(num_quiet)]
    burst = ArrivalSpec("onoff", share * (on_s + off_s) / on_s, on_s=on_s, off_s=off_s)
    return multi_tenant(quiet + [Customer("bursty", burst, lengths)], duration_s, seed,
                        name=f"bursty-{workload}@{rate:g}")
