"""``hawk real profile --shape aggregated --out DIR``: the aggregated worker's steps measured into
a profile directory that ``hawk simulate --profile DIR`` runs as one aggregated instance, timed
by the same table predictor as a profile of ``hawk profile --endpoint`` (``[serving] engine =
"aggregated"``: prefill.csv and decode.csv, no transfer.csv, no loop factors).

Every point is a step of ``AggregatedEngine.step`` (what the worker's loop runs: scheduling,
the model calls, sampling), timed from its ``start`` to its ``end``, once unmeasured, then
``repeats`` times:

- prefill (prefill.csv): ``num_seqs`` fresh prompts of ``tokens`` each, admitted whole in
  one step (the sweep keeps ``num_seqs x tokens`` within the budget and the batch size);
- decode (decode.csv): ``batch`` requests decoding, each attending ``context`` tokens (after
  each step every request is set back one token, so every repeat attends the same context);
- mixed (mixed.csv: ``batch,context_per_request,chunk_tokens`` and the statistics): ``batch``
  such decodes and one fresh prompt of ``chunk_tokens`` in the same step. The simulator does
  not read it: ``hawk validate`` sets it beside the table predictor's ``mixed_step_time`` (the
  two phases' tables combined, ``sim.validation.mixed``), to show how far that combination is
  from this engine's mixed steps;
- the serving loop (loop.csv, ``measure_loop``): a short session of ``loop_requests``
  requests on one aggregated worker (``hardware.serve.profile_loop``'s requests), its steps
  logged; the simulator scales the tables by the loop's median cost per phase over them, as
  for a disaggregated profile.

[serving] holds the worker's scheduler and cache (``AggSettings``: ``hawk real worker --role
aggregated``'s defaults) under the names the reader takes (``sim.models.profile_dir``):
``prefill_max_batch_tokens`` (the step's token budget), ``decode_max_batch`` and
``prefill_max_batch_size`` (max sequences), ``num_kv_tokens`` and ``prefill_num_blocks``
(the cache), ``kv_block_tokens``; ``batch_padding = "longest"`` (each model call pads to its
longest chunk or context). Rows are appended as measured; a rerun resumes (as
``hardware.serve.profile``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path

import numpy as np

from hardware.serve.profile_files import STATS, ProfileError, Table

KEYS = {"prefill": ("batch_tokens", "num_seqs"),
        "decode": ("batch", "context_per_request", "total_context"),
        "mixed": ("batch", "context_per_request", "chunk_tokens")}
DEFAULT_REPEATS, QUICK_REPEATS = 15, 3
DEFAULT_LOOP_REQUESTS, QUICK_LOOP_REQUESTS = 60, 12   # as hawk real profile's session
MIXED_CONTEXT = 128                   # tokens each decode of a mixed point attends


@dataclass(frozen=True)
class AggSettings:
    """The aggregated worker's defaults (``hardware.serve.worker``'s flags)."""

    max_batch_tokens: int
    max_batch_size: int
    num_blocks: int
    block_tokens: int
    threads: int

    @classmethod
    def of_worker(cls) -> "AggSettings":
        from hardware.kv_layout import blocks_for
        from hardware.serve import worker
        from hardware.serve.aggregated_engine import BLOCK_TOKENS

        p = argparse.ArgumentParser()
        worker.add_arguments(p)
        d = p.parse_args(["--role", "aggregated", "--router", "127.0.0.1:1"])
        return cls(d.max_batch_tokens, d.max_batch_size, blocks_for(d.num_tokens, BLOCK_TOKENS),
                   BLOCK_TOKENS, d.threads)


@dataclass(frozen=True)
class AggSweep:
    prefill_num_seqs: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed_batches: tuple[int, ...]
    mixed_chunks: tuple[int, ...]
    repeats: int
    loop_requests: int = 0                   # the serving-loop session (loop.csv); 0: none

    def __post_init__(self) -> None:
        for name, low in (("prefill_num_seqs", 1), ("prefill_tokens", 1), ("decode_batches", 1),
                          ("decode_contexts", 2), ("mixed_batches", 1), ("mixed_chunks", 2)):
            v = tuple(getattr(self, name))
            if not v or any(not isinstance(x, int) or x < low for x in v) \
                    or list(v) != sorted(set(v)):
                raise ProfileError(f"sweep {name} {v!r}: need increasing whole numbers >= {low}")
            object.__setattr__(self, name, v)
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ProfileError(f"repeats {self.repeats!r}: need a whole number >= 1")
        if not isinstance(self.loop_requests, int) or self.loop_requests < 0:
            raise ProfileError(f"loop_requests {self.loop_requests!r}: need a whole number >= 0")

    @classmethod
    def for_limits(cls, context: int, s: AggSettings, quick: bool = False,
                   repeats: int | None = None) -> "AggSweep":
        """Axes up to the model's ``context`` per request and the worker's step limits."""
        if quick:
            tokens = _upto((1, 128), context)
            return cls((1, 4), tokens, _upto((1, 8), s.max_batch_size), _upto((2, 128), context),
                       (1, 8), (16, 256), repeats or QUICK_REPEATS, QUICK_LOOP_REQUESTS)
        tokens = _upto([1] + [16 << k for k in range(20)] + [3 * context // 4], context)
        batches = _upto([1 << k for k in range(20)] + [3 * s.max_batch_size // 4],
                        s.max_batch_size)
        return cls(_upto([1 << k for k in range(20)], s.max_batch_size), tokens, batches,
                   tuple(max(2, t) for t in tokens if t > 1) or (2,),
                   _upto((1, 4, 16), s.max_batch_size - 1), (16, 128, 512),
                   repeats or DEFAULT_REPEATS, DEFAULT_LOOP_REQUESTS)

    def prefill_points(self, s: AggSettings) -> list[tuple[int, int]]:
        return [(n, t) for n in self.prefill_num_seqs for t in self.prefill_tokens
                if n * t <= s.max_batch_tokens and n <= s.max_batch_size]

    def mixed_points(self, s: AggSettings, context: int) -> list[tuple[int, int]]:
        return [(b, t) for b in self.mixed_batches for t in self.mixed_chunks
                if b + t <= s.max_batch_tokens and b < s.max_batch_size and t <= context]


def _upto(points, limit: int) -> tuple[int, ...]:
    return tuple(sorted({int(p) for p in points if 1 <= p < limit} | {int(limit)}))


def header_for(model_dir, seed: int, device: str, sweep: AggSweep, s: AggSettings,
               config) -> dict:
    """profile.toml's tables: [serving] in the reader's names (the module docstring)."""
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    from hardware.serve.profile_files import FORMAT, STANDS_FOR, machine, model_section

    try:
        hawk_version = version("hawk-sim")
    except PackageNotFoundError:
        hawk_version = "unknown"
    mach = machine(device, s.threads)
    mach.update(description=mach["description"].split(";")[0] + f"; one aggregated worker "
                f"({s.threads} torch thread(s)) on {device}", decode_device=device,
                stands_for_decode=STANDS_FOR["prefill"])
    return {
        "meta": {"format": FORMAT, "created": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "hawk_version": hawk_version, "complete": False},
        "machine": mach,
        "model": model_section(config, "float32", None if model_dir else seed,
                               str(Path(model_dir).resolve()) if model_dir else None),
        "serving": {"engine": "aggregated", "prefill_max_batch_tokens": s.max_batch_tokens,
                    "prefill_max_batch_size": s.max_batch_size,
                    "decode_max_batch": s.max_batch_size, "prefill_num_blocks": s.num_blocks,
                    "prefill_block_tokens": s.block_tokens, "kv_block_tokens": s.block_tokens,
                    "num_kv_tokens": s.num_blocks * s.block_tokens, "kv_dtype": "float32",
                    "max_request_tokens": config.max_position_embeddings,
                    "threads": s.threads, "batch_padding": "longest", "api_latency_s": 0.0},
        "sweep": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sweep).items()},
    }


# -- the steps -------------------------------------------------------------------------------
def _add(engine, rng, ids, num: int, tokens: int, max_tokens: int) -> list[str]:
    vocab = engine.model.config.vocab_size
    rids = [f"q{next(ids)}" for _ in range(num)]
    for rid in rids:
        engine.add(rid, rng.integers(0, vocab, tokens).tolist(), max_tokens)
    return rids


def _decoding(engine, rng, ids, batch: int, context: int) -> list[str]:
    """``batch`` requests whose next step is a decode attending ``context`` tokens."""
    rids = _add(engine, rng, ids, batch, context - 1, 1 << 30)
    while any(not engine.seqs[r].prefilled for r in rids):
        if engine.step() is None:
            raise ProfileError(f"the cache cannot hold {batch} requests of {context} tokens")
    return rids


def _rewind(engine, rids) -> None:
    """Forget each request's newest token: its next step computes the same position again."""
    for rid in rids:
        seq = engine.seqs[rid]
        seq.output.pop()
        seq.num_computed -= 1


