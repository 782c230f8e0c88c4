"""``hawk replay`` and ``hawk compare-runs``: a trace against a live endpoint, runs side by side.

``sim.commands.main`` calls ``register(subparsers)``; each subcommand's handler takes the parsed
arguments and returns the exit code. Errors in user input raise ``ValueError`` or
``FileNotFoundError`` naming the bad value (the ``hawk`` entry point prints them).

    hawk replay --endpoint http://host:8000 --trace azure.csv --out runs/real [--json]
    hawk compare-runs runs/sim runs/real [--json]

Replay order: load the trace (``traces.loaders``; first arrival at 0.0 s), shape it
(``--window``, ``--sample``, ``--rate-scale``, length caps; ``traces.shaping``), take the
first ``--num-requests``, then send it (``traces.replay``). SLOs: ``--ttft-slo`` /
``--tpot-slo``, else ``--workload``'s, else 2.0 s / 0.2 s.
"""

from __future__ import annotations

import argparse

import math
import os
import sys
from pathlib import Path

from traces.jsonout import dumps, writable_dir
from traces.trace_flags import add_columns_arg

DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.2


def register(subparsers) -> None:
    """Add ``replay`` and ``compare-runs`` to an argparse subparsers object."""
    from traces.loaders import FORMATS
    from traces.shaping import CAP_MODES
    from traces.workloads import WORKLOADS

    p = subparsers.add_parser("replay", help="replay a trace open-loop against a live "
                                             "OpenAI-compatible streaming endpoint")
    p.add_argument("--endpoint", required=True, help="base URL, or a full .../completions URL")
    p.add_argument("--trace", type=Path, required=True,
                   help="trace file (any supported format), or a bundled trace's name "
                   "(azure-llm-2023-conv.csv, azure-llm-2023-code.csv)")
    p.add_argument("--trace-format", choices=FORMATS, help="default: detected from the header")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed rows, reported")
    add_columns_arg(p)
    p.add_argument("--filter", action="append", default=[], metavar="COLUMN=VALUE",
                   help="keep rows whose COLUMN equals VALUE (repeatable; e.g. Model=ChatGPT)")
    p.add_argument("--window", metavar="START:END", help="seconds of the trace to keep")
    p.add_argument("--sample", type=float, metavar="FRACTION", help="keep each request w.p.")
    p.add_argument("--rate-scale", type=float, default=1.0, help="2 replays twice as fast")
    p.add_argument("--max-prompt-tokens", type=int, help="length cap (counted, reported)")
    p.add_argument("--max-output-tokens", type=int, help="length cap (counted, reported)")
    p.add_argument("--cap-mode", choices=CAP_MODES, default="truncate")
    p.add_argument("--seed", type=int, default=0, help="seed for --sample")
    p.add_argument("--num-requests", type=int, help="send only the first N (after shaping)")
    p.add_argument("--model", help="model name sent in each request (default: the endpoint's "
                   "only model on /v1/models; 'default' where it lists none)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request limit, seconds")
    p.add_argument("--prompt-token-ids", metavar="LOW:HIGH",
                   help="send prompts as lists of random token ids in [LOW, HIGH) (exact "
                   "counts; completions API; engines whose prompt takes only strings refuse it)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--shared-prefix-ratio", type=float, default=0.0, metavar="R",
                   help="share the first R of every prompt's tokens (default 0: prompts are "
                   "distinct from their first token, so no prefix cache skips prefill)")
    p.add_argument("--logprobs", action="store_true",
                   help="ask for one logprob per token: exact counts from engines without usage")
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="send cache_prompt: false (llama-server's per-request prompt cache)")
    p.add_argument("--max-duration", type=float, default=86_400.0, metavar="SECONDS",
                   help="refuse a trace whose last arrival is later than this (default 1 day)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos/min_tokens (for servers that reject them)")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable with a bearer key")
    p.add_argument("--out", type=Path, help="write records, summary, ITLs and client facts here")
    _add_slo_args(p, WORKLOADS)
    p.set_defaults(func=cmd_replay)

    p = subparsers.add_parser("compare-runs", help="two runs' (or traces') metrics side by side")
    p.add_argument("a", type=Path, help="run directory, records file or trace")
    p.add_argument("b", type=Path, help="run directory, records file or trace")
    p.add_argument("--trace-format", choices=FORMATS, help="format of trace arguments")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed trace rows")
    _add_slo_args(p, WORKLOADS)
    p.set_defaults(func=cmd_compare_runs)


