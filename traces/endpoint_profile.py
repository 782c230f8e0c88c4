"""Measuring a live OpenAI-compatible engine from outside: what ``hawk profile --endpoint``
runs. The requests go through the replay client's streaming pieces (``traces.replay``:
``request_body``, ``_send``), token-id prompts with forced lengths, one at a time or N at once
(closed loop: a point's requests are sent together and the next point waits for them).

Points (``plan_points``), in this order, each measured once and kept in ``samples.jsonl`` (a
rerun into the same directory skips the points it holds: the profile is resumable):

- ``floor``: a one-token prompt, ``max_tokens`` 1, repeated: the client and API server's
  round trip plus one engine step of one token.
- ``decode``: N requests at once, each a prompt of L tokens and a long output; once all N
  decode (after the last one's first token, before the first one's finish) the engine runs
  steps of N sequences, and each request's mean gap between tokens there is one step (the
  median over the N; repeated, a run whose stream came in bursts is outvoted). The step's
  context per request is L plus the tokens made by the middle of that window.
- ``prefill``: a lone request of L prompt tokens and ``max_tokens`` 1, repeated: its TTFT.
- ``burst``: K one-token requests sent at once, repeated: the time until the last answer;
  its slope in K is the front end's cost per request. ``churn``: N decoding requests alone
  and with one-token ones coming and going, alternated (both: ``traces.endpoint_costs``).

Where the engine has vLLM's ``/metrics`` (``traces.engine_metrics``), every run is read there
too (``engine_seconds``): a floor or prefill request's engine-core time from scheduling it to
its first token, a decode run's mean gap between a request's steps by the engine's clock
(ramp-up steps included; a stalled stream cannot shorten it). The API latency is then the
floor's TTFT less the engine's time, request by request, and prefill.csv and decode.csv hold
the engine's times; without ``/metrics``, the rules below.

The engine's settings (``engine_settings``): ``/v1/models`` (the model and ``max_model_len``),
vLLM's ``/metrics`` ``vllm:cache_config_info`` (``block_size``, ``kv_cache_size_tokens``);
the scheduler's limits as the caller passes them (vLLM V1 on a CPU: ``max_num_seqs`` 128,
``max_num_batched_tokens`` 2048, ``vllm/engine/arg_utils.py`` ``get_batch_defaults``).

Derived tables (``hardware.serve.profile_files``'s format, ``sim.models.profile_dir`` reads
them) without ``/metrics``: the API latency is the floor's TTFT less one decode step of one
sequence, prefill.csv each length's TTFT less that, decode.csv each point's step. ``[serving]
engine = "aggregated"``: the simulator serves both phases in one instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: vLLM V1's scheduler defaults on a CPU behind its OpenAI server (arg_utils.get_batch_defaults)
VLLM_CPU_MAX_NUM_SEQS, VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 128, 2048
SAMPLES_FILE = "samples.jsonl"


class EndpointProfileError(ValueError):
    """The endpoint cannot be profiled (unreachable, no model, a point whose requests failed)."""


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure. Lengths left None are spread over the engine's context."""

    prompt_lengths: tuple[int, ...] | None = None
    repeats: int = 5
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_prompts: tuple[int, ...] | None = None
    decode_tokens: int = 64
    floor_repeats: int = 30
    decode_repeats: int = 3
    bursts: tuple[int, ...] = (8, 64)
    burst_repeats: int = 3

    def __post_init__(self) -> None:
        if len(set(self.bursts)) < 2 or min(self.bursts) < 1:
            raise ValueError(f"profile plan: bursts {self.bursts} must be two or more sizes "
                             f">= 1 (the cost per request is their slope)")
        for name in ("repeats", "decode_tokens", "floor_repeats", "decode_repeats",
                     "burst_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile plan: {name} = {getattr(self, name)} must be >= 1")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"profile plan: batches {self.batches} must be >= 1")


@dataclass(frozen=True)
class EngineSettings:
    """What the engine says about itself, and the limits the caller passes."""

    model: str
    max_model_len: int
    block_size: int
    num_kv_tokens: int
    max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS
    max_num_batched_tokens: int = VLLM_CPU_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class Point:
    """One measurement: ``kind`` floor, prefill or decode; ``batch`` requests at once of
    ``prompt`` tokens, ``max_tokens`` each, ``repeats`` times one after the other."""

    kind: str
    prompt: int
    batch: int
    max_tokens: int
    repeats: int = 1

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.prompt}:{self.batch}:{self.max_tokens}"