def step_times(engine, rng, kind: str, point: tuple[int, int], repeats: int) -> list[float]:
    """``repeats`` timed steps of one point (after one untimed)."""
    ids, times = count(), []
    a, b = point
    decodes = _decoding(engine, rng, ids, a, b if kind == "decode" else MIXED_CONTEXT) \
        if kind != "prefill" else []
    try:
        for run in range(repeats + 1):
            fresh = (_add(engine, rng, ids, a, b, 1) if kind == "prefill"
                     else _add(engine, rng, ids, 1, b, 1) if kind == "mixed" else [])
            result = engine.step()
            want = len(decodes) + len(fresh)
            if result is None or len(result.items) != want or result.preempted:
                raise ProfileError(f"{kind} point {point}: the step served "
                                   f"{0 if result is None else len(result.items)} of {want}")
            _rewind(engine, decodes)
            if run:
                times.append(result.end - result.start)
    finally:
        for rid in list(engine.seqs):
            engine.drop(rid)
    return times


def measure(out: Path, tables: dict, sweep: AggSweep, s: AggSettings, model, context: int,
            seed: int, on_point=None, bar=None) -> int:
    """Every point missing from ``tables``; returns how many were measured."""
    from hardware.kv_layout import blocks_for
    from hardware.serve.aggregated_engine import AggregatedEngine
    from hardware.serve.profile_measure import percentiles

    todo = [("prefill", (n, t), {"batch_tokens": n * t, "num_seqs": n})
            for n, t in sweep.prefill_points(s)]
    todo += [("decode", (b, c), {"batch": b, "context_per_request": c, "total_context": b * c})
             for b in sweep.decode_batches for c in sweep.decode_contexts]
    todo += [("mixed", (b, t), {"batch": b, "context_per_request": MIXED_CONTEXT,
                                "chunk_tokens": t}) for b, t in sweep.mixed_points(s, context)]
    done = {name: t.keys(KEYS[name]) for name, t in tables.items()}
    todo = [(kind, point, key) for kind, point, key in todo
            if tuple(key[k] for k in KEYS[kind]) not in done[kind]]
    if not todo:
        return 0
    need = max([s.num_blocks] + [b * blocks_for(c + 1, s.block_tokens) for k, (b, c), _ in todo
                                 if k == "decode"]
               + [b * blocks_for(MIXED_CONTEXT + 1, s.block_tokens) + blocks_for(t, s.block_tokens)
                  for k, (b, t), _ in todo if k == "mixed"])
    engine = AggregatedEngine(model, need, s.max_batch_tokens, s.max_batch_size, s.block_tokens)
    rng = np.random.default_rng(seed)
    for kind, point, key in todo:
        p50, p10, p90 = percentiles(step_times(engine, rng, kind, point, sweep.repeats))
        row = {**key, "seconds_p50": p50, "seconds_p10": p10, "seconds_p90": p90,
               "repeats": sweep.repeats}
        tables[kind].append(row)
        if bar is not None:
            bar.set_postfix_str(f"{kind} {point}")
            bar.update(1)
        if on_point is not None:
            on_point(kind, row)
    return len(todo)


