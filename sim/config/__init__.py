"""Run configuration: small frozen dataclasses, validated on construction, loaded from TOML.

A bad value raises ``ConfigError`` naming the field (dotted path) and the allowed values. The
default configuration is the paper's Chatbot scenario: Llama 3.1 70B, one prefill instance of
4x A100 PCIe (TP4), one decode instance of 4x Tenstorrent p150a (TP4), the KV cache moved by
HAWK (GN-HAWK) over one 200 Gb/s HDR InfiniBand NIC, 8-bit KV (fp8 on the GPU, bfloat8_b on
the NPU), vLLM V1's serving defaults on the A100 prefill (chunked prefill, a 2,048-token budget
per iteration), Poisson arrivals at 0.5 req/s, SLOs TTFT 2 s / TPOT 200 ms, timed by the
``paper`` profile (``sim/profiles/paper.toml``): the settings ``hawk paper`` runs GN-HAWK with.

Where a value comes from (``provenance``): every key a config sets is the user's; an instance
takes every key it leaves unset (None) from its device's serving rules (``[<device>.serving]``
in ``hardware/catalog/devices.toml``), except where the default scenario assumes otherwise on
the scenario's own device (``SCENARIO``: 8-bit fp8 KV and 32 sequences on the A100 prefill).
Naming another device drops those assumptions, so a config never carries one device's settings
onto another. Everything else (TP4, one instance per phase, the workload) is the scenario's.

Here: ``RunConfig`` and reading/writing it (TOML tables, ``replace``, ``provenance``). The
cluster's tables and the scenario are in ``sim.config.tables``, ``[faults]`` and ``[cells]`` in
``sim.config.faults``, the field checks in ``sim.config.checks``, the run-size guard in
``sim.config.run_size``.

May import ``sim.models`` (and ``traces``, ``policies``, ``hardware``); nothing else of
``sim``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.config.checks import ConfigError, _check_range  # noqa: F401 (ConfigError: the API)
from sim.config.faults import CellsConfig, FaultsConfig
from sim.config.tables import (SCENARIO, SCENARIO_ANY_DEVICE, SOURCES,  # noqa: F401
                               ClusterConfig, InstanceConfig, LinkConfig, PolicyConfig,
                               SloConfig, WorkloadConfig, _measured_profile)


def _check_cells(config: "RunConfig") -> None:
    """With ``instances = "split"`` every cell gets an equal share of each phase's instances."""
    cells = config.cells
    if cells.count > 1 and config.cluster.kind == "both":
        raise ConfigError(f"cells.count = {cells.count}: a cluster of kind "
                          f"{config.cluster.kind!r} does not run as cells yet; run it as one "
                          f"router domain (cells.count = 1)")
    if cells.instances != "split":
        return
    for role in _roles(config.cluster):
        n = getattr(config.cluster, role).num_instances
        if n % cells.count:
            raise ConfigError(
                f"cells.count = {cells.count} does not divide cluster.{role}.num_instances = "
                f"{n}: with cells.instances = \"split\" each cell gets an equal share of the "
                f"cluster's instances; give a multiple of {cells.count} instances per phase, or "
                f"set cells.instances = \"per-cell\" (--cell-instances per-cell) to give every "
                f"cell [cluster]'s instances")


@dataclass(frozen=True)
class RunConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    seed: int = 0
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    cells: CellsConfig = field(default_factory=CellsConfig)

    def __post_init__(self) -> None:
        _check_range("run", "seed", self.seed, 0, 2**63 - 1, integer=True)
        _check_cells(self)

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with dotted-path changes, e.g. ``replace(**{"workload.rate": 0.7})``.

        The changes apply to what was set, not to what was resolved: changing a device drops
        the settings its old device (or the scenario) had supplied."""
        return from_dict(_merge(user_settings(self), _undot(changes)))


def to_dict(config) -> dict:
    """Every resolved value, nested as in the TOML file."""
    return dataclasses.asdict(config)


def user_settings(config: RunConfig) -> dict:
    """The settings the user gave, nested as in the TOML file (what ``replace`` starts from)."""
    given = getattr(config, "_given", None)
    if given is not None:
        return copy.deepcopy(given)
    default = _flatten(to_dict(RunConfig()))        # built in code: what differs, or was set
    out = {k: v for k, v in _flatten(to_dict(config)).items()
           if not _is_instance_key(k) and v != default.get(k)}
    for role in _roles(config.cluster):
        inst = getattr(config.cluster, role)
        out.update({f"cluster.{role}.{k}": getattr(inst, k)
                    for k, s in inst.sources.items() if s == "user"})
    return _undot(out)


def provenance(config: RunConfig) -> dict[str, dict]:
    """Every resolved value and where it came from: ``{"cluster.decode.kv_dtype": {"value":
    "bfloat8_b", "source": "device"}, ...}`` (sources: ``SOURCES``)."""
    given = _flatten(user_settings(config))
    measured = getattr(config, "_from_profile", ())
    out = {}
    unused = _unused_keys(config.cluster)
    for key, value in _flatten(to_dict(config)).items():
        if key.endswith(".role") or key.startswith(unused):
            continue
        if key in measured:
            source = "profile"
        elif _is_instance_key(key):
            role, name = key.split(".")[1:]
            source = getattr(config.cluster, role).sources[name]
        else:
            source = "user" if key in given else "scenario"
        out[key] = {"value": value, "source": source}
    return out


def format_provenance(config: RunConfig) -> str:
    """``key = value  # source`` lines, TOML-like, for ``hawk simulate --show-config``."""
    lines = [(f"{key} = {_toml(row['value'], key)}", row["source"])
             for key, row in provenance(config).items()]
    width = max(len(text) for text, _ in lines)
    return "\n".join(f"{text:<{width}}  # {source}" for text, source in lines)