def _add_slo_args(p, workloads) -> None:
    p.add_argument("--workload", choices=sorted(workloads), help="use this workload's SLOs")
    p.add_argument("--ttft-slo", type=float, help=f"seconds (default {DEFAULT_TTFT_SLO_S})")
    p.add_argument("--tpot-slo", type=float, help=f"seconds (default {DEFAULT_TPOT_SLO_S})")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def slos(args, fallback: dict | None = None) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs: flags, else the workload's, else ``fallback``'s, else defaults."""
    from traces.workloads import workload_spec

    ttft, tpot = DEFAULT_TTFT_SLO_S, DEFAULT_TPOT_SLO_S
    if fallback and fallback.get("ttft_slo_s") is not None:
        ttft, tpot = fallback["ttft_slo_s"], fallback.get("tpot_slo_s", tpot)
    if args.workload is not None:
        spec = workload_spec(args.workload)
        ttft, tpot = spec.ttft_slo_s, spec.tpot_slo_s
    ttft = args.ttft_slo if args.ttft_slo is not None else ttft
    tpot = args.tpot_slo if args.tpot_slo is not None else tpot
    for name, value in (("--ttft-slo", ttft), ("--tpot-slo", tpot)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0 seconds, got {value}")
    return float(ttft), float(tpot)


def prepare_trace(args):
    """Load, shape and cut the trace as the replay flags say; reports go to stderr."""
    from traces.loaders import load_trace
    from traces.shaping import ShapeSpec, shape

    trace, report = load_trace(args.trace, args.trace_format, skip_bad=args.skip_bad,
                               mapping=args.columns,
                               filters=_filters(args.filter))
    start, end = _window(args.window)
    spec = ShapeSpec(start_s=start, end_s=end, sample_fraction=args.sample,
                     rate_scale=args.rate_scale, max_prompt_tokens=args.max_prompt_tokens,
                     max_output_tokens=args.max_output_tokens, cap_mode=args.cap_mode,
                     seed=args.seed)
    trace, shaped = shape(trace, spec)
    if args.num_requests is not None:
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        trace = trace.head(args.num_requests)
    if len(trace) == 0:
        raise ValueError(f"{args.trace}: no requests left after shaping ({shaped.describe()})")
    if not args.json:
        print(report.describe(), file=sys.stderr)
        print(f"shaping: {shaped.describe()}; sending {len(trace)}", file=sys.stderr)
    return trace


def cmd_replay(args) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("hawk replay: needs aiohttp, which the 'replay' extra installs: "
              "pip install -e .[replay]", file=sys.stderr)
        return 2
    from traces.prompts import PromptSpec
    from traces.replay import ReplayConfig, replay

    ttft_slo, tpot_slo = slos(args)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if api_key is None:
            raise ValueError(f"--api-key-env: environment variable {args.api_key_env} is not set")
    config = ReplayConfig(args.endpoint, model=args.model, api=args.api, timeout_s=args.timeout,
                          prompt=PromptSpec(**_prompt_kind(args.prompt_token_ids),
                                            seed=args.prompt_seed,
                                            shared_prefix_ratio=args.shared_prefix_ratio),
                          ignore_eos=not args.no_ignore_eos, logprobs=args.logprobs,
                          cache_prompt=False if args.no_prompt_cache else None,
                          api_key=api_key, max_duration_s=args.max_duration)
    if args.out is not None:
        writable_dir(args.out)
    result = replay(prepare_trace(args), config)
    if args.out is not None:
        summary = result.write(args.out, ttft_slo, tpot_slo)
    else:
        summary = result.summary(ttft_slo, tpot_slo)
    if args.json:
        print(dumps(summary))
    else:
        print(format_replay_summary(summary))
        if args.out is not None:
            print(f"records, summary, ITLs and client facts written to {args.out}/")
    return 0


def cmd_compare_runs(args) -> int:
    from traces.compare import compare_runs, format_table, load_run

    a = load_run(args.a, args.trace_format, args.skip_bad)
    b = load_run(args.b, args.trace_format, args.skip_bad)
    ttft_slo, tpot_slo = slos(args, a.summary_file or b.summary_file)
    comparison = compare_runs(a, b, ttft_slo, tpot_slo)
    print(dumps(comparison) if args.json else format_table(comparison))
    return 0


def format_replay_summary(summary: dict) -> str:
    def fmt(key: str) -> str:
        value = summary.get(key)
        return "-" if value is None else f"{value:.4g}"

    rows = [("endpoint", summary["endpoint"]), ("model", summary.get("model", "-")),
            ("requests", summary["num_requests"]),
            ("finished ok", summary["num_finished"]), ("failed", summary["num_failed"]),
            ("SLO attainment", "-" if summary["slo_attainment"] is None else
             f"{100 * summary['slo_attainment']:.1f}% (TTFT {summary['ttft_slo_s']:g} s, "
             f"TPOT {summary['tpot_slo_s']:g} s)")]
    for name in ("ttft", "tpot", "e2e"):
        rows.append((f"{name.upper()} p50/p90/p99 (s)",
                     " / ".join(fmt(f"{name}_p{q}_s") for q in (50, 90, 99))))
    rows += [("ITL p50/p99 (s)", f"{fmt('itl_p50_s')} / {fmt('itl_p99_s')}"),
             ("send lag p50/p99/max (s)", " / ".join(
                 fmt(f"send_lag_{q}_s") for q in ("p50", "p99", "max"))),
             ("output tokens/s", fmt("output_tokens_per_s")),
             ("short outputs", summary["num_short_outputs"]),
             ("statuses", _counts(summary["statuses"])),
             ("finish reasons", _counts(summary.get("finish_reasons", {}))),
             ("token counts from", _counts(summary.get("token_count_sources", {})))]
    for k, item in enumerate(summary.get("top_errors") or []):
        rows.append(("most common errors" if k == 0 else "",
                     f"{item['count']} x {item['status']}: {item['error'][:120]}"))
    if summary.get("num_usage_mismatch"):
        rows.append(("usage disagreeing with the stream", summary["num_usage_mismatch"]))
    if summary.get("server_ttft_p50_s") is not None:
        rows.append(("server TTFT p50/p99 (s)",
                     f"{fmt('server_ttft_p50_s')} / {fmt('server_ttft_p99_s')}"))
    if summary.get("server_prompt_tokens_evaluated") is not None:
        rows.append(("prompt tokens evaluated (server)", summary["server_prompt_tokens_evaluated"]))
    if summary.get("server_cached_tokens") is not None:
        rows.append(("prompt tokens from cache (server)", summary["server_cached_tokens"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _counts(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "-"


def _prompt_kind(text: str | None) -> dict:
    if text is None:
        return {"kind": "words"}
    low, sep, high = text.partition(":")
    try:
        return {"kind": "token_ids", "token_id_low": int(low), "token_id_high": int(high)}
    except ValueError:
        raise ValueError(f"--prompt-token-ids takes LOW:HIGH token ids, got {text!r}") from None


def _filters(items: list[str]) -> dict[str, list[str]]:
    filters: dict[str, list[str]] = {}
    for item in items:
        column, sep, value = item.partition("=")
        if not sep or not column:
            raise ValueError(f"--filter takes COLUMN=VALUE, got {item!r}")
        filters.setdefault(column, []).append(value)
    return filters


def _window(text: str | None) -> tuple[float, float | None]:
    if text is None:
        return 0.0, None
    start, sep, end = text.partition(":")
    try:
        return float(start or 0.0), (float(end) if end else None)
    except ValueError:
        raise ValueError(f"--window takes START:END in seconds, got {text!r}") from None
