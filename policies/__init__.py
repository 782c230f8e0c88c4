"""Decisions as data: routing, prefill batching, tenant fairness and decode admission.

Policies never touch the clock. Each kind has a plain dict of named policies in its module;
``resolve(kind, name)`` finds one by name (``-`` and ``_`` alike: ``least-work``) or, for a
user's own, by import path ``module:function``. The command line's ``--policy KIND=NAME`` and a
TOML config name them the same way:

========================  ===================================  ============================
kind                      dict                                 TOML key
========================  ===================================  ============================
routing                   ``policies.routing.ROUTING``         ``cluster.routing``
decode_routing            ``policies.routing.ROUTING``         ``cluster.decode_routing``
prefill_batching          ``policies.batching.PREFILL_BATCHING``  ``cluster.policies.prefill_batching``
fairness                  ``policies.fairness.FAIRNESS``       ``cluster.policies.fairness``
admission                 ``policies.admission.ADMISSION``     ``cluster.decode.admission``
========================  ===================================  ============================

A policy may declare what the simulator can assume of it; a user's own declares the same way or
is assumed nothing (prefill batching: a ``traits`` attribute, ``policies.batching.BatchingTraits``;
without one every batch is the policy's own pick, on the general path).
"""

from __future__ import annotations

import importlib

#: kind -> (module, dict name) of its named policies
KINDS = {
    "routing": ("policies.routing", "ROUTING"),
    "decode_routing": ("policies.routing", "ROUTING"),
    "prefill_batching": ("policies.batching", "PREFILL_BATCHING"),
    "fairness": ("policies.fairness", "FAIRNESS"),
    "admission": ("policies.admission", "ADMISSION"),
}


class PolicyError(ValueError):
    """A policy name that names nothing; the message says what exists."""


def table(kind: str) -> dict:
    """The named policies of ``kind``."""
    if kind not in KINDS:
        raise PolicyError(f"policy kind {kind!r} is not one of {sorted(KINDS)}")
    module, name = KINDS[kind]
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise PolicyError(f"policy kind {kind!r} is not available in this version "
                          f"({module} is missing)") from None


def names(kind: str) -> list[str]:
    return sorted(table(kind))


def resolve(kind: str, name: str):
    """The policy ``name`` of ``kind``: a key of its dict, or ``module:function``."""
    if isinstance(name, str) and ":" in name:
        return _load(kind, name)
    return table(kind)[canonical(kind, name)]


def canonical(kind: str, name: str) -> str:
    """The dict key ``name`` stands for (``-`` and ``_`` alike), or an import path as given."""
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{kind} policy must be a name, got {name!r}")
    if ":" in name:
        return name
    policies = table(kind)
    for key in (name, name.replace("-", "_"), name.replace("_", "-")):
        if key in policies:
            return key
    raise PolicyError(f"{kind} policy {name!r} is not one of {sorted(policies)} "
                      f"(or give module:function)")


def _load(kind: str, path: str):
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise PolicyError(f"{kind} policy {path!r}: cannot import {module!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PolicyError(f"{kind} policy {path!r}: {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PolicyError(f"{kind} policy {path!r} is not callable")
    return obj


def parse_assignment(text: str) -> tuple[str, str]:
    """``"routing=least-work"`` -> ``("routing", "least-work")``, the kind checked."""
    kind, sep, name = text.partition("=")
    kind = kind.strip().replace("-", "_")
    if not sep or not name.strip():
        raise PolicyError(f"--policy {text!r}: expected KIND=NAME, KIND one of {sorted(KINDS)}")
    if kind not in KINDS:
        raise PolicyError(f"--policy {text!r}: kind {kind!r} is not one of {sorted(KINDS)}")
    return kind, name.strip()
