"""The real mode and the simulator on the same requests, at a light load and near the knee, and
how far apart they are (``sim.validation.errors``): ``validate``, run by ``hawk validate``.

1. Requests: a trace file (a bundled name such as ``azure-llm-2023-conv.csv`` too; its first
   ``--num-requests``) or a synthetic workload with Poisson arrivals (``--workload chatbot``).
   Lengths are scaled down by one factor to fit the profile's model (``fit_to_context``, as
   ``hawk real run`` does); both sides get exactly these requests.
2. Loads: each is a mean arrival rate; the trace's arrival instants are divided by one factor
   to reach it (its burstiness kept). ``knee`` = ``KNEE_SHARE`` of the simulator's own knee on
   this profile and trace (the highest rate with SLO attainment >= 90%, found by doubling then
   bisection, on the requests repeated to ``KNEE_REQUESTS``: a steady state); ``light`` =
   ``LIGHT_SHARE`` of that knee; or rates in req/s.
3. SLOs (the same for both sides): unless given, ``TTFT_SLO_X`` x and ``TPOT_SLO_X`` x the
   TTFT and TPOT the simulator predicts for the trace's longest prompt served alone on this
   profile: a latency budget that queueing near the knee eats into.
4. Per load: ``hawk real run``'s machinery (a ``LocalCluster`` serving the profile's own model
   with its [serving] settings: aggregated workers for a profile of ``hawk real profile
   --shape aggregated``), or with ``endpoint`` a replay against that live engine
   (``traces.replay``: a profile of ``hawk profile --endpoint``, an aggregated instance), and
   ``hawk simulate --profile DIR`` on the same trace, judged by
   ``sim.validation.errors.judge``. With ``--out``: ``OUTDIR/<load>/paired.parquet`` (the paired
   records), ``real/`` and ``sim/`` records and summaries, and ``validate.json``.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.validation import errors as val
from sim.validation.endpoint import WARMUP_REQUESTS, as_sent, endpoint_records, views
from traces.jsonout import dumps
from traces.trace import Trace

KNEE_SHARE = 0.8
LIGHT_SHARE = 0.25
TTFT_SLO_X = 5.0
TPOT_SLO_X = 5.0
KNEE_TARGET = 0.9
#: requests the knee is searched on (the trace repeated, ``Requests.repeated``)
KNEE_REQUESTS = 400


@dataclass(frozen=True)
class Load:
    name: str          # "light", "knee" or "rate-R"
    rate: float        # mean arrivals per second


@dataclass(frozen=True)
class Requests:
    """The requests both sides serve: lengths scaled, arrivals at ``base_rate`` mean rate."""

    trace: Trace
    base_rate: float
    length_scale: float
    source: str

    def at(self, rate: float) -> Trace:
        """The same requests, arrivals stretched so the mean rate is ``rate``."""
        if not rate > 0:
            raise ValueError(f"rate {rate}: need > 0 requests/s")
        factor = self.base_rate / rate
        return dataclasses.replace(self.trace, arrival_at=self.trace.arrival_at * factor,
                                   name=f"{self.trace.name}@{rate:.4g}/s")

    def repeated(self, num_requests: int) -> "Requests":
        """The requests over and over, back to back at the same mean rate, until there are at
        least ``num_requests``: a short trace's steady state, where a knee is defined (a few
        requests meet any SLO, however fast they come)."""
        t, k = self.trace, -(-num_requests // len(self.trace))
        period = float(t.arrival_at[-1]) + 1.0 / self.base_rate
        arrivals = np.concatenate([t.arrival_at + j * period for j in range(k)])
        tiled = Trace.from_columns(arrivals, np.tile(t.num_prompt_tokens, k),
                                   np.tile(t.num_output_tokens, k), name=f"{t.name} x{k}")
        return dataclasses.replace(self, trace=tiled)


# -- the profile and the two sides ------------------------------------------------------------
def read_profile(path) -> dict:
    """``DIR/profile.toml``; one clear error naming what is missing."""
    from sim.config import tomllib

    path = Path(path)
    toml = path / "profile.toml"
    if not toml.is_file():
        raise FileNotFoundError(f"--profile {path}: no profile.toml there (measure one with "
                                f"hawk real profile --out {path})")
    try:
        doc = tomllib.loads(toml.read_text())
    except ValueError as e:
        raise ValueError(f"{toml}: not valid TOML ({e})") from None
    for table in ("serving", "model"):
        if not isinstance(doc.get(table), dict):
            raise ValueError(f"{toml}: no [{table}] table")
    if not from_endpoint(doc) and not (path / "model" / "config.json").is_file():
        raise FileNotFoundError(f"--profile {path}: no model/config.json (the model measured)")
    return doc


def is_aggregated(doc: dict) -> bool:
    """Whether the profile measured one engine serving both phases (``hawk profile
    --endpoint``, ``hawk real profile --shape aggregated``)."""
    return doc["serving"].get("engine") == "aggregated"


def from_endpoint(doc: dict) -> bool:
    """Whether the profile measured a live engine from outside (``hawk profile --endpoint``:
    [machine] endpoint), which only that engine can serve again."""
    return is_aggregated(doc) and bool((doc.get("machine") or {}).get("endpoint"))


def mechanism_of(doc: dict, asked: str | None) -> str | None:
    if is_aggregated(doc):
        if asked is not None:
            raise ValueError(f"--mechanism {asked}: the profile measured one engine serving "
                             f"both phases; no KV moves")
        return None
    measured = list(doc["serving"].get("mechanisms") or [])
    if asked is None:
        if not measured:
            raise ValueError("profile.toml: [serving] mechanisms is empty")
        return "GN-HAWK" if "GN-HAWK" in measured else measured[0]
    if measured and asked not in measured:
        raise ValueError(f"--mechanism {asked}: the profile measured only {measured}")
    return asked


def context_of(doc: dict) -> int:
    s, m = doc["serving"], doc["model"]
    return int(s.get("max_request_tokens") or m.get("max_context"))


def cluster_config(profile, doc: dict, mechanism: str | None):
    """The real side: the profile's own model and the workers' settings it was measured with
    (``mechanism`` None: one aggregated worker)."""
    from hardware.serve.cluster import ClusterConfig

    s = doc["serving"]
    flags = {"--max-batch-tokens": "prefill_max_batch_tokens", "--num-blocks": "prefill_num_blocks",
             "--max-batch-size": "decode_max_batch", "--num-tokens": "num_kv_tokens",
             "--max-request-tokens": "max_request_tokens", "--send-buffer-mb": "send_buffer_mb",
             "--threads": "threads"}
    args = [a for flag, key in flags.items() if s.get(key) is not None
            for a in (flag, str(s[key]))]
    device = (doc.get("machine") or {}).get("device")
    if device:
        args += ["--device", "cpu" if device == "cpu" else "cuda"]
    if mechanism is None:
        return ClusterConfig(shape="aggregated", model=str(Path(profile) / "model"),
                             worker_args=args)
    return ClusterConfig(mechanism=mechanism, kv_dtype=s.get("kv_dtype", "bfloat8_b"),
                         model=str(Path(profile) / "model"), worker_args=args)


def simulate_on_profile(profile, trace: Trace, mechanism: str | None, ttft_slo_s: float,
                        tpot_slo_s: float):
    """Records of ``hawk simulate --profile DIR`` on ``trace`` (``sim.models.profile_dir``);
    ``mechanism`` None: an aggregated profile's (no link)."""
    from sim.engine.cluster import simulate
    from sim.config import RunConfig

    link = {} if mechanism is None else {"cluster.link.mechanism": mechanism}
    config = RunConfig().replace(**{"cluster.profile": str(profile), **link,
                                    "slo.ttft_s": ttft_slo_s, "slo.tpot_s": tpot_slo_s})
    return simulate(config, trace).records


