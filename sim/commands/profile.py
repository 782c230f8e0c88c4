"""``hawk profile --endpoint URL --out DIR``: a live OpenAI-compatible engine measured from
outside (``traces.endpoint_profile``) into a profile directory that ``hawk simulate --profile
DIR`` runs as one aggregated instance (docs/profile-dir.md). Resumable: a rerun with the same
settings measures only the points ``DIR/samples.jsonl`` lacks."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure a live OpenAI-compatible engine (vLLM) from "
                       "outside into a profile directory (an aggregated instance)")
    p.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, required=True, help="the profile directory")
    p.add_argument("--max-num-seqs", type=int,
                   help="the engine's max_num_seqs (default: vLLM V1's on a CPU, 128)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="the engine's max_num_batched_tokens (default: vLLM V1's on a CPU, 2048)")
    p.add_argument("--model-config", type=Path,
                   help="the served model's config.json, for [model]'s sizes (optional)")
    p.add_argument("--prompt-token-ids", metavar="LOW:HIGH", default="3:1000",
                   help="prompt token ids are drawn from [LOW, HIGH) (default 3:1000)")
    p.add_argument("--repeats", type=int, default=5, help="lone requests per prompt length")
    p.add_argument("--batches", default="1,2,4,8,16,32,64",
                   help="decode batch sizes, comma-separated (capped at --max-num-seqs)")
    p.add_argument("--decode-tokens", type=int, default=64, help="output tokens per decode "
                   "request")
    p.add_argument("--quick", action="store_true", help="a short profile: 2 repeats (1 of "
                   "each decode point), batches 1,4,16")
    p.add_argument("--force", action="store_true", help="start over in a directory that holds "
                   "another profile")
    p.set_defaults(func=run)


def run(args) -> int:
    from traces import endpoint_profile as ep
    from traces import endpoint_samples as es

    plan = ep.ProfilePlan(repeats=2 if args.quick else args.repeats,
                          batches=(1, 4, 16) if args.quick else _ints(args.batches),
                          decode_tokens=args.decode_tokens, floor_repeats=8 if args.quick else 30,
                          decode_repeats=1 if args.quick else 3)
    low, _, high = args.prompt_token_ids.partition(":")
    try:
        token_ids = (int(low), int(high))
    except ValueError:
        raise ValueError(f"--prompt-token-ids takes LOW:HIGH, got {args.prompt_token_ids!r}") \
            from None
    try:
        engine = ep.engine_settings(args.endpoint, args.max_num_seqs, args.max_num_batched_tokens)
    except ep.EndpointProfileError as exc:
        print(f"hawk profile: the endpoint does not answer as an engine: {exc}", file=sys.stderr)
        return 1
    head = ep.header(args.endpoint, engine, plan, _model_config(args.model_config))
    samples = _prepare(args.out, head, args.force)
    points = [p for p in ep.plan_points(plan, engine) if p.key not in samples]
    print(f"hawk profile: {engine.model} at {args.endpoint}: context {engine.max_model_len}, "
          f"KV {engine.num_kv_tokens} tokens in blocks of {engine.block_size}, max_num_seqs "
          f"{engine.max_num_seqs}, max_num_batched_tokens {engine.max_num_batched_tokens}; "
          f"{len(points)} points to measure ({len(samples)} already)", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=len(points), desc="points", unit="pt", disable=None, leave=False)

    def done(point, sample) -> None:
        es.append_sample(args.out, sample)
        samples[point.key] = sample
        ep.write_profile(args.out, head, samples, complete=False)
        bar.update(1)
    try:
        ep.measure(args.endpoint, engine, points, token_ids, done)
    except ep.EndpointProfileError as exc:
        print(f"hawk profile: {exc}; rerun the same command to resume", file=sys.stderr)
        return 1
    finally:
        bar.close()
    ep.write_profile(args.out, head, samples, complete=True)
    latency, prefill, decode = ep.derive(samples)
    print(f"profile written to {args.out}/: API latency {1e3 * latency:.2f} ms, "
          f"{len(prefill)} prefill and {len(decode)} decode points")
    return 0


def _prepare(out: Path, head: dict, force: bool) -> dict:
    """The samples already in ``out`` (resume), after refusing another profile's directory."""
    from hardware.serve.profile_files import read_toml
    from traces import endpoint_samples as es

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    toml = out / "profile.toml"
    if out.is_dir() and any(out.iterdir()):
        why = None if toml.is_file() else "is not empty and holds no profile.toml"
        if why is None:
            diffs = es.settings_diff(read_toml(toml), head)
            why = "holds a profile of other settings: " + "; ".join(diffs[:4]) if diffs else None
        if why and not force:
            raise ValueError(f"--out {out} {why}; rerun with the same arguments to resume, "
                             f"choose another --out, or add --force to start over")
        if why:
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return es.read_samples(out)


def _model_config(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model-config {path}: {exc}") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: whole numbers, "
                                         f"comma-separated") from None
    if not values or min(values) < 1:
        raise ValueError(f"--batches {text!r}: whole numbers >= 1")
    return values
