"""Configurations as TOML tables: build a ``RunConfig`` from nested dicts or a TOML file
(``from_dict``, ``load_config``), the settings a user gave (``user_settings``, what
``RunConfig.replace`` starts from) and where every resolved value came from (``provenance``,
``hawk simulate --show-config``). The dataclasses and their checks are in ``sim.config``."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from sim.config import (SOURCES, _measured_profile, CellsConfig, ClusterConfig, ConfigError, FaultsConfig,
                        InstanceConfig, LinkConfig, PolicyConfig, RunConfig, SloConfig,
                        WorkloadConfig, tomllib)

__all__ = ["SOURCES", "format_provenance", "from_dict", "load_config", "provenance", "to_dict",
           "user_settings"]


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
    for role in ("prefill", "decode"):
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
    for key, value in _flatten(to_dict(config)).items():
        if key.endswith(".role"):
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
    return len(parts) == 3 and parts[0] == "cluster" and parts[1] in ("prefill", "decode")


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
    for role in ("prefill", "decode"):
        cluster[role] = _build(InstanceConfig, cluster.get(role, {}), f"cluster.{role}",
                               role=role)
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
    from sim.profile_dir import mirror_settings

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