def measure_loop(out: Path, decode_rows: list[dict], s: AggSettings, device: str, context: int,
                 num_requests: int) -> int:
    """The serving loop's steps (``hardware.serve.profile_loop``'s session, on one aggregated
    worker of the profile's model and settings) into ``out/loop.csv``: a step of prompt chunks
    alone is a ``prefill`` row (its span), a step of decodes alone a ``decode`` row (the loop's
    period, where defined); mixed steps are left out (the simulator prices them by both
    phases' tables, each with its factor). Returns the rows written."""
    import csv
    import tempfile

    from hardware.serve.cluster import ClusterConfig
    from hardware.serve.profile_loop import WARMUP_REQUESTS, session_trace, write_loop_csv
    from hardware.serve.run import RealRunConfig, real_run

    trace = session_trace(decode_rows, context, num_requests)
    with tempfile.TemporaryDirectory(prefix="hawk-profile-loop-") as scratch:
        logs = Path(scratch) / "steps"
        args = ["--max-batch-tokens", str(s.max_batch_tokens),
                "--max-batch-size", str(s.max_batch_size),
                "--num-tokens", str(s.num_blocks * s.block_tokens), "--threads", str(s.threads),
                "--device", "cpu" if device == "cpu" else "cuda", "--step-log", str(logs)]
        cluster = ClusterConfig(shape="aggregated", model=str(out / "model"), worker_args=args)
        real_run(trace, RealRunConfig(cluster, 1e9, 1e9, context, progress=False,
                                      warmup_requests=WARMUP_REQUESTS), Path(scratch) / "run")
        rows = []
        for path in sorted(logs.glob("aggregated*.csv")):
            with path.open(newline="") as f:
                for r in csv.DictReader(f):
                    if r["num_decodes"] == "0":
                        rows.append(("prefill", r["num_chunks"], r["chunk_longest"],
                                     r["chunk_total"], r["seconds"]))
                    elif r["num_chunks"] == "0" and r["period_s"]:
                        rows.append(("decode", r["num_decodes"], r["decode_longest"],
                                     r["decode_total"], r["period_s"]))
        write_loop_csv(out, rows)
    return len(rows)


