"""``hawk real profile --out DIR``: measure the real mode's compute and KV path into a profile
directory that ``hawk simulate --profile DIR`` interpolates (the table predictor) and
``hawk calibrate`` / ``hawk validate`` read.

The directory (format 1)::

    profile.toml   [meta] format, created, hawk_version, complete
                   [machine] description, cpu, cores, threads, torch, device, decode_device,
                             stands_for_prefill, stands_for_decode
                   [model] the checkpoint's config.json sizes, dtype, and the seed that built it
                             (or ``source``, the directory it was copied from)
                   [serving] the workers' parameters (``profile_measure.Serving``), the
                             mechanisms measured, the decode cache's mechanism, kv_bytes_per_token
                   [sweep] the axis points requested; [ranges] measured min/max per axis
    prefill.csv    batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats
    decode.csv     batch,context_per_request,total_context,seconds_p50,seconds_p10,seconds_p90,
                   repeats            (one step; every request in the batch at that context)
    transfer.csv   mechanism,bytes,seconds_p50,seconds_p10,seconds_p90,repeats
    loop.csv       phase,batch,longest,total,seconds: steps inside the serving loop, from a
                   short local-cluster session at the end (``profile_loop``)
    model/         config.json + model.safetensors: the very model measured

Units: seconds; ``bytes`` is the request's KV cache in the prefill worker's paged cache (every
layer, K and V, the model's dtype: tokens x ``kv_bytes_per_token``), the same for every
mechanism (what goes on the wire differs: GN-HAWK sends tiles of ``kv_dtype``).

Axes reach the workers' limits: prompt lengths 1..the longest request (the model's context,
at most the workers' ``max_request_tokens``), prefill batches up to the workers' token budget
and batch size, decode batches up to the decode batch size. Rows are appended as they are
measured, so an interrupted run, rerun with the same arguments, measures only what is missing;
``complete = true`` once every point is in. Other settings into a directory that holds a
profile are refused unless ``force``.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hardware.mechanisms import MECHANISMS
from hardware.serve.profile_files import KEYS, PREFILL_BLOCK_TOKENS, STATS, ProfileError, \
    Table, header_for, prepare, ranges, write_header
from hardware.serve.profile_measure import Serving

DEFAULT_REPEATS, QUICK_REPEATS = 15, 3
#: requests of the serving-loop session (profile_loop); 0 measures no session
DEFAULT_LOOP_REQUESTS, QUICK_LOOP_REQUESTS = 60, 12


@dataclass(frozen=True)
class Sweep:
    """The axis points requested. Prefill runs every ``num_seqs x tokens`` within the
    workers' batch budget; decode every ``batch x context``; transfer every ``tokens`` per
    mechanism."""

    prefill_num_seqs: tuple[int, ...]
    prefill_tokens: tuple[int, ...]          # per sequence
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]         # per request
    transfer_tokens: tuple[int, ...]
    mechanisms: tuple[str, ...]
    repeats: int
    loop_requests: int = 0                   # the serving-loop session (loop.csv); 0: none

    def __post_init__(self) -> None:
        for name in ("prefill_num_seqs", "prefill_tokens", "decode_batches", "decode_contexts",
                     "transfer_tokens"):
            v = tuple(getattr(self, name))
            if not v or any(not isinstance(x, int) or x < 1 for x in v) \
                    or list(v) != sorted(set(v)):
                raise ProfileError(f"sweep {name} {v!r}: need increasing whole numbers >= 1")
            object.__setattr__(self, name, v)
        bad = [m for m in self.mechanisms if m not in MECHANISMS]
        if bad or not self.mechanisms or len(set(self.mechanisms)) < len(self.mechanisms):
            raise ProfileError(f"mechanisms {list(self.mechanisms)}: distinct names from "
                               f"{', '.join(MECHANISMS)}")
        object.__setattr__(self, "mechanisms", tuple(self.mechanisms))
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ProfileError(f"repeats {self.repeats!r}: need a whole number >= 1")
        if not isinstance(self.loop_requests, int) or self.loop_requests < 0:
            raise ProfileError(f"loop_requests {self.loop_requests!r}: need a whole number >= 0")

    @classmethod
    def for_limits(cls, max_tokens: int, serving: Serving, quick: bool = False,
                   mechanisms=MECHANISMS, repeats: int | None = None) -> "Sweep":
        """Axes up to ``max_tokens`` per request and the workers' batch limits."""
        b = serving.decode_max_batch
        if quick:
            tokens = _upto((1, 128), max_tokens)
            return cls((1, 4), tokens, _upto((1, 8), b), tokens, tokens, tuple(mechanisms),
                       repeats or QUICK_REPEATS, QUICK_LOOP_REQUESTS)
        tokens = _upto([1] + [16 << k for k in range(20)] + [3 * max_tokens // 4], max_tokens)
        batches = _upto([1 << k for k in range(20)] + [3 * b // 4], b)
        seqs = _upto([1 << k for k in range(20)], serving.prefill_max_batch_size)
        return cls(seqs, tokens, batches, tokens, tokens, tuple(mechanisms),
                   repeats or DEFAULT_REPEATS, DEFAULT_LOOP_REQUESTS)

    def prefill_points(self, serving: Serving) -> list[tuple[int, int]]:
        """``(num_seqs, tokens)`` pairs that one worker batch can hold."""
        return [(n, t) for n in self.prefill_num_seqs for t in self.prefill_tokens
                if n * t <= serving.prefill_max_batch_tokens
                and n <= serving.prefill_max_batch_size]

    def decode_mechanism(self) -> str:
        """The decode cache measured: the workers' default mechanism's when swept."""
        return "GN-HAWK" if "GN-HAWK" in self.mechanisms else self.mechanisms[0]



def warn_if_loaded() -> None:
    """One line on stderr when the machine is busy enough to disturb the measurements."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"real profile: load average {load:.1f} on {cores} cores; other processes "
              f"compete with the measurements", file=sys.stderr)

def _upto(points, limit: int) -> tuple[int, ...]:
    return tuple(sorted({int(p) for p in points if 1 <= p < limit} | {int(limit)}))


def summary_table(tables: dict[str, Table], serving: Serving, max_tokens: int,
               kv_per_token: int) -> str:
    """A few rows of each table and where the profile extrapolates."""
    lines = ["prefill, one sequence:  " + "  ".join(
        f"{int(r['batch_tokens'])} tok {1e3 * r['seconds_p50']:.1f} ms"
        for r in sorted(tables["prefill"].rows, key=lambda r: r["batch_tokens"])
        if r["num_seqs"] == 1)]
    dec = tables["decode"].rows
    for b in sorted({r["batch"] for r in dec}):
        row = sorted((r for r in dec if r["batch"] == b), key=lambda r: r["context_per_request"])
        lines.append(f"decode step, batch {int(b):>3}: " + "  ".join(
            f"ctx {int(r['context_per_request'])} {1e3 * r['seconds_p50']:.1f} ms"
            for r in (row[0], row[-1])))
    for m in sorted({r["mechanism"] for r in tables["transfer"].rows}):
        row = sorted((r for r in tables["transfer"].rows if r["mechanism"] == m),
                     key=lambda r: r["bytes"])
        lines.append(f"transfer {m:<10} " + "  ".join(
            f"{r['bytes'] / 1024:.0f} KiB {1e3 * r['seconds_p50']:.2f} ms"
            for r in (row[0], row[-1])))
    rg = ranges(tables)
    limits = [("prefill batch tokens", "prefill_batch_tokens", 1,
               serving.prefill_max_batch_tokens),
              ("decode batch", "decode_batch", 1, serving.decode_max_batch),
              ("decode context per request", "decode_context_per_request", 1, max_tokens),
              ("transfer bytes", "transfer_bytes", kv_per_token, max_tokens * kv_per_token)]
    for what, key, low, high in limits:
        if f"{key}_min" not in rg:
            continue
        a, b = rg[f"{key}_min"], rg[f"{key}_max"]
        outside = [f"below {a}" if a > low else "", f"above {b}" if b < high else ""]
        outside = " and ".join(x for x in outside if x)
        lines.append(f"{what}: measured {a}..{b}; the workers use {low}..{high}"
                     + (f"; extrapolated {outside}" if outside else "; no extrapolation"))
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------
def prefill_device(name: str) -> str:
    """``auto``: CUDA for prefill when present, as a prefill worker picks; else ``cpu``."""
    import torch
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ProfileError(f"device {name!r}: torch sees no CUDA device")
    return name


def run(out, *, model_dir=None, seed: int = 0, device: str = "auto", quick: bool = False,
        mechanisms=MECHANISMS, repeats: int | None = None, sweep: Sweep | None = None,
        force: bool = False, progress: bool = True, on_point=None) -> dict:
    """Measure every point of the sweep missing from ``out``; ``on_point(table, row)`` is
    called after each row is written. Returns the tables and a printable summary."""
    import torch

    from hardware.model.config import LlamaConfig, tiny_config

    out, serving = Path(out), Serving.of_workers()
    try:
        config = LlamaConfig.from_json(model_dir) if model_dir else tiny_config()
    except ValueError as e:
        raise ProfileError(f"--model: {e}") from e
    max_tokens = min(config.max_position_embeddings, serving.max_request_tokens)
    sweep = sweep or Sweep.for_limits(max_tokens, serving, quick, tuple(mechanisms), repeats)
    longest = max(sweep.prefill_tokens + sweep.decode_contexts + sweep.transfer_tokens)
    if longest > max_tokens:
        raise ProfileError(f"sweep reaches {longest} tokens per request; the workers hold at "
                           f"most {max_tokens}")
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    device = prefill_device(device)
    header = header_for(model_dir, seed, device, sweep, serving, config, kv_per_token)
    prepare(out, header, force)
    if progress:
        warn_if_loaded()
    _ensure_model(out, header, model_dir, seed, config)
    tables = {name: Table(out / f"{name}.csv", KEYS[name] + STATS) for name in KEYS}
    threads = torch.get_num_threads()
    torch.set_num_threads(serving.threads)
    try:
        measured = _measure(out, tables, sweep, serving, device, kv_per_token, seed,
                            progress, on_point)
    finally:
        torch.set_num_threads(threads)
    if sweep.loop_requests and not (out / "loop.csv").is_file():
        from hardware.serve.profile_loop import measure_loop

        if progress:
            print(f"profile: serving-loop session, {sweep.loop_requests} requests on a local "
                  f"cluster", file=sys.stderr)
        from hardware.serve.cluster import ClusterError

        try:
            measure_loop(out, tables["decode"].rows, serving, sweep.decode_mechanism(), device,
                         max_tokens, sweep.loop_requests)
        except (ClusterError, OSError) as e:
            raise ProfileError(f"the serving-loop session failed ({e}); the tables are kept: "
                               f"rerun the same command to measure the session again") from e
    write_header(out, header, tables, complete=True)
    from hardware.serve.profile_loop import summary as loop_summary

    return {"tables": tables, "num_measured": measured,
            "summary": summary_table(tables, serving, max_tokens, kv_per_token) + "\n"
            + loop_summary(out)}


def _ensure_model(out: Path, header: dict, model_dir, seed: int, config) -> None:
    """The checkpoint measured, in ``out/model``; profile.toml (incomplete) on a fresh start."""
    from hardware.model.llama import WEIGHTS_FILE, LlamaModel
    from hardware.serve.profile_files import read_toml

    toml = out / "profile.toml"
    if toml.is_file():                                   # resuming: keep its creation time
        header["meta"]["created"] = read_toml(toml)["meta"]["created"]
    if not (out / "model" / WEIGHTS_FILE).is_file():
        try:
            model = (LlamaModel.load(model_dir, device="cpu") if model_dir
                     else LlamaModel.random(config, seed=seed, device="cpu"))
        except (ValueError, OSError) as e:
            raise ProfileError(f"--model {model_dir}: {e}") from e
        shutil.rmtree(out / "model.partial", ignore_errors=True)
        model.save(out / "model.partial")                # whole, or not there at all
        shutil.rmtree(out / "model", ignore_errors=True)
        (out / "model.partial").rename(out / "model")
    if not toml.is_file():
        write_header(out, header)


def _measure(out: Path, tables: dict, sweep: Sweep, serving: Serving, device: str,
             kv_per_token: int, seed: int, progress: bool, on_point) -> int:
    from hardware.model.llama import LlamaModel
    from hardware.serve import profile_measure as pm

    done = {name: t.keys(KEYS[name][:2]) for name, t in tables.items()}
    todo_p = [(n, t) for n, t in sweep.prefill_points(serving)
              if (n * t, n) not in done["prefill"]]
    todo_d = [(b, c) for b in sweep.decode_batches for c in sweep.decode_contexts
              if (b, c) not in done["decode"]]
    todo_t = [(m, t) for m in sweep.mechanisms for t in sweep.transfer_tokens
              if (m, t * kv_per_token) not in done["transfer"]]
    total, r = len(todo_p) + len(todo_d) + len(todo_t), sweep.repeats
    bar = _bar(total, progress)

    def record(table: str, key: dict, times: list[float]) -> None:
        p50, p10, p90 = pm.percentiles(times)
        row = {**key, "seconds_p50": p50, "seconds_p10": p10, "seconds_p90": p90,
               "repeats": len(times)}
        tables[table].append(row)
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in key.items()))
        bar.update(1)
        if on_point is not None:
            on_point(table, row)

    model = LlamaModel.load(out / "model", device="cpu")
    transport = None
    try:
        if todo_p:
            pmodel = model if device == "cpu" else LlamaModel.load(out / "model", device=device)
            _prefills(pmodel, todo_p, serving, seed, r, record)
        if todo_d or todo_t:
            from hardware.transport import make_transport
            transport = make_transport("mooncake", host="127.0.0.1")
        if todo_d:
            _decodes(model, todo_d, sweep.decode_mechanism(), transport, serving, r, record)
        if todo_t:
            _transfers(out, todo_t, transport, model, serving, device, kv_per_token, r, record)
    finally:
        bar.close()
        if transport is not None:
            transport.close()
    return total


def _prefills(model, todo, serving: Serving, seed: int, repeats: int, record) -> None:
    import numpy as np

    from hardware.kv_layout import blocks_for
    from hardware.serve import profile_measure as pm
    from hardware.serve.engines import PrefillEngine

    blocks = max(n * blocks_for(t, PREFILL_BLOCK_TOKENS) for n, t in todo)
    engine = PrefillEngine(model, max(serving.prefill_num_blocks, blocks),
                           serving.prefill_max_batch_tokens, serving.prefill_max_batch_size,
                           PREFILL_BLOCK_TOKENS)
    rng = np.random.default_rng(seed)
    for n, t in todo:
        record("prefill", {"batch_tokens": n * t, "num_seqs": n},
               pm.prefill_times(engine, rng, n, t, repeats))


def _decodes(model, todo, mechanism: str, transport, serving: Serving, repeats: int,
             record) -> None:
    from hardware.serve import profile_measure as pm

    longest = -(-max(c for _, c in todo) // 32) * 32           # whole blocks of either cache
    engine = pm.decode_engine(model, mechanism, transport, serving,
                              max(b for b, _ in todo) * longest)
    try:
        for b, c in todo:
            record("decode", {"batch": b, "context_per_request": c, "total_context": b * c},
                   pm.decode_times(engine, b, c, repeats))
    finally:
        engine.sink.close()


def _transfers(out, todo, transport, model, serving, device, kv_per_token, repeats,
               record) -> None:
    from collections import Counter

    from hardware.serve import profile_measure as pm

    lengths = Counter()
    for _, t in todo:
        lengths[t] += repeats + 1
    server = pm.KVServer(out / "model", dict(lengths), device, serving)
    try:
        for m in dict.fromkeys(m for m, _ in todo):
            engine = pm.decode_engine(model, m, transport, serving, 0)
            try:
                for t in (t for mm, t in todo if mm == m):
                    record("transfer", {"mechanism": m, "bytes": t * kv_per_token},
                           server.pull_times(engine, t, repeats))
            finally:
                engine.sink.close()
    finally:
        server.close()


def _bar(total: int, progress: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc="profile", unit="point", file=sys.stderr,
                disable=not progress or total == 0)
