"""Run configuration: small frozen dataclasses, validated on construction, loaded from TOML.

A bad value raises ``ConfigError`` naming the field (dotted path) and the allowed range. The
default configuration is the paper's Chatbot scenario: Llama 3.1 70B, one prefill instance of
4x A100 PCIe (TP4), one decode instance of 4x Tenstorrent p150a (TP4), the KV cache moved by
HAWK (GN-HAWK) over one 200 Gb/s HDR InfiniBand NIC, 8-bit KV (fp8 on the GPU, bfloat8_b on
the NPU), Poisson arrivals at 0.5 req/s, SLOs TTFT 2 s / TPOT 200 ms, timed by the ``paper``
profile (``sim/profiles/paper.toml``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hardware.catalog import DTYPE_BYTES, WEIGHT_FORMATS, devices, models


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check_range(where: str, name: str, value, low, high, integer: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) and not isinstance(value, bool) if integer else (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not ok or not low <= value <= high:
        raise ConfigError(f"{where}.{name} must be {kind} in [{low}, {high}], got {value!r}")


def _check_choice(where: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{where}.{name} must be one of {sorted(choices)}, got {value!r}")


@dataclass(frozen=True)
class InstanceConfig:
    """One kind of serving instance: ``num_instances`` replicas of ``tp`` devices each."""

    device: str
    tp: int = 4
    num_instances: int = 1
    max_batch_size: int = 128
    max_batch_tokens: int = 8192        # prefill token budget per iteration (vLLM max_num_batched_tokens)
    block_size: int = 16                # KV block size in tokens
    kv_dtype: str = "bfloat16"
    weight_format: str = "bfloat16"
    memory_utilization: float = 0.9     # share of device memory for weights + KV (rest: activations)
    kv_cache_gb: float = 0.0            # cap on KV memory in GB (prefill: the send buffer;
                                        # decode: the KV pool); 0 = all free memory
    max_num_blocks: int = 0             # KV blocks the serving engine allocates (TT vLLM's
                                        # max_num_blocks); 0 = as many as memory holds
    role: str = "instance"

    def __post_init__(self) -> None:
        w = f"cluster.{self.role}"
        _check_choice(w, "device", self.device, devices())
        _check_range(w, "tp", self.tp, 1, 64, integer=True)
        _check_range(w, "num_instances", self.num_instances, 1, 4096, integer=True)
        _check_range(w, "max_batch_size", self.max_batch_size, 1, 65536, integer=True)
        _check_range(w, "max_batch_tokens", self.max_batch_tokens, 1, 10_000_000, integer=True)
        _check_range(w, "block_size", self.block_size, 1, 4096, integer=True)
        _check_choice(w, "kv_dtype", self.kv_dtype, DTYPE_BYTES)
        _check_choice(w, "weight_format", self.weight_format, WEIGHT_FORMATS)
        _check_range(w, "memory_utilization", self.memory_utilization, 0.05, 1.0)
        _check_range(w, "kv_cache_gb", self.kv_cache_gb, 0.0, 1e6)
        _check_range(w, "max_num_blocks", self.max_num_blocks, 0, 10**9, integer=True)


@dataclass(frozen=True)
class LinkConfig:
    """The network between prefill and decode instances and how the KV cache crosses it."""

    mechanism: str = "GN-HAWK"          # a sim.transfer.MECHANISMS name
    bandwidth_gb_s: float | None = None  # NIC bandwidth; None: the profile's [transfer] NIC
    latency_s: float = 2e-6             # one-way network latency per transfer

    def __post_init__(self) -> None:
        from sim.transfer import MECHANISMS

        if self.bandwidth_gb_s is not None:
            _check_range("cluster.link", "bandwidth_gb_s", self.bandwidth_gb_s, 1e-3, 1e5)
        _check_range("cluster.link", "latency_s", self.latency_s, 0.0, 10.0)
        _check_choice("cluster.link", "mechanism", self.mechanism, MECHANISMS)


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "chatbot"
    rate: float = 0.5                   # requests/s (Poisson)
    num_requests: int | None = 2000
    duration_s: float | None = None
    trace: str | None = None            # a trace file replaces the synthetic arrivals

    def __post_init__(self) -> None:
        from traces.workloads import WORKLOADS

        _check_choice("workload", "name", self.name, WORKLOADS)
        _check_range("workload", "rate", self.rate, 1e-6, 1e6)
        if self.num_requests is not None:
            _check_range("workload", "num_requests", self.num_requests, 1, 100_000_000,
                         integer=True)
        if self.duration_s is not None:
            _check_range("workload", "duration_s", self.duration_s, 1e-3, 1e9)
        if self.num_requests is None and self.duration_s is None and self.trace is None:
            raise ConfigError("workload needs num_requests, duration_s or trace")


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        _check_range("slo", "ttft_s", self.ttft_s, 1e-6, 1e6)
        _check_range("slo", "tpot_s", self.tpot_s, 1e-6, 1e6)


def _prefill_default() -> InstanceConfig:
    return InstanceConfig(device="a100-pcie", max_batch_size=32, kv_dtype="fp8", role="prefill")


def _decode_default() -> InstanceConfig:
    # TT vLLM plugin: paged KV for 32 sequences x 2048 tokens in 32-token blocks (paper profile)
    return InstanceConfig(device="p150a", max_batch_size=32, block_size=32, kv_dtype="bfloat8_b",
                          weight_format="tt-mixed", max_num_blocks=2048, role="decode")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "llama-3.1-70b"
    prefill: InstanceConfig = field(default_factory=_prefill_default)
    decode: InstanceConfig = field(default_factory=_decode_default)
    link: LinkConfig = field(default_factory=LinkConfig)
    profile: str = "paper"
    routing: str = "round_robin"
    decode_routing: str = "least_loaded"
    fast_forward: bool = True           # False: iteration-by-iteration decode (the oracle)

    def __post_init__(self) -> None:
        from policies.routing import ROUTING

        _check_choice("cluster", "model", self.model, models())
        _check_choice("cluster", "routing", self.routing, ROUTING)
        _check_choice("cluster", "decode_routing", self.decode_routing, ROUTING)


@dataclass(frozen=True)
class RunConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        _check_range("run", "seed", self.seed, 0, 2**63 - 1, integer=True)

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with dotted-path changes, e.g. ``replace(**{"workload.rate": 0.7})``."""
        return from_dict(_merge(to_dict(self), _undot(changes)))


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def _undot(changes: dict) -> dict:
    out: dict = {}
    for key, value in changes.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def _build(cls, data: dict, where: str, **fixed):
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)} - set(fixed)
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(names)}")
    return cls(**data, **fixed)


def from_dict(data: dict) -> RunConfig:
    """Build a ``RunConfig`` from nested dicts (TOML tables), defaults filling the gaps."""
    data = _merge(to_dict(RunConfig()), data)
    cluster = dict(data["cluster"])
    for role in ("prefill", "decode"):
        cluster[role] = _build(InstanceConfig, {k: v for k, v in cluster[role].items()
                                                if k != "role"}, f"cluster.{role}", role=role)
    cluster["link"] = _build(LinkConfig, cluster["link"], "cluster.link")
    return _build(RunConfig, {
        "cluster": _build(ClusterConfig, cluster, "cluster"),
        "workload": _build(WorkloadConfig, data["workload"], "workload"),
        "slo": _build(SloConfig, data["slo"], "slo"),
        **{k: v for k, v in data.items() if k not in ("cluster", "workload", "slo")},
    }, "run")


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML file: top-level ``seed`` and tables ``[cluster]``, ``[cluster.prefill]``,
    ``[cluster.decode]``, ``[cluster.link]``, ``[workload]``, ``[slo]``."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