def real_records(trace: Trace, config, ttft_slo_s: float, tpot_slo_s: float, context: int,
                 out: Path, progress: bool):
    """Records of ``hawk real run`` on ``trace`` (written to ``out`` too)."""
    from hardware.serve.run import RealRunConfig, real_run
    from traces.schema import read_records

    real_run(trace, RealRunConfig(config, ttft_slo_s, tpot_slo_s, context, progress=progress,
                                  warmup_requests=WARMUP_REQUESTS), out)
    return read_records(out / "records.parquet")


# -- requests, SLOs, knee -------------------------------------------------------------------
def load_requests(trace_path, workload: str | None, num_requests: int, context: int,
                  seed: int = 0) -> Requests:
    """The trace's first ``num_requests`` (or the workload's Poisson arrivals at 1 req/s),
    lengths scaled to fit ``context`` tokens."""
    from hardware.serve.run import fit_to_context

    if (trace_path is None) == (workload is None):
        raise ValueError("give one of --trace FILE or --workload NAME")
    if workload is not None:
        from traces.workloads import make_workload

        trace, base, source = make_workload(workload, 1.0, num_requests, seed=seed), 1.0, \
            f"workload {workload}, Poisson arrivals (seed {seed})"
    else:
        from traces.loaders import load_trace

        trace, _ = load_trace(trace_path, max_requests=num_requests)
        trace = trace.head(num_requests)
        if len(trace) < 2 or not trace.duration_s > 0:
            raise ValueError(f"--trace {trace_path}: needs two or more requests at distinct "
                             f"instants to have a rate")
        base = (len(trace) - 1) / float(trace.arrival_at[-1] - trace.arrival_at[0])
        source = f"trace {trace_path}, first {len(trace)} requests (mean {base:.3g} req/s)"
    trace, scale = fit_to_context(trace, context)
    return Requests(trace, base, scale, source)


