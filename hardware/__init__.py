"""What the machines are and how to drive them: catalogs, KV-cache layouts, transfer plans,
transports and real-mode workers. Importing this package imports no heavy backend."""

from hardware.tiles import pack, unpack

__all__ = ["pack", "unpack"]
