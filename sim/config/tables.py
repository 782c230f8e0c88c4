"""The cluster's configuration tables (``[cluster]``, its ``prefill``/``decode`` instances,
``link`` and ``policies``; ``[workload]``, ``[slo]``): frozen dataclasses validated on
construction, each instance's unset keys resolved from its device's serving rules or the
default scenario (``sim.config`` explains where a value comes from). ``RunConfig``, which
holds them, and reading TOML are in ``sim.config``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hardware.catalog import DTYPE_BYTES, WEIGHT_FORMATS, devices
from sim.config.checks import ConfigError, _check_bool, _check_choice, _check_range, _check_str

#: where a resolved value came from ("profile": a measured profile directory's [serving],
#: ``sim.models.profile_dir.mirror_settings``)
SOURCES = ("user", "device", "scenario", "profile")

#: the default scenario, per role: its device and what it assumes there beyond the device's
#: own defaults (paper profile [kv] and [serving]: 8-bit KV, 32 sequences per prefill batch)
SCENARIO = {
    "prefill": {"device": "a100-pcie", "kv_dtype": "fp8", "max_batch_size": 32},
    "decode": {"device": "p150a"},
    "aggregated": {"device": "a100-pcie"},
}
#: vLLM V1's token budget beside its max_num_seqs default on a GPU (devices.toml's top
#: comment: vllm/engine/arg_utils.py pairs 1024 sequences with 8192 tokens, 256 with 2048);
#: an aggregated instance's step takes it (the scenario's prefill keeps its own 2048)
VLLM_TOKEN_BUDGET = {1024: 8192, 256: 2048}
#: the cluster's shapes (``[cluster] kind``): P/D pools (today's), one aggregated pool, both
CLUSTER_KINDS = ("disaggregated", "aggregated", "both")
#: the scenario's instance settings that do not depend on the device (docs/paper.md 5: TP4;
#: 2,048 tokens per prefill iteration: vLLM V1's default on an A100, as in the paper profile)
SCENARIO_ANY_DEVICE = {"tp": 4, "num_instances": 1, "max_batch_tokens": 2048,
                       "kv_cache_gb": None, "admission": "on-demand-recompute",
                       "prefix_caching": False}


@dataclass(frozen=True)
class InstanceConfig:
    """One kind of serving instance: ``num_instances`` replicas of ``tp`` devices each.

    Every setting left None is resolved on construction (see the module docstring); after it
    the fields hold the values the run uses and ``sources`` says where each came from. The
    two caps may stay None: ``kv_cache_gb`` None (or 0) = no cap on KV memory;
    ``max_num_blocks`` None (or 0) = as many blocks as memory holds (vLLM on a GPU)."""

    device: str | None = None
    tp: int | None = None
    num_instances: int | None = None
    max_batch_size: int | None = None
    max_batch_tokens: int | None = None  # prefill token budget per iteration (max_num_batched_tokens)
    block_size: int | None = None       # KV block size in tokens
    kv_dtype: str | None = None
    weight_format: str | None = None
    memory_utilization: float | None = None  # share of device memory for weights + KV
    kv_cache_gb: float | None = None    # cap on KV memory in GB (prefill: the send buffer;
                                        # decode: the KV pool)
    max_num_blocks: int | None = None   # KV blocks the engine allocates (TT vLLM's max_num_blocks)
    admission: str | None = None        # decode KV admission (policies.admission.ADMISSION)
    prefix_caching: bool | None = None  # keep prompts' KV blocks for later prompts sharing
                                        # their prefix (sim.engine.prefix_cache; a decode
                                        # instance then pulls only what it lacks); default off
    role: str = "instance"

    def __post_init__(self) -> None:
        w = f"cluster.{self.role}"
        values, sources = _resolve(self, w)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sources", sources)
        _check_range(w, "tp", self.tp, 1, 64, integer=True)
        _check_range(w, "num_instances", self.num_instances, 1, 4096, integer=True)
        _check_range(w, "max_batch_size", self.max_batch_size, 1, 65536, integer=True)
        _check_range(w, "max_batch_tokens", self.max_batch_tokens, 1, 10_000_000, integer=True)
        _check_range(w, "block_size", self.block_size, 1, 4096, integer=True)
        _check_choice(w, "kv_dtype", self.kv_dtype, DTYPE_BYTES)
        _check_choice(w, "weight_format", self.weight_format, WEIGHT_FORMATS)
        _check_range(w, "memory_utilization", self.memory_utilization, 0.05, 1.0)
        if self.kv_cache_gb is not None:
            _check_range(w, "kv_cache_gb", self.kv_cache_gb, 0.0, 1e6)
        if self.max_num_blocks is not None:
            _check_range(w, "max_num_blocks", self.max_num_blocks, 0, 10**9, integer=True)
        _check_admission(self, w)
        _check_prefix_caching(self, w)
        _check_pairing(self, w)

    @property
    def sources(self) -> dict[str, str]:
        """Setting -> "user", "device" or "scenario"."""
        return dict(self._sources)


SETTINGS = tuple(f.name for f in dataclasses.fields(InstanceConfig) if f.name != "role")


def _resolve(inst: InstanceConfig, w: str) -> tuple[dict, dict]:
    """Each setting's value and source: the user's, the scenario's on its device, the device's."""
    given = {name: getattr(inst, name) for name in SETTINGS if getattr(inst, name) is not None}
    scenario = SCENARIO.get(inst.role, {})
    device = given.get("device", scenario.get("device"))
    if device is None:
        raise ConfigError(f"{w}.device must be set: one of {sorted(devices())}")
    _check_choice(w, "device", device, devices())
    assumed = scenario if device == scenario.get("device") else {}
    device_defaults = devices()[device].serving.defaults()
    if inst.role == "aggregated" and devices()[device].kind == "gpu":
        budget = VLLM_TOKEN_BUDGET.get(device_defaults["max_batch_size"])
        if budget is not None:
            device_defaults["max_batch_tokens"] = budget
    values, sources = {}, {}
    for name in SETTINGS:
        for source, table in (("user", given), ("scenario", assumed),
                              ("device", device_defaults), ("scenario", SCENARIO_ANY_DEVICE)):
            if name in table:
                values[name], sources[name] = table[name], source
                break
    return values, sources


def _check_admission(inst: InstanceConfig, w: str) -> None:
    """Decode KV admission is a decode setting; prefill instances have none."""
    from policies.admission import ADMISSION

    if inst.role == "aggregated":
        # vLLM V1 allocates blocks on demand and recomputes a preempted request
        _check_choice(w, "admission", inst.admission, ("on-demand-recompute",))
        if inst.max_batch_size > inst.max_batch_tokens:
            raise ConfigError(f"{w}.max_batch_size = {inst.max_batch_size} exceeds "
                              f"{w}.max_batch_tokens = {inst.max_batch_tokens}: every running "
                              f"sequence's decode takes a token of the step's budget (vLLM "
                              f"refuses max_num_seqs > max_num_batched_tokens)")
    elif inst.role == "prefill":
        if inst.sources["admission"] == "user":
            raise ConfigError(f"{w}.admission: KV admission is a decode setting; set it in "
                              f"[cluster.decode]")
        object.__setattr__(inst, "admission", None)
    else:
        _check_choice(w, "admission", inst.admission, ADMISSION)


def _check_prefix_caching(inst: InstanceConfig, w: str) -> None:
    _check_bool(w, "prefix_caching", inst.prefix_caching)


def _check_pairing(inst: InstanceConfig, w: str) -> None:
    """Refuse a format or block size the instance's device cannot run, naming what it can."""
    rules = devices()[inst.device].serving
    for name, allowed in (("weight_format", rules.weight_formats),
                          ("kv_dtype", rules.kv_dtypes)):
        value = getattr(inst, name)
        if value not in allowed:
            raise ConfigError(f"{w}.{name} = {value!r} cannot run on {inst.device}; "
                              f"{inst.device} runs {list(allowed)}")
    if inst.block_size % rules.block_multiple:
        raise ConfigError(f"{w}.block_size = {inst.block_size} cannot be tiled on "
                          f"{inst.device}: it must be a multiple of {rules.block_multiple} "
                          f"(default {rules.block_size})")