def plan_points(plan: ProfilePlan, engine: EngineSettings) -> list[Point]:
    """Every point of ``plan`` on this engine: the floor, the decode grid (batch 1 at the
    shortest prompt first: the API latency needs it), then the prefill lengths."""
    context = engine.max_model_len
    tokens = min(plan.decode_tokens, context // 2)
    prompts = plan.decode_prompts or tuple(sorted({max(1, context // 16), context // 4,
                                                  context // 2, context - tokens - 8}))
    batches = [b for b in sorted(set(plan.batches)) if b <= engine.max_num_seqs]
    lengths = plan.prompt_lengths or tuple(sorted({1, *(max(1, context * k // 16)
                                                        for k in (1, 2, 4, 8, 12)),
                                                   context - 1}))
    for n in (*prompts, *lengths):
        if not 1 <= n < context:
            raise ValueError(f"prompt length {n}: need 1..{context - 1} (max_model_len "
                             f"{context})")
    out = [Point("floor", 1, 1, 1, plan.floor_repeats)]
    out += [Point("decode", p, b, min(tokens, context - p), plan.decode_repeats)
            for b in batches for p in prompts]
    out += [Point("prefill", n, 1, 1, plan.repeats) for n in lengths]
    out += [Point("burst", 1, k, 1, plan.burst_repeats) for k in sorted(set(plan.bursts))]
    churn = min(b for b in batches if b >= min(8, max(batches)))
    prompt = prompts[1] if len(prompts) > 1 else prompts[0]
    out.append(Point("churn", prompt, churn, max(1, min(2 * tokens, context - prompt - 1)),
                     plan.decode_repeats))
    return out


# -- talking to the endpoint ------------------------------------------------------------------
def engine_settings(endpoint: str, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None) -> EngineSettings:
    """The engine's model and context (``/v1/models``), KV block size and tokens (vLLM's
    ``/metrics``), and the scheduler limits given (else vLLM V1's CPU defaults)."""
    return asyncio.run(_engine_settings(endpoint, max_num_seqs, max_num_batched_tokens))


async def _engine_settings(endpoint, max_num_seqs, max_num_batched_tokens) -> EngineSettings:
    import aiohttp

    from traces.replay import ReplayConfig

    config = ReplayConfig(endpoint)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        try:
            async with http.get(config.models_url) as response:
                listing = (await response.json(content_type=None)
                           if response.status == 200 else f"HTTP {response.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise EndpointProfileError(f"{config.models_url}: {exc}") from None
        models = [m for m in (listing.get("data") or []) if isinstance(m, dict)] \
            if isinstance(listing, dict) else []
        if len(models) != 1 or not isinstance(models[0].get("max_model_len"), int):
            raise EndpointProfileError(f"{config.models_url}: expected one model with "
                                       f"max_model_len (as vLLM lists), got {listing!r:.200}")
        info = await _cache_info(http, config.models_url.removesuffix("/v1/models"))
    block = int(info.get("block_size", 16))
    return EngineSettings(str(models[0]["id"]), models[0]["max_model_len"], block,
                          int(info.get("kv_cache_size_tokens", 0)) or block * int(
                              info.get("num_gpu_blocks", 0) or 65536),
                          max_num_seqs or VLLM_CPU_MAX_NUM_SEQS,
                          max_num_batched_tokens or VLLM_CPU_MAX_NUM_BATCHED_TOKENS)


async def _cache_info(http, base: str) -> dict:
    """The labels of ``vllm:cache_config_info`` on ``/metrics`` (empty where there is none)."""
    try:
        async with http.get(base + "/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except Exception:  # noqa: BLE001  (no metrics is an answer: the defaults hold)
        return {}
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1:line.rindex("}")]
            return dict((k, v.strip('"')) for k, _, v in
                        (part.partition("=") for part in labels.split(",")) if v)
    return {}


def measure(endpoint: str, engine: EngineSettings, points: list[Point], token_ids=(3, 1000),
            done=lambda point, sample: None) -> None:
    """Measure ``points`` in order; ``done(point, sample)`` after each (the caller keeps it)."""
    asyncio.run(_measure(endpoint, engine, points, token_ids, done))


async def _measure(endpoint, engine, points, token_ids, done) -> None:
    import aiohttp

    from traces import engine_metrics
    from traces.prompts import PromptMaker, PromptSpec
    from traces.replay import ReplayConfig

    spec = PromptSpec(kind="token_ids", token_id_low=token_ids[0], token_id_high=token_ids[1],
                      seed=len(points))
    config = ReplayConfig(endpoint, model=engine.model, start_delay_s=0.0)
    base = config.models_url.removesuffix("/v1/models")
    prompts = PromptMaker(spec, engine.max_model_len)
    counter = iter(range(10**9))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        await _run(http, config, prompts, counter, 1, 1, 1)          # warm-up
        for point in points:
            if point.kind == "churn":
                from traces.endpoint_costs import churn_pair

                runs = [await churn_pair(
                    http, config, prompts, counter, point.prompt, point.batch,
                    point.max_tokens, error=EndpointProfileError,
                    run=lambda *a: _run(http, config, prompts, counter, *a),
                    step_of=lambda states: _decode_run(point, states)[0])
                        for _ in range(point.repeats)]
                done(point, {"key": point.key, **dataclasses.asdict(point),
                             "baseline_seconds": [a for a, _, _ in runs],
                             "seconds": [b for _, b, _ in runs], "rates": [r for _, _, r in runs]})
                continue
            if point.kind == "decode":
                runs, seen = [], []
                for _ in range(point.repeats):
                    before = await engine_metrics.scrape(http, base)
                    runs.append(_decode_run(point, await _run(
                        http, config, prompts, counter, point.prompt, point.batch,
                        point.max_tokens)))
                    seen.append(engine_metrics.means(
                        before, await engine_metrics.scrape(http, base)))
                sample = {"key": point.key, **dataclasses.asdict(point),
                          "seconds": [step for step, _ in runs],
                          "context_per_request": float(np.median([c for _, c in runs]))}
                _engine_view(sample, seen, "itl_s")
                done(point, sample)
                continue
            seconds, seen = [], []
            for _ in range(point.repeats):
                before = await engine_metrics.scrape(http, base)
                states = await _run(http, config, prompts, counter, point.prompt,
                                    point.batch, 1)
                # sent at 0: a lone request's TTFT, a burst's last answer
                seconds.append(max(s.token_at[-1] for s in states))
                seen.append(engine_metrics.means(before, await engine_metrics.scrape(
                    http, base)))
            sample = {"key": point.key, **dataclasses.asdict(point), "seconds": seconds}
            _engine_view(sample, seen, None if point.kind == "burst" else "prefill_s")
            done(point, sample)


def _engine_view(sample: dict, seen: list[dict], key: str | None) -> None:
    """Into ``sample``, from each run's ``/metrics`` means: ``engine_seconds`` (the engine's
    own ``key``) and ``api_cpu_seconds`` (the API server's CPU), where every run has them."""
    for name, field in (("engine_seconds", key), ("api_cpu_seconds", "api_cpu_s")):
        values = [m.get(field) for m in seen] if field else [None]
        if all(v is not None for v in values):
            sample[name] = values


async def _run(http, config, prompts, counter, prompt: int, batch: int, max_tokens: int):
    """``batch`` requests of ``prompt`` tokens sent at once; their progress states."""
    from traces.replay import _Progress, _send, request_body

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    states = [_Progress(0.0, max_tokens) for _ in range(batch)]
    await asyncio.gather(*(_send(http, config, request_body(
        config, prompts.prompt(next(counter), prompt), max_tokens), s, t0) for s in states))
    bad = [s for s in states if s.status is None or s.status.value != "ok"]
    if bad:
        raise EndpointProfileError(f"{len(bad)} of {batch} requests of {prompt} prompt "
                                   f"tokens failed: {bad[0].status} {bad[0].error}")
    return states


def _decode_run(point: Point, states) -> tuple[float, float]:
    """(step, context per request) of one run of N requests: the median over the requests
    of each one's mean gap between tokens while all N decode."""
    start = max(s.token_at[0] for s in states)
    end = min(s.token_at[-1] for s in states)
    gaps, made = [], []
    for s in states:
        at = np.asarray(s.token_at)
        inside = at[(at >= start) & (at <= end)]
        if len(inside) < 3:                    # too short a window: all its decode steps
            inside = at
        gaps.append(float(inside[-1] - inside[0]) / (len(inside) - 1))
        made.append(float(np.searchsorted(at, 0.5 * (inside[0] + inside[-1]))))
    return float(np.median(gaps)), point.prompt + float(np.median(made))


# -- the profile directory --------------------------------------------------------------------
#: the catalog device the measured engine stands for (power and prices only)
STANDS_FOR = "a100-pcie"
MODEL_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
              "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
              "head_dim": "head_dim", "intermediate_size": "intermediate_size",
              "vocab_size": "vocab_size"}


def header(endpoint: str, engine: EngineSettings, plan: ProfilePlan,
           model_config: dict | None = None) -> dict:
    """profile.toml's tables, less what the samples give ([serving] api_latency_s)."""
    from importlib.metadata import PackageNotFoundError, version

    from hardware.serve.profile_files import FORMAT

    try:
        hawk_version = version("hawk-sim")
    except PackageNotFoundError:
        hawk_version = "unknown"
    model = {k: int(model_config[v]) for k, v in MODEL_KEYS.items()
             if model_config and isinstance(model_config.get(v), int)}
    return {
        "meta": {"format": FORMAT, "hawk_version": hawk_version, "complete": False},
        "machine": {"description": f"the engine at {endpoint}, measured from outside",
                    "endpoint": endpoint, "stands_for_prefill": STANDS_FOR,
                    "stands_for_decode": STANDS_FOR},
        "model": {**model, "max_context": engine.max_model_len, "served": engine.model},
        "serving": {"engine": "aggregated", "prefill_max_batch_tokens":
                    engine.max_num_batched_tokens, "decode_max_batch": engine.max_num_seqs,
                    "kv_block_tokens": engine.block_size, "num_kv_tokens": engine.num_kv_tokens,
                    "kv_dtype": "bfloat16", "batch_padding": "none"},
        "sweep": {k: list(v) if isinstance(v, tuple) else v
                  for k, v in dataclasses.asdict(plan).items() if v is not None},
    }


def _stats(values) -> tuple[float, float, float]:
    v = np.asarray(values, dtype=float)
    return tuple(float(np.percentile(v, q)) for q in (50, 10, 90))


def floor_latencies(samples: dict[str, dict]) -> list[float]:
    """Each floor request's TTFT less the engine's own time for it (without ``/metrics``:
    less the decode step of one sequence), never below 0; empty until both are measured."""
    floor = [s for s in samples.values() if s["kind"] == "floor"]
    lone = sorted((s for s in samples.values() if s["kind"] == "decode" and s["batch"] == 1),
                  key=lambda s: s["context_per_request"])
    if not floor or not lone:
        return []
    engine = floor[0].get("engine_seconds") or _stats(
        lone[0].get("engine_seconds") or lone[0]["seconds"])[0]
    return [max(0.0, float(x)) for x in np.subtract(floor[0]["seconds"], engine)]


def derive(samples: dict[str, dict]) -> tuple[float | None, list, list]:
    """(API latency, prefill.csv rows, decode.csv rows) from the samples measured so far.
    The latency needs the floor and a decode point of one sequence; prefill rows need it."""
    decode = sorted((s for s in samples.values() if s["kind"] == "decode"),
                    key=lambda s: (s["batch"], s["context_per_request"]))
    rows = [(s["batch"], s["context_per_request"], s["batch"] * s["context_per_request"],
             *_stats(s.get("engine_seconds") or s["seconds"]), len(s["seconds"]))
            for s in decode]
    floor = [s for s in samples.values() if s["kind"] == "floor"]
    lone = [s for s in decode if s["batch"] == 1]
    if not floor or not lone:
        return None, [], rows
    latency = _stats(floor_latencies(samples))[0]
    prefill = []
    for s in sorted((s for s in samples.values() if s["kind"] == "prefill"),
                    key=lambda s: s["prompt"]):
        engine_s = s.get("engine_seconds") or [max(t - latency, 1e-6) for t in s["seconds"]]
        prefill.append((s["prompt"], 1, *_stats(engine_s), len(engine_s)))
    return latency, prefill, rows


def write_profile(out: Path, head: dict, samples: dict[str, dict], complete: bool) -> None:
    """profile.toml, prefill.csv and decode.csv from ``head`` and the samples (rewritten
    whole: they are derived, ``samples.jsonl`` is the record)."""
    from hardware.serve.profile_files import KEYS, STATS, to_toml

    out = Path(out)
    latency, prefill, decode = derive(samples)
    doc = {k: dict(v) for k, v in head.items()}
    doc["meta"]["complete"] = complete and latency is not None
    doc["serving"]["api_latency_s"] = latency
    doc["serving"]["api_latency_samples_s"] = floor_latencies(samples) or None
    from traces.endpoint_costs import churn_cost, frontend_cost, frontend_token_cost

    cost = frontend_cost(samples)
    if cost is not None:
        doc["serving"]["frontend_request_s"] = cost
    doc["serving"]["frontend_token_s"] = frontend_token_cost(samples)
    doc["serving"].update(churn_cost(samples) or {})
    for name, rows in (("prefill", prefill), ("decode", decode)):
        text = ",".join(KEYS[name] + STATS) + "\n" + "".join(
            ",".join(f"{x:.9g}" if isinstance(x, float) else str(x) for x in row) + "\n"
            for row in rows)
        (out / f"{name}.csv").write_text(text)
    tmp = out / "profile.toml.tmp"
    tmp.write_text("# Written by `hawk profile --endpoint`; seconds, tokens.\n" + to_toml(doc))
    tmp.replace(out / "profile.toml")
