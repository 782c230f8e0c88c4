"""The profile directory of ``hawk real profile`` on disk: what ``profile.toml`` says (machine,
model, serving, sweep, ranges) written and read back, the three CSV tables appended a row at a
time, and the check that a rerun into a directory resumes the same profile rather than mixing
two (``hardware.serve.profile`` describes the format).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

#: the profile directory's format version, written in [meta] format (sim.models.profile_dir
#: reads only this one)
FORMAT = 1
KEYS = {"prefill": ("batch_tokens", "num_seqs"),
        "decode": ("batch", "context_per_request", "total_context"),
        "transfer": ("mechanism", "bytes")}
STATS = ("seconds_p50", "seconds_p10", "seconds_p90", "repeats")
COMPARED_MACHINE = ("cpu", "cores", "threads", "torch", "device")
PREFILL_BLOCK_TOKENS = 16          # the prefill worker's paged cache (PrefillEngine's default)
#: the workers' batched model pads every sequence to the batch's longest (prompt in prefill,
#: block table in decode), so a batch costs num_seqs x its longest: [serving] batch_padding
BATCH_PADDING = "longest"
# the catalog devices a worker stands for (as hawk real run's power estimate prices them)
STANDS_FOR = {"prefill": "a100-pcie", "decode": "p150a"}


class ProfileError(Exception):
    """The profile cannot be measured into this directory, or with these settings."""


def to_toml(doc: dict) -> str:
    """Tables of scalars and flat lists (all profile.toml holds)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, float):
            return repr(v)
        return str(int(v))
    out = []
    for table, items in doc.items():
        out.append(f"[{table}]")
        out += [f"{k} = {value(v)}" for k, v in items.items() if v is not None]
        out.append("")
    return "\n".join(out)


def read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: cannot read ({e})") from e


class Table:
    """One CSV of the profile, appended a row at a time (a killed run loses at most the row
    being written, which the next run drops)."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        self.path, self.columns = path, columns
        self.rows: list[dict] = []
        header = ",".join(columns)
        if not path.exists() or path.stat().st_size == 0:
            path.write_text(header + "\n")
            return
        text = path.read_text()
        lines = text.split("\n")
        if lines[0] != header:
            raise ProfileError(f"{path}: line 1 is {lines[0]!r}, expected {header!r}")
        whole = lines[1:-1]                           # the last piece has no newline after it
        for i, line in enumerate(whole, start=2):
            cells = line.split(",")
            if len(cells) != len(columns):
                raise ProfileError(f"{path}: line {i} has {len(cells)} fields, expected "
                                   f"{len(columns)}")
            try:
                self.rows.append({c: (x if c == "mechanism" else float(x))
                                  for c, x in zip(columns, cells)})
            except ValueError as e:
                raise ProfileError(f"{path}: line {i}: {e}") from e
        if lines[-1]:                                 # a half-written last row: drop it
            path.write_text("\n".join([lines[0], *whole]) + "\n")

    def keys(self, names) -> set:
        return {tuple(r[n] for n in names) for r in self.rows}

    def append(self, row: dict) -> None:
        line = ",".join(_cell(row[c]) for c in self.columns) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)


def _cell(v) -> str:
    return v if isinstance(v, str) else (f"{v:.9g}" if isinstance(v, float) else str(v))


def prepare(out: Path, header: dict, force: bool) -> None:
    """Refuse a directory holding something else; with ``force``, clear the profile's files."""
    if out.exists() and not out.is_dir():
        raise ProfileError(f"--out {out}: exists and is not a directory")
    toml = out / "profile.toml"
    if out.is_dir() and any(out.iterdir()):
        why = None
        if not toml.is_file():
            why = "is not empty and holds no profile.toml"
        else:
            diffs = settings_diff(read_toml(toml), header)
            if diffs:
                more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
                why = ("holds a profile measured with other settings: " + "; ".join(diffs[:4])
                       + more)
        if why and not force:
            raise ProfileError(f"{out} {why}. Rerun with the same arguments to resume, choose "
                               f"another --out, or add --force to start over")
        if why:
            for name in ("profile.toml", "loop.csv", *(f"{t}.csv" for t in KEYS)):
                (out / name).unlink(missing_ok=True)
            for name in ("model", "model.partial"):
                shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def settings_diff(old: dict, new: dict) -> list[str]:
    """``table.key: here vs there`` for every setting that differs."""
    diffs = []
    for table in ("sweep", "model", "serving", "machine"):
        a, b = old.get(table, {}), new.get(table, {})
        keys = COMPARED_MACHINE if table == "machine" else sorted(set(a) | set(b))
        for k in keys:
            x, y = _plain(a.get(k)), _plain(b.get(k))
            if x != y:
                diffs.append(f"{table}.{k} is {y!r} here, {x!r} in profile.toml")
    return diffs