@dataclass(frozen=True)
class LinkConfig:
    """The network between prefill and decode instances and how the KV cache crosses it."""

    mechanism: str = "GN-HAWK"          # a hardware.mechanism_specs.MECHANISMS name
    bandwidth_gb_s: float | None = None  # NIC bandwidth; None: the profile's [transfer] NIC
    latency_s: float = 2e-6             # one-way network latency per transfer

    def __post_init__(self) -> None:
        from sim.models.transfer import MECHANISMS

        if self.bandwidth_gb_s is not None:
            _check_range("cluster.link", "bandwidth_gb_s", self.bandwidth_gb_s, 1e-3, 1e5)
        _check_range("cluster.link", "latency_s", self.latency_s, 0.0, 10.0)
        _check_choice("cluster.link", "mechanism", self.mechanism, MECHANISMS)


@dataclass(frozen=True)
class PolicyConfig:
    """Prefill batching and tenant fairness (``policies``): a name from the policy's dict or a
    ``module:function`` import path. ``tenant_weights`` and ``priority_tenants`` feed the
    ``weighted_fair`` policy (tenants not named weigh 1)."""

    prefill_batching: str = "chunked"
    fairness: str = "fcfs"
    tenant_weights: dict = field(default_factory=dict)
    priority_tenants: tuple = ()

    def __post_init__(self) -> None:
        _check_policy("cluster.policies", "prefill_batching", self.prefill_batching)
        _check_policy("cluster.policies", "fairness", self.fairness)
        if not isinstance(self.tenant_weights, dict):
            raise ConfigError(f"cluster.policies.tenant_weights must be a table of tenant = "
                              f"weight, got {self.tenant_weights!r}")
        for tenant, weight in self.tenant_weights.items():
            _check_range("cluster.policies.tenant_weights", tenant, weight, 1e-9, 1e9)
        if not isinstance(self.priority_tenants, (list, tuple)) or not all(
                isinstance(t, str) for t in self.priority_tenants):
            raise ConfigError(f"cluster.policies.priority_tenants must be a list of tenant "
                              f"names, got {self.priority_tenants!r}")
        object.__setattr__(self, "priority_tenants", tuple(self.priority_tenants))