def _session(out: Path, tables: dict, s: AggSettings, device: str, context: int,
             num_requests: int, progress: bool) -> None:
    from hardware.serve.cluster import ClusterError

    if progress:
        print(f"profile: serving-loop session, {num_requests} requests on a local aggregated "
              f"worker", file=sys.stderr)
    try:
        measure_loop(out, tables["decode"].rows, s, device, context, num_requests)
    except (ClusterError, OSError) as e:
        raise ProfileError(f"the serving-loop session failed ({e}); the tables are kept: "
                           f"rerun the same command to measure the session again") from e


def summary(tables: dict) -> list[str]:
    """A few rows of each table (``hawk validate`` sets mixed.csv beside the predictor)."""
    one = sorted((r for r in tables["prefill"].rows if r["num_seqs"] == 1),
                 key=lambda r: r["batch_tokens"])
    lines = ["prefill step, one prompt: " + "  ".join(
        f"{int(r['batch_tokens'])} tok {1e3 * r['seconds_p50']:.1f} ms" for r in one)]
    for b in sorted({r["batch"] for r in tables["decode"].rows}):
        row = sorted((r for r in tables["decode"].rows if r["batch"] == b),
                     key=lambda r: r["context_per_request"])
        lines.append(f"decode step, batch {int(b):>3}: " + "  ".join(
            f"ctx {int(r['context_per_request'])} {1e3 * r['seconds_p50']:.1f} ms"
            for r in (row[0], row[-1])))
    lines += [f"mixed step, {int(r['batch'])} decodes at {int(r['context_per_request'])} + a "
              f"chunk of {int(r['chunk_tokens'])}: {1e3 * r['seconds_p50']:.1f} ms"
              for r in tables["mixed"].rows]
    return lines


def run(out, *, model_dir=None, seed: int = 0, device: str = "auto", quick: bool = False,
        repeats: int | None = None, sweep: AggSweep | None = None, force: bool = False,
        progress: bool = True, on_point=None) -> dict:
    """Measure every point of the sweep missing from ``out``; as ``profile.run``."""
    import torch

    from hardware.model.config import LlamaConfig, tiny_config
    from hardware.model.llama import LlamaModel
    from hardware.serve.profile import _bar, _ensure_model, prefill_device, warn_if_loaded
    from hardware.serve.profile_loop import summary as loop_summary
    from hardware.serve.profile_files import prepare, write_header

    out, s = Path(out), AggSettings.of_worker()
    try:
        config = LlamaConfig.from_json(model_dir) if model_dir else tiny_config()
    except ValueError as e:
        raise ProfileError(f"--model: {e}") from e
    context = config.max_position_embeddings
    sweep = sweep or AggSweep.for_limits(context, s, quick, repeats)
    longest = max(sweep.prefill_tokens + sweep.decode_contexts + sweep.mixed_chunks)
    if longest > context:
        raise ProfileError(f"sweep reaches {longest} tokens per request; the model holds "
                           f"{context}")
    device = prefill_device(device)
    header = header_for(model_dir, seed, device, sweep, s, config)
    prepare(out, header, force)
    if not (out / "profile.toml").is_file():           # fresh, or cleared by --force
        (out / "mixed.csv").unlink(missing_ok=True)
    if progress:
        warn_if_loaded()
    _ensure_model(out, header, model_dir, seed, config)
    tables = {name: Table(out / f"{name}.csv", KEYS[name] + STATS) for name in KEYS}
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    total = (len(sweep.prefill_points(s)) + len(sweep.mixed_points(s, context))
             + len(sweep.decode_batches) * len(sweep.decode_contexts))
    bar = _bar(total - sum(len(t.rows) for t in tables.values()), progress)
    try:
        model = LlamaModel.load(out / "model", device=device)
        measured = measure(out, tables, sweep, s, model, context, seed, on_point, bar)
    finally:
        bar.close()
        torch.set_num_threads(threads)
    if sweep.loop_requests and not (out / "loop.csv").is_file():
        _session(out, tables, s, device, context, sweep.loop_requests, progress)
    header["ranges"] = {f"{name}_{c}_{end}": int(f([r[c] for r in t.rows]))
                        for name, t in tables.items() if t.rows for c in KEYS[name]
                        for end, f in (("min", min), ("max", max))}
    write_header(out, header, complete=True)
    return {"tables": tables, "num_measured": measured,
            "summary": "\n".join(summary(tables)) + "\n" + loop_summary(out)}