def _plain(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def ranges(tables: dict[str, Table]) -> dict:
    """Measured min/max of every axis (anything outside them is extrapolation)."""
    out = {}
    for name, cols in (("prefill", ("batch_tokens", "num_seqs")),
                       ("decode", ("batch", "context_per_request", "total_context")),
                       ("transfer", ("bytes",))):
        for c in cols:
            v = [r[c] for r in tables[name].rows]
            if v:
                out[f"{name}_{c}_min"], out[f"{name}_{c}_max"] = int(min(v)), int(max(v))
    return out


def write_header(out: Path, header: dict, tables: dict[str, Table] | None = None,
                 complete: bool = False) -> None:
    doc = {k: dict(v) for k, v in header.items()}
    doc["meta"]["complete"] = complete
    if tables is not None:
        doc["ranges"] = ranges(tables)
    tmp = out / "profile.toml.tmp"
    tmp.write_text("# Written by `hawk real profile`; seconds, bytes, tokens.\n" + to_toml(doc))
    tmp.replace(out / "profile.toml")


def machine(device: str, threads: int) -> dict:
    """[machine]: the CPU and the prefill device the workers run on, and what they stand for."""
    import platform

    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = os.cpu_count() or 1
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "the CPU"
    return {"description": f"{cpu}, {cores} cores; {threads} torch thread(s) per worker, "
                           f"prefill on {where} ({device}), decode on the CPU",
            "cpu": cpu, "cores": cores, "threads": threads, "torch": torch.__version__,
            "device": device, "decode_device": "cpu",
            "stands_for_prefill": STANDS_FOR["prefill"],
            "stands_for_decode": STANDS_FOR["decode"]}


def model_section(config, dtype: str, seed: int | None, source: str | None) -> dict:
    """[model]: a ``LlamaConfig``'s sizes under the contract's names (None: key left out)."""
    return {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size, "max_context": config.max_position_embeddings,
            "dtype": dtype, "seed": seed, "source": source}


def decode_block_tokens(sweep) -> int:
    """Tokens per block of the decode cache measured: TT blocks of 32 tokens (GN), else
    paged blocks as the prefill side's."""
    from hardware.serve.kv_path import TILED
    return 32 if sweep.decode_mechanism() in TILED else PREFILL_BLOCK_TOKENS


def header_for(model_dir_source, seed, device, sweep, serving, config,
               kv_bytes_per_token: int) -> dict:
    """profile.toml's tables before the measurement ([ranges] is added at the end), for a
    ``profile.Sweep`` and the workers' ``profile_measure.Serving``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        hawk_version = version("hawk-sim")
    except PackageNotFoundError:
        hawk_version = "unknown"
    return {
        "meta": {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "hawk_version": hawk_version, "complete": False},
        "machine": machine(device, serving.threads),
        "model": model_section(config, "float32", None if model_dir_source else seed,
                               str(Path(model_dir_source).resolve()) if model_dir_source
                               else None),
        "serving": {**asdict(serving), "kv_block_tokens": decode_block_tokens(sweep),
                    "prefill_block_tokens": PREFILL_BLOCK_TOKENS,
                    "decode_mechanism": sweep.decode_mechanism(),
                    "mechanisms": list(sweep.mechanisms),
                    "kv_bytes_per_token": kv_bytes_per_token,
                    # hardware.model.cache.block_batch pads each batch to its longest sequence
                    "batch_padding": BATCH_PADDING},
        "sweep": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sweep).items()},
    }