def _check_policy(where: str, name: str, value) -> None:
    from policies import PolicyError, resolve

    kind = "fairness" if name == "fairness" else (
        "prefill_batching" if name == "prefill_batching" else "routing")
    try:
        resolve(kind, value)
    except PolicyError as exc:
        raise ConfigError(f"{where}.{name}: {exc}") from None


#: the most requests one run may have (by count, or rate x duration)
MAX_REQUESTS = 100_000_000


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
            _check_range("workload", "num_requests", self.num_requests, 1, MAX_REQUESTS,
                         integer=True)
        if self.duration_s is not None:
            _check_range("workload", "duration_s", self.duration_s, 1e-3, 1e9)
        if self.trace is not None:
            _check_str("workload", "trace", self.trace)
        if self.num_requests is None and self.duration_s is None and self.trace is None:
            raise ConfigError("workload needs num_requests, duration_s or trace")
        if self.duration_s is not None and self.trace is None and (
                self.num_requests is None or self.num_requests > self.rate * self.duration_s):
            expected = self.rate * self.duration_s
            if expected > MAX_REQUESTS:
                raise ConfigError(
                    f"workload: rate {self.rate:g} x duration_s {self.duration_s:g} = "
                    f"{expected:,.3g} requests, more than the {MAX_REQUESTS:,} a run may have; "
                    f"lower the rate or the duration (or set num_requests)")


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        _check_range("slo", "ttft_s", self.ttft_s, 1e-6, 1e6)
        _check_range("slo", "tpot_s", self.tpot_s, 1e-6, 1e6)


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "llama-3.1-70b"
    prefill: InstanceConfig = field(default_factory=lambda: InstanceConfig(role="prefill"))
    decode: InstanceConfig = field(default_factory=lambda: InstanceConfig(role="decode"))
    link: LinkConfig = field(default_factory=LinkConfig)
    profile: str = "paper"
    routing: str = "round_robin"
    decode_routing: str = "least_loaded"
    fast_forward: bool = True           # False: iteration-by-iteration decode (the oracle)
    policies: PolicyConfig = field(default_factory=PolicyConfig)
    kind: str = "disaggregated"         # CLUSTER_KINDS
    aggregated: InstanceConfig | None = None   # [cluster.aggregated]; None: disaggregated
    pool_routing: str = "least_loaded"  # kind "both": policies.routing.POOL_ROUTING
    aggregated_share: float = 0.5       # pool_routing "share": the aggregated pool's share

    def __post_init__(self) -> None:
        _check_choice("cluster", "kind", self.kind, CLUSTER_KINDS)
        _check_aggregated(self)
        _check_str("cluster", "profile", self.profile)
        _check_policy("cluster", "routing", self.routing)
        _check_policy("cluster", "decode_routing", self.decode_routing)
        _check_bool("cluster", "fast_forward", self.fast_forward)
        if _check_measured_model(self):
            return                      # the measured profile's own model and workers
        spec = _check_model(self)
        # an aggregated cluster serves on its aggregated pool alone: the P/D pools' defaults
        # (tp 4 and their devices) are not checked against the model
        serving = (self.aggregated,) if self.kind == "aggregated" else (
            self.prefill, self.decode, self.aggregated)
        for inst in (i for i in serving if i is not None):
            _check_heads(spec, inst)
            _check_npu(spec, inst)
        if self.kind != "aggregated":
            _check_same_kv_dtype(self)