def default_slos(simulate_fn, requests: Requests) -> tuple[float, float]:
    """``TTFT_SLO_X`` x / ``TPOT_SLO_X`` x the simulated TTFT / TPOT of the longest prompt
    alone (its own output length, at least 2 tokens so TPOT is defined; a token added to
    the output is taken from the prompt, so a request that fills the context still fits)."""
    from traces import metrics

    t = requests.trace
    i = int(t.num_prompt_tokens.argmax())
    prompt, output = int(t.num_prompt_tokens[i]), int(t.num_output_tokens[i])
    extra = max(0, 2 - output)
    alone = Trace.from_columns([0.0], [max(1, prompt - extra)], [output + extra], name="alone")
    frame = simulate_fn(alone, 1e6, 1e6)
    ttft, tpot = float(metrics.ttft(frame)[0]), float(metrics.tpot(frame)[0])
    if not (ttft > 0 and tpot > 0):
        raise ValueError(f"the simulator gives a lone request TTFT {ttft} s, TPOT {tpot} s "
                         f"(status {frame['status'].iloc[0]}); give --ttft-slo and --tpot-slo")
    return TTFT_SLO_X * ttft, TPOT_SLO_X * tpot


def find_knee(simulate_fn, requests: Requests, ttft_slo_s: float, tpot_slo_s: float,
              steps: int = 8) -> float:
    """The highest rate whose simulated attainment is >= ``KNEE_TARGET``
    (``sim.runs.knee.search_knee``: doubling or halving from the trace's own rate to bracket
    it, then ``steps`` bisections). NaN when even 1/1000 of the trace's rate misses, infinity
    when 1000x still meets it."""
    from sim.runs.knee import search_knee
    from traces.metrics import slo_attainment

    def meets(rate: float) -> bool:
        frame = simulate_fn(requests.at(rate), ttft_slo_s, tpot_slo_s)
        return slo_attainment(frame, ttft_slo_s, tpot_slo_s) >= KNEE_TARGET

    return search_knee(meets, requests.base_rate, steps)


def parse_loads(text: str) -> list[str | float]:
    """``light,knee`` or rates in req/s, comma-separated."""
    items = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part in ("light", "knee"):
            items.append(part)
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates {text!r}: {part!r} is not light, knee or a rate") from None
        if not 0 < rate < math.inf:
            raise ValueError(f"--rates {text!r}: rate {part} must be > 0 req/s")
        items.append(rate)
    if not items:
        raise ValueError(f"--rates {text!r}: name one or more loads")
    return items


def resolve_loads(items, knee: float | None) -> list[Load]:
    loads = []
    for item in items:
        if isinstance(item, float):
            loads.append(Load(f"rate-{item:g}", item))
        elif knee is None or not 0 < knee < math.inf:
            raise ValueError(f"the simulator finds no knee on this profile and trace ({knee} "
                             f"req/s: no rate, or every rate up to 1000x the trace's, meets the "
                             f"SLOs 90% of the time); give --rates as req/s")
        else:
            loads.append(Load(item, (KNEE_SHARE if item == "knee" else LIGHT_SHARE) * knee))
    return loads


