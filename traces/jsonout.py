"""What every ``hawk`` command writes: strict JSON, output folders checked up front.

- ``dumps(value)``: JSON that any parser reads. ``NaN`` and infinities (a percentile of no
  requests, a knee that was never reached) become ``null``; numpy scalars and arrays become
  plain numbers and lists; dict keys become strings. Python's ``json`` would otherwise write
  bare ``NaN``, which is not JSON.
- ``writable_dir(path, flag)``: create the folder and prove a file can be written in it, before
  a run spends minutes and then fails at the end. Raises ``ValueError`` naming the flag.
- ``writable_file(path, flag)``: the same for a single output file (its folder is checked).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


def jsonable(value):
    """``value`` with non-finite floats as ``None`` and numpy types as Python ones."""
    if isinstance(value, dict):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):   # numpy
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value, **kwargs) -> str:
    """Strict JSON text of ``value`` (see ``jsonable``); never bare ``NaN``/``Infinity``."""
    return json.dumps(jsonable(value), allow_nan=False, **kwargs)


def _key(key) -> str:
    key = jsonable(key)
    return key if isinstance(key, str) else json.dumps(key)


def writable_dir(path, flag: str = "--out") -> Path:
    """Create ``path`` (with parents) and check a file can be written there."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hawk-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
    return path


def writable_file(path, flag: str) -> Path:
    """Check ``path`` can be written (its folder is created); an existing file is kept."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file name")
    writable_dir(path.parent if str(path.parent) else Path("."), flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: the file exists and cannot be overwritten")
    return path
