"""The checks every configuration table runs on construction, and the error they raise: each
names the field (dotted path), the allowed values and what it got."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check_range(where: str, name: str, value, low, high, integer: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) and not isinstance(value, bool) if integer else (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not ok or not low <= value <= high:
        raise ConfigError(f"{where}.{name} must be {kind} in [{low}, {high}], got {value!r}")


def _check_str(where: str, name: str, value) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{name} must be a string, got {value!r}")


def _check_choice(where: str, name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{where}.{name} must be one of {sorted(choices)}, got {value!r}")


def _check_bool(where: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name} must be true or false, got {value!r}")


def _pairs(name: str, value, first: str, second: str, integer_first: bool) -> tuple:
    """``[[a, b], ...]`` as a tuple of pairs, each number checked (>= 0)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"faults.{name} must be a list of [{first}, {second}] pairs, "
                          f"got {value!r}")
    out = []
    for k, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"faults.{name}[{k}] must be [{first}, {second}], got {pair!r}")
        _check_range(f"faults.{name}[{k}]", first, pair[0], 0, 10**9, integer=integer_first)
        _check_range(f"faults.{name}[{k}]", second, pair[1], 0.0, 1e12)
        out.append((pair[0], pair[1]))
    return tuple(out)