def _check_aggregated(cluster: "ClusterConfig") -> None:
    """An aggregated pool exists where ``kind`` asks for one (built from the device's
    defaults when [cluster.aggregated] is not given), and only there."""
    from policies.routing import POOL_ROUTING

    if cluster.kind == "disaggregated":
        if cluster.aggregated is not None:
            raise ConfigError("cluster.aggregated: set cluster.kind = \"aggregated\" or "
                              "\"both\" to serve from an aggregated pool (kind is "
                              "\"disaggregated\")")
        return
    if cluster.aggregated is None:
        object.__setattr__(cluster, "aggregated", InstanceConfig(role="aggregated"))
    if cluster.kind == "both":
        _check_choice("cluster", "pool_routing", cluster.pool_routing, POOL_ROUTING)
        _check_range("cluster", "aggregated_share", cluster.aggregated_share, 0.0, 1.0)


def _check_measured_model(cluster: "ClusterConfig") -> bool:
    """A measured profile directory times its own model (``cluster.model = "profile"``), and
    only it does. True when the profile is a directory."""
    from sim.models.profile_dir import MEASURED_MODEL

    measured = _measured_profile(cluster.profile) is not None   # a bad one is named here
    if measured:
        if cluster.model != MEASURED_MODEL:
            raise ConfigError(f"cluster.model = {cluster.model!r}: the measured profile "
                              f"{cluster.profile} times its own model; leave cluster.model "
                              f"unset (or {MEASURED_MODEL!r})")
    elif cluster.model == MEASURED_MODEL:
        raise ConfigError(f"cluster.model = {MEASURED_MODEL!r} needs cluster.profile to name a "
                          f"measured profile directory (hawk real profile --out DIR), got "
                          f"{cluster.profile!r}")
    return measured


def _check_same_kv_dtype(cluster: "ClusterConfig") -> None:
    """A GPU-to-GPU mechanism copies KV blocks as they are: both sides need one KV dtype."""
    from sim.models.transfer import MECHANISMS

    p, d = cluster.prefill, cluster.decode
    if (MECHANISMS[cluster.link.mechanism].destination != "gpu"
            or devices()[d.device].kind != "gpu" or p.kv_dtype == d.kv_dtype):
        return
    raise ConfigError(
        f"cluster.decode.kv_dtype = {d.kv_dtype!r} ({_origin(d, 'kv_dtype')}) differs from "
        f"cluster.prefill.kv_dtype = {p.kv_dtype!r} ({_origin(p, 'kv_dtype')}): "
        f"{cluster.link.mechanism} copies KV blocks as they are, so set one kv_dtype on both")


def _origin(inst: InstanceConfig, name: str) -> str:
    return {"user": "set by the config", "device": f"{inst.device}'s default",
            "scenario": "the scenario's default"}[inst.sources[name]]


def _check_model(cluster: "ClusterConfig"):
    """The ``ModelSpec`` ``cluster.model`` names: a catalog name or a config.json path."""
    from hardware.catalog import model, models

    if not isinstance(cluster.model, str) or not cluster.model:
        raise ConfigError(f"cluster.model must be one of {sorted(models())} or a Hugging Face "
                          f"config.json path, got {cluster.model!r}")
    try:
        return model(cluster.model)
    except ValueError as exc:
        raise ConfigError(f"cluster.model = {cluster.model!r}: {exc}") from None


def _check_npu(model, inst: InstanceConfig) -> None:
    """An instance on a Tenstorrent NPU needs a model the TT stack runs."""
    if model.npu_refusal and devices()[inst.device].kind == "npu":
        raise ConfigError(f"cluster.{inst.role}.device = {inst.device!r}: {model.name} cannot "
                          f"run on a Tenstorrent NPU: {model.npu_refusal}")


def _check_heads(model, inst: InstanceConfig) -> None:
    """vLLM splits attention heads and KV heads evenly over the TP devices."""
    for what, heads in (("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)):
        if heads % inst.tp:
            raise ConfigError(
                f"cluster.{inst.role}.tp = {inst.tp} does not divide {model.name}'s {heads} "
                f"{what}; tensor parallelism needs a tp that divides {model.num_kv_heads} "
                f"(KV heads) and {model.num_heads} (attention heads)")


def _measured_profile(name):
    """The measured profile directory ``cluster.profile`` names (``sim.models.profile_dir``), or None
    for a profile file; a bad directory is a ``ConfigError`` naming its file and field."""
    from sim.models.profile_dir import ProfileDirError, is_profile_dir, load_profile_dir

    if not is_profile_dir(name):
        return None
    try:
        return load_profile_dir(name)
    except ProfileDirError as exc:
        raise ConfigError(str(exc)) from exc
