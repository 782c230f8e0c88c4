"""Transports for the real KV path: one interface (``base``), backends loaded lazily by name.

``make_transport("loopback", fabric=...)`` (in-process test double),
``make_transport("mooncake", host=..., protocol="tcp"|"rdma")`` (Mooncake Transfer Engine),
``make_transport("verbs", device=None)`` (pyverbs RC queue pair). Importing this package
imports neither Mooncake nor pyverbs.
"""

from __future__ import annotations

import importlib

from hardware.transport.base import (  # noqa: F401  (the public names)
    AuthError, Batch, ChecksumMismatch, PeerLost, PlanOutOfBounds, Prepared, ProtocolError,
    Region, RegistrationError, SendBufferExhausted, TransferFailed, TransferTimeout, Transport,
    TransportError, TransportUnavailable, UnknownRequest, buffer_address,
)

BACKENDS = {
    "loopback": ("hardware.transport.loopback", "LoopbackTransport"),
    "mooncake": ("hardware.transport.mooncake", "MooncakeTransport"),
    "verbs": ("hardware.transport.verbs", "VerbsTransport"),
}


def make_transport(name: str, **kwargs) -> Transport:
    """Build a transport backend by name; raises ``TransportUnavailable`` naming the cause."""
    if name not in BACKENDS:
        raise ValueError(f"transport {name!r}: allowed {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)
