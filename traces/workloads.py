"""The workloads: empirical length tables with Poisson arrivals (the paper's two and Code).

Chatbot: ShareGPT conversation lengths (DistServe's rule), SLOs TTFT 2 s / TPOT 200 ms.
Summarization: prompts truncated to a uniform random length in 1900..2040 tokens (DistServe's
rule for LongBench), output lengths from arXiv summarization, SLOs TTFT 15 s / TPOT 200 ms.
Code: the (prompt, output) lengths of the Azure LLM inference trace 2023, code service (the
Splitwise paper's, ISCA 2024; in the file: median prompt 1,469 tokens, median output 13, the
timestamps unused), SLOs assumed to be the Chatbot's (TTFT 2 s / TPOT 200 ms: an
interactive service; the trace publishes no SLO).
The length tables ship in ``traces/data`` (see its NOTICE.md for sources and licences).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

from traces.trace import Trace


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    lengths_file: str
    ttft_slo_s: float
    tpot_slo_s: float
    prompt_range: tuple[int, int] | None = None   # uniform prompt lengths replace the table's


WORKLOADS: dict[str, WorkloadSpec] = {
    "chatbot": WorkloadSpec("chatbot", "sharegpt-chatbot-lengths.csv", 2.0, 0.2),
    "summarization": WorkloadSpec("summarization", "arxiv-summarization-lengths.csv", 15.0, 0.2,
                                  prompt_range=(1900, 2040)),
    # assumed SLOs (see the module docstring)
    "code": WorkloadSpec("code", "azure-llm-2023-code.csv", 2.0, 0.2),
}

#: the token-count columns of a length table, by its header: the workloads' own tables, or a
#: bundled Azure trace (``TIMESTAMP,ContextTokens,GeneratedTokens``)
LENGTH_COLUMNS = (("input_tokens", "output_tokens"), ("ContextTokens", "GeneratedTokens"))


def workload_spec(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None


@lru_cache(maxsize=None)
def length_table(filename: str) -> tuple[np.ndarray, np.ndarray]:
    """(input_tokens, output_tokens) columns of a vendored length table, read-only.

    Rows with 0 input or 0 output tokens are not servable requests and are left out (the
    ShareGPT table has 19 such rows of 13,303: see ``dropped_rows``)."""
    prompt, output = _raw_table(filename)
    keep = (prompt >= 1) & (output >= 1)
    prompt, output = prompt[keep].copy(), output[keep].copy()
    prompt.setflags(write=False)
    output.setflags(write=False)
    return prompt, output


@lru_cache(maxsize=None)
def _raw_table(filename: str) -> tuple[np.ndarray, np.ndarray]:
    lines = resources.files("traces").joinpath("data", filename).read_text().splitlines()
    header = [name.strip() for name in lines[0].split(",")]
    names = next((c for c in LENGTH_COLUMNS if set(c) <= set(header)), None)
    if names is None:
        raise ValueError(f"{filename}: no length columns in header {header}; expected one of "
                         f"{[list(c) for c in LENGTH_COLUMNS]}")
    rows = np.loadtxt(lines, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2,
                      usecols=[header.index(n) for n in names])
    return rows[:, 0], rows[:, 1]


def dropped_rows(filename: str) -> int:
    """Rows of a length table left out for having 0 input or 0 output tokens."""
    return len(_raw_table(filename)[0]) - len(length_table(filename)[0])


def sample_lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) length pairs of workload ``name``, sampled with replacement."""
    spec = workload_spec(name)
    prompt_table, output_table = length_table(spec.lengths_file)
    rows = rng.integers(0, len(prompt_table), size=n)
    prompt, output = prompt_table[rows], output_table[rows]
    if spec.prompt_range is not None:
        low, high = spec.prompt_range
        prompt = rng.integers(low, high + 1, size=n)
    return prompt.astype(np.int64), output.astype(np.int64)


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` Poisson arrival instants at ``rate`` requests/s, the first at its first gap."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def check_size(num_requests: int | None, duration_s: float | None) -> None:
    """A workload's length: ``num_requests``, ``duration_s`` or both, each positive."""
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")


def make_workload(name: str, rate: float, num_requests: int | None = None,
                  duration_s: float | None = None, seed: int = 0) -> Trace:
    """Poisson arrivals at ``rate`` over workload ``name``'s lengths.

    Give ``num_requests``, ``duration_s`` or both (then the trace stops at whichever comes
    first). One ``numpy.random.Generator`` seeded from ``seed`` drives everything.
    """
    check_size(num_requests, duration_s)
    rng = np.random.default_rng(seed)
    n = num_requests if num_requests is not None else int(rate * duration_s * 1.2 + 50)
    arrivals = poisson_arrivals(rate, n, rng)
    while duration_s is not None and num_requests is None and arrivals[-1] < duration_s:
        arrivals = np.concatenate([arrivals, arrivals[-1] + poisson_arrivals(rate, n, rng)])
    prompt, output = sample_lengths(name, len(arrivals), rng)
    trace = Trace.from_columns(arrivals, prompt, output, name=f"{name}@{rate:g}")
    return trace.until(duration_s) if duration_s is not None else trace