# -- one validation ---------------------------------------------------------------------------
def validate(profile, requests: Requests, loads_text: str = "light,knee", *,
             mechanism: str | None = None, slos: tuple[float, float] | None = None,
             goals: val.Goals = val.Goals(), out: Path | None = None, progress: bool = False,
             simulate_fn=None, real_fn=None, endpoint: str | None = None,
             token_ids: tuple[int, int] = (3, 1000),
             say=lambda text: None) -> tuple[dict, dict]:
    """Both sides at each load: the result ``hawk validate --json`` prints, and per load name
    the (real, simulated) records. ``simulate_fn`` / ``real_fn`` replace the two sides
    (tests): ``(trace, ttft_slo, tpot_slo) -> records``, ``(trace, ttft_slo, tpot_slo,
    out_dir) -> records``."""
    from sim.models.profile_dir import load_profile_dir
    from traces.schema import write_records

    doc = read_profile(profile)
    mechanism = mechanism_of(doc, mechanism)
    items = parse_loads(loads_text)
    simulate_fn = simulate_fn or (lambda trace, ttft, tpot: simulate_on_profile(
        profile, trace, mechanism, ttft, tpot))
    if real_fn is None and endpoint is not None:
        real_fn = (lambda trace, ttft, tpot, where: endpoint_records(trace, endpoint, ttft,
                                                                     tpot, where, token_ids))
    elif real_fn is None:
        if from_endpoint(doc):
            raise ValueError(f"--profile {profile}: measured from an endpoint ([serving] engine "
                             f"= \"aggregated\"); give --endpoint URL to validate against it")
        config, context = cluster_config(profile, doc, mechanism), context_of(doc)
        real_fn = (lambda trace, ttft, tpot, where: real_records(trace, config, ttft, tpot,
                                                                 context, where, progress))
    # the tables alone (unpadded, no loop factor): the ratios price each batch both ways
    table = load_profile_dir(profile).predictor(batch_padding="none", loop=False)

    def step_time(batch: int, context: float) -> float:
        return table.decode_step_time(batch, int(round(context)))
    if slos is None:
        slos, slo_source = default_slos(simulate_fn, requests), (
            f"{TTFT_SLO_X:g}x TTFT and {TPOT_SLO_X:g}x TPOT of the longest prompt served "
            f"alone, as simulated on the profile")
    else:
        slo_source = "given"
    knee = None
    if any(isinstance(i, str) for i in items):
        knee = find_knee(simulate_fn, requests.repeated(KNEE_REQUESTS), *slos)
        say(f"simulated knee: {knee:.3g} req/s (attainment >= {KNEE_TARGET:.0%})")
    from sim.validation.mixed import describe, mixed_vs_table

    mixed = mixed_vs_table(profile)
    for line in describe(mixed):
        say(line)
    result = {"profile": str(profile), "mechanism": mechanism or "aggregated",
              "mixed_step_vs_table": mixed,
              "requests": requests.source, "endpoint": endpoint,
              "num_requests": len(requests.trace), "length_scale": requests.length_scale,
              "ttft_slo_s": slos[0], "tpot_slo_s": slos[1], "slo_source": slo_source,
              "simulated_knee_rate": knee,
              "load_rule": f"knee = {KNEE_SHARE:g} x the simulated knee, light = "
                           f"{LIGHT_SHARE:g} x it", "goals": dataclasses.asdict(goals),
              "loads": []}
    frames = {}
    scratch = None if out is not None else tempfile.TemporaryDirectory(prefix="hawk-validate-")
    base = Path(out) if out is not None else Path(scratch.name)
    try:
        for load in resolve_loads(items, knee):
            trace = requests.at(load.rate)
            say(f"{load.name}: {load.rate:.3g} req/s, {len(trace)} requests, real mode ...")
            real, sent = as_sent(real_fn(trace, *slos, base / load.name / "real"), trace)
            sim = simulate_fn(sent, *slos)
            judged, pairing = val.judge(real, sim, *slos, goals)
            sides = (("real", real), ("sim", sim))
            judged["prefill_batch_vs_table"] = {
                side: val.prefill_batch_ratios(frame, table.prefill_time) for side, frame in sides}
            judged["decode_step_vs_table"] = {
                side: val.decode_step_ratios(frame, step_time) for side, frame in sides}
            if endpoint is not None:
                judged["views"] = views(real, sim)
            result["loads"].append({"name": load.name, "rate": load.rate, **judged})
            if out is not None:
                (base / load.name / "sim").mkdir(parents=True, exist_ok=True)
                write_records(sim, base / load.name / "sim" / "records.parquet")
                pairing.frame.to_parquet(base / load.name / "paired.parquet", index=False)
            frames[load.name] = (real, sim)
    finally:
        if scratch is not None:
            scratch.cleanup()
    if out is not None:
        (base / "validate.json").write_text(dumps(result, indent=2) + "\n")
    return result, frames