#: what None means where it is a setting's value
_NONE_MEANS = {"max_num_blocks": "(as many as memory holds)", "kv_cache_gb": "(no cap)",
               "bandwidth_gb_s": "(the profile's NIC)"}


def _toml(value, key: str = "") -> str:
    if value is None:
        return _NONE_MEANS.get(key.rsplit(".", 1)[-1], "(unset)")
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _is_instance_key(key: str) -> bool:
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "cluster" and parts[1] in INSTANCE_ROLES


#: the cluster's instance tables
INSTANCE_ROLES = ("prefill", "decode", "aggregated")
#: the keys of a P/D pool and of its KV link (none on an aggregated cluster)
_PD_KEYS = ("cluster.prefill.", "cluster.decode.", "cluster.link.", "cluster.decode_routing")


def _roles(cluster) -> tuple[str, ...]:
    """The instance tables ``cluster`` serves from."""
    return {"disaggregated": ("prefill", "decode"), "aggregated": ("aggregated",),
            "both": INSTANCE_ROLES}[cluster.kind]


def _unused_keys(cluster) -> tuple[str, ...]:
    """Prefixes of the resolved keys a cluster of this kind has no use for (left out of its
    provenance: a disaggregated run's reads as before aggregated serving existed)."""
    if cluster.kind == "disaggregated":
        return ("cluster.kind", "cluster.aggregated", "cluster.pool_routing")
    if cluster.kind == "aggregated":
        return _PD_KEYS + ("cluster.pool_routing", "cluster.aggregated_share")
    return ()


def _check_kind_tables(cluster: dict) -> None:
    """Refuse the tables of a P/D pool on an aggregated cluster, naming them: it has no
    prefill or decode instances and moves no KV cache."""
    if cluster.get("kind") != "aggregated":
        return
    for name in ("prefill", "decode", "link", "decode_routing"):
        if name in cluster:
            raise ConfigError(f"cluster.{name}: an aggregated cluster (cluster.kind = "
                              f"\"aggregated\") has no prefill/decode pools and moves no KV "
                              f"cache; set its instances in [cluster.aggregated], or use "
                              f"cluster.kind = \"both\"")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


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


def _table(data, where: str, names) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table, got {data!r}")
    unknown = set(data) - set(names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(names)}")
    return data


def _build(cls, data, where: str, **fixed):
    names = {f.name for f in dataclasses.fields(cls)} - set(fixed)
    return cls(**_table(data, where, names), **fixed)


def from_dict(data: dict) -> RunConfig:
    """Build a ``RunConfig`` from nested dicts (TOML tables); unset keys are resolved. With
    ``cluster.profile`` naming a measured profile directory, the keys it leaves unset that
    make the cluster the real mode's come from the directory (source "profile")."""
    given, data, from_profile = data, *_with_profile(data)
    top = _table(data, "the configuration", {f.name for f in dataclasses.fields(RunConfig)})
    cluster = dict(_table(top.get("cluster", {}), "cluster",
                          {f.name for f in dataclasses.fields(ClusterConfig)}))
    _check_kind_tables(cluster)
    for role in ("prefill", "decode"):
        cluster[role] = _build(InstanceConfig, cluster.get(role, {}), f"cluster.{role}",
                               role=role)
    if "aggregated" in cluster:
        cluster["aggregated"] = _build(InstanceConfig, cluster["aggregated"],
                                       "cluster.aggregated", role="aggregated")
    cluster["link"] = _build(LinkConfig, cluster.get("link", {}), "cluster.link")
    cluster["policies"] = _build(PolicyConfig, cluster.get("policies", {}), "cluster.policies")
    config = RunConfig(**{
        **{k: v for k, v in top.items()
           if k not in ("cluster", "workload", "slo", "faults", "cells")},
        "faults": _build(FaultsConfig, top.get("faults", {}), "faults"),
        "cells": _build(CellsConfig, top.get("cells", {}), "cells"),
        "cluster": ClusterConfig(**cluster),
        "workload": _build(WorkloadConfig, top.get("workload", {}), "workload"),
        "slo": _build(SloConfig, top.get("slo", {}), "slo"),
    })
    object.__setattr__(config, "_given", copy.deepcopy(given))
    object.__setattr__(config, "_from_profile", from_profile)
    return config


def _with_profile(data: dict) -> tuple[dict, tuple]:
    """``data`` with the measured profile's settings under the user's, and the keys filled."""
    from sim.models.profile_dir import mirror_settings

    cluster = data.get("cluster") if isinstance(data, dict) else None
    profile = _measured_profile(cluster.get("profile") if isinstance(cluster, dict) else None)
    if profile is None:
        return data, ()
    given = _flatten(data)
    filled = {k: v for k, v in mirror_settings(profile).items() if k not in given}
    return _merge(_undot(filled), data), tuple(filled)


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML file: top-level ``seed`` and tables ``[cluster]``, ``[cluster.prefill]``,
    ``[cluster.decode]``, ``[cluster.link]``, ``[workload]``, ``[slo]``, ``[faults]``,
    ``[cells]``."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
