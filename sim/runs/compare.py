"""Paired comparison of two serving configurations: is the candidate better, by how much, how sure.

``hawk compare --baseline A.toml --candidate B.toml --trace FILE`` (or ``--workload NAME``):

1. The two configurations may differ only where the user says (``--vary``, by default the
   serving policies: ``POLICY_KEYS``). The diff of their resolved settings is printed; any
   other difference is refused unless ``--allow-diff``. Workload and seed come from the command
   line, so both arms see identical inputs. ``--vary deployment`` (``DEPLOYMENT_KEYS``) lets
   the deployment's shape differ: an aggregated baseline against a disaggregated candidate
   (or another aggregated one), its devices, TPs, instance counts, link and routing, with the
   same model, profile and SLOs; two configurations of different ``cluster.kind`` compare so
   without ``--vary`` (``allowed_keys``).
2. Common random numbers: repeat k feeds the *same* trace to both arms (a trace file, or the
   workload's arrivals drawn with seed ``seed + k``); a run is deterministic given its trace.
3. Paired differences (candidate - baseline) of ``METRICS``, overall and per tenant, with
   percentile bootstrap confidence intervals: over the repeats' paired differences when there
   are two or more (requests inside one run are correlated through the queue, so a run is the
   honest unit), else over requests paired by request id (one trace, one run per arm).
4. Limits chosen before the run (``Limits``, a small TOML) give the verdict: keep the candidate
   only if no metric's difference can be worse than its limit (the CI's bad end is within it)
   and the metric to improve improves (the whole CI on the good side); else keep the baseline.

Records of ``hawk real run`` and ``hawk replay`` compare the same way (``compare_records``):
one run per arm, paired by request id, bootstrap over requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.config import ConfigError, RunConfig, provenance

#: the settings a policy comparison may change without --vary
POLICY_KEYS = ("cluster.routing", "cluster.decode_routing", "cluster.policies",
               "cluster.decode.admission")
#: what a deployment comparison may change (``--vary deployment``): the cluster's shape and
#: its pools, and how requests are routed among them
DEPLOYMENT_KEYS = ("cluster.kind", "cluster.aggregated", "cluster.prefill", "cluster.decode",
                   "cluster.link", "cluster.pool_routing", "cluster.aggregated_share",
                   *POLICY_KEYS)
#: named groups of --vary
VARY_GROUPS = {"policies": POLICY_KEYS, "deployment": DEPLOYMENT_KEYS}
#: metric -> +1 where higher is better, -1 where lower is better
METRICS = {"slo_attainment": +1, "output_tokens_per_s": +1, "failure_rate": -1,
           "usd_per_success": -1, "tokens_per_joule": +1, "ttft_p90_s": -1, "tpot_p90_s": -1}
RESAMPLES = 1000


# -- what may differ ----------------------------------------------------------------------

def config_diff(a: RunConfig, b: RunConfig) -> list[tuple[str, object, object]]:
    """(key, baseline value, candidate value) of every resolved cluster and SLO setting that
    differs; workload and seed are the comparison's own and not compared."""
    pa, pb = provenance(a), provenance(b)
    keys = [k for k in dict.fromkeys([*pa, *pb]) if k.startswith(("cluster.", "slo."))]
    return [(k, pa.get(k, {}).get("value"), pb.get(k, {}).get("value")) for k in keys
            if pa.get(k, {}).get("value") != pb.get(k, {}).get("value")]


def hidden_differences(diff, vary=POLICY_KEYS) -> list[str]:
    """Keys of ``diff`` outside the ``vary`` prefixes."""
    return [k for k, _, _ in diff
            if not any(k == v or k.startswith(v + ".") for v in vary)]


def allowed_keys(diff, vary: tuple | None = None) -> tuple:
    """What may differ: ``vary``'s keys with its groups (``VARY_GROUPS``) expanded; without
    ``vary``, the policies, or the deployment's keys where ``cluster.kind`` differs."""
    if vary is None:
        kinds_differ = any(k == "cluster.kind" for k, _, _ in diff)
        return DEPLOYMENT_KEYS if kinds_differ else POLICY_KEYS
    return tuple(dict.fromkeys(k for v in vary for k in VARY_GROUPS.get(v, (v,))))


def shared_differences(diff) -> list:
    """``diff`` less the keys of a pool only one side has (a deployment comparison shows the
    pools whole)."""
    own = ("cluster.kind", "cluster.aggregated.", "cluster.prefill.", "cluster.decode.",
           "cluster.link.", "cluster.decode_routing", "cluster.pool_routing",
           "cluster.aggregated_share")
    return [(k, a, b) for k, a, b in diff if not (k.startswith(own) and None in (a, b))]


def check_diff(diff, vary=POLICY_KEYS, allow: bool = False) -> None:
    hidden = hidden_differences(diff, vary)
    if not diff:
        raise ConfigError("the baseline and the candidate resolve to the same settings: "
                          "nothing to compare")
    if hidden and not allow:
        raise ConfigError(f"the configurations also differ in {hidden}, outside what may vary "
                          f"({list(vary)}); name them with --vary (a key, a prefix, or "
                          f"{' / '.join(VARY_GROUPS)}) or pass --allow-diff")


# -- limits and verdict ---------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """Chosen before the run. ``improve``: the metric the candidate must improve (a ``METRICS``
    name, optionally ``[tenants]`` to measure it over ``tenants`` only); ``limits``: metric ->
    the worst change (candidate - baseline) allowed, signed as the metric is (``ttft_p90_s =
    0.25``: may rise by 0.25 s; ``slo_attainment = -0.01``: may fall one point)."""

    improve: str = "slo_attainment"
    tenants: tuple[str, ...] = ()
    limits: dict = field(default_factory=dict)
    confidence: float = 0.95

    def __post_init__(self) -> None:
        base = self.improve.split("[")[0]
        if base not in METRICS:
            raise ConfigError(f"limits.improve {self.improve!r} must be one of {list(METRICS)}")
        for key, value in self.limits.items():
            if key.split("[")[0] not in METRICS:
                raise ConfigError(f"limits.limits.{key} is not one of {list(METRICS)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"limits.limits.{key} must be a number, got {value!r}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"limits.confidence must be in [0.5, 1), got {self.confidence}")
        object.__setattr__(self, "tenants", tuple(self.tenants))

    @property
    def improve_key(self) -> str:
        return f"{self.improve}[{','.join(self.tenants)}]" if self.tenants else self.improve


#: a deployment comparison's default limits: the candidate must be cheaper per successful
#: request, at no more than one point of attainment lost
DEPLOYMENT_LIMITS = Limits(improve="usd_per_success", limits={"slo_attainment": -0.01})


def load_limits(path) -> Limits:
    """``improve = "slo_attainment"``, ``tenants = [...]``, ``confidence = 0.95`` and a
    ``[limits]`` table of metric = worst allowed change."""
    from sim.config import tomllib

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    unknown = set(data) - {"improve", "tenants", "limits", "confidence"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: confidence, "
                          f"improve, limits, tenants")
    try:
        return Limits(**data)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def verdict(effects: dict, limits: Limits) -> dict:
    """Keep the candidate only if every limit holds at the CI's bad end and ``improve`` gets
    better over its whole CI; the reasons say which did not."""
    reasons = []
    for key, worst in limits.limits.items():
        e = effects.get(key)
        if e is None:
            reasons.append(f"{key}: not measured")
            continue
        bad_end = e["ci_low"] if METRICS[key.split("[")[0]] > 0 else e["ci_high"]
        if (bad_end < worst) if METRICS[key.split("[")[0]] > 0 else (bad_end > worst):
            reasons.append(f"{key}: change could be {bad_end:+.4g}, beyond the limit {worst:+g}")
    key = limits.improve_key
    e = effects.get(key)
    sign = METRICS[limits.improve]
    if e is None:
        reasons.append(f"{key}: not measured")
    elif not (e["ci_low"] > 0 if sign > 0 else e["ci_high"] < 0):
        reasons.append(f"{key}: no improvement at {100 * limits.confidence:g}% confidence "
                       f"(CI {e['ci_low']:+.4g} to {e['ci_high']:+.4g})")
    return {"keep": "candidate" if not reasons else "baseline", "reasons": reasons}


# -- paired metrics -------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    """One run's records as aligned per-request arrays (sorted by request id)."""

    request_id: np.ndarray
    met: np.ndarray        # ok and within both SLOs
    ok: np.ndarray
    failed: np.ndarray     # ended in a failure (not ok, not unfinished)
    tokens: np.ndarray     # tokens delivered
    ttft: np.ndarray       # NaN unless ok
    tpot: np.ndarray
    tenant: np.ndarray     # str (object); "" without tenants
    span_s: float          # first arrival to last ok finish
    cost_usd: float        # the run's whole cost (NaN when unknown)
    energy_j: float = math.nan   # the run's devices' energy (NaN when unknown)

    @classmethod
    def of(cls, frame, ttft_slo_s: float, tpot_slo_s: float,
           usd_per_request: float | None = None, energy_j: float | None = None) -> "Arm":
        from traces import metrics

        frame = frame.sort_values("request_id").reset_index(drop=True)
        ok = metrics.ok_mask(frame)
        status = frame["status"].to_numpy()
        span = (float(np.nanmax(frame["finished_at"].to_numpy()[ok]) - frame["arrival_at"].min())
                if ok.any() else math.nan)
        cost = (usd_per_request * ok.sum() if usd_per_request is not None
                and math.isfinite(usd_per_request) else math.nan)
        tenant = (frame["tenant"].astype(str).to_numpy(dtype=object) if "tenant" in frame.columns
                  else np.full(len(frame), "", dtype=object))
        return cls(frame["request_id"].to_numpy(), metrics.slo_met(frame, ttft_slo_s, tpot_slo_s),
                   ok, ~ok & (status != "unfinished"),
                   frame["num_generated_tokens"].to_numpy(dtype=float),
                   np.where(ok, metrics.ttft(frame), np.nan), np.where(ok, metrics.tpot(frame), np.nan),
                   tenant, span, float(cost),
                   float(energy_j) if energy_j is not None else math.nan)


def arm_metrics(arm: Arm, idx: np.ndarray, groups: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``METRICS`` of ``arm`` over each row of request positions ``idx`` ([B, n]), and
    attainment over each tenant group (name -> bool mask over requests)."""
    n = len(arm.request_id)
    ok_share = arm.ok[idx].mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {"slo_attainment": arm.met[idx].mean(axis=1),
               "output_tokens_per_s": (arm.tokens * arm.ok)[idx].sum(axis=1) / arm.span_s,
               "failure_rate": arm.failed[idx].mean(axis=1),
               "usd_per_success": arm.cost_usd / (n * ok_share),
               "tokens_per_joule": (arm.tokens * arm.ok)[idx].sum(axis=1) / arm.energy_j,
               "ttft_p90_s": _p90(arm.ttft[idx]), "tpot_p90_s": _p90(arm.tpot[idx])}
        for name, mask in groups.items():
            inside = mask[idx]
            out[f"slo_attainment[{name}]"] = (arm.met[idx] & inside).sum(axis=1) / inside.sum(axis=1)
            out[f"ttft_p90_s[{name}]"] = _p90(np.where(inside, arm.ttft[idx], np.nan))
    return out


def _p90(values: np.ndarray) -> np.ndarray:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # an all-NaN row is NaN
        return np.nanpercentile(values, 90, axis=1)


def tenant_groups(arm: Arm, limits: Limits) -> dict[str, np.ndarray]:
    names = sorted(set(arm.tenant.tolist()) - {""})
    groups = {t: arm.tenant == t for t in names} if len(names) > 1 else {}
    if limits.tenants:
        unknown = sorted(set(limits.tenants) - set(names))
        if unknown:
            raise ConfigError(f"limits.tenants {unknown} are not tenants of the trace "
                              f"(it has {names})")
        groups[",".join(limits.tenants)] = np.isin(arm.tenant, list(limits.tenants))
    return groups


def paired_effects(pairs: list[tuple[Arm, Arm]], limits: Limits, seed: int = 0) -> dict:
    """Per metric: baseline and candidate means, the mean paired difference and its bootstrap
    CI (``limits.confidence``), over repeats (two or more pairs) or over requests (one)."""
    rng = np.random.default_rng(seed)
    groups = tenant_groups(pairs[0][0], limits)
    alpha = (1 - limits.confidence) / 2
    if len(pairs) == 1:
        base, cand = pairs[0]
        if not np.array_equal(base.request_id, cand.request_id):
            raise ConfigError("the two runs do not hold the same request ids: they cannot be "
                              "paired (were they run on the same trace?)")
        n = len(base.request_id)
        everyone = np.arange(n)[None, :]
        idx = rng.integers(0, n, size=(RESAMPLES, n))
        b0, c0 = arm_metrics(base, everyone, groups), arm_metrics(cand, everyone, groups)
        b, c = arm_metrics(base, idx, groups), arm_metrics(cand, idx, groups)
        unit = f"requests ({n}, paired by request id)"
        draws = {k: c[k] - b[k] for k in b}
        point = {k: (float(b0[k][0]), float(c0[k][0])) for k in b0}
    else:
        per = []
        for b, c in pairs:                  # each repeat has its own arrivals and tenants
            mine, everyone = tenant_groups(b, limits), np.arange(len(b.request_id))[None, :]
            per.append((arm_metrics(b, everyone, mine), arm_metrics(c, everyone, mine)))
        keys = per[0][0].keys()
        diffs = {k: np.array([float(c[k][0] - b[k][0]) for b, c in per]) for k in keys}
        pick = rng.integers(0, len(pairs), size=(RESAMPLES, len(pairs)))
        draws = {k: d[pick].mean(axis=1) for k, d in diffs.items()}
        point = {k: (float(np.mean([b[k][0] for b, _ in per])),
                     float(np.mean([c[k][0] for _, c in per]))) for k in keys}
        unit = f"repeats ({len(pairs)} paired runs)"
    effects = {}
    for k, d in draws.items():
        d = d[np.isfinite(d)]
        lo, hi = (np.quantile(d, [alpha, 1 - alpha]) if len(d) else (math.nan, math.nan))
        bv, cv = point[k]
        effects[k] = {"baseline": bv, "candidate": cv, "difference": cv - bv,
                      "ci_low": float(lo), "ci_high": float(hi)}
    return {"unit": unit, "effects": effects}


def regressions(base_frame, cand_frame, top: int = 20):
    """The requests that got most worse, paired by request id: a request that was ok and now
    failed first, then the largest rise in end-to-end latency."""
    import pandas as pd

    cols = ["request_id", "status", "arrival_at", "first_token_at", "finished_at"]
    extra = ["tenant"] if "tenant" in base_frame.columns else []
    pair = pd.merge(base_frame[cols + extra], cand_frame[cols], on="request_id",
                    suffixes=("_baseline", "_candidate"))
    lost = (pair["status_baseline"] == "ok") & (pair["status_candidate"] != "ok")
    e2e_b = pair["finished_at_baseline"] - pair["arrival_at_baseline"]
    e2e_c = pair["finished_at_candidate"] - pair["arrival_at_candidate"]
    pair["e2e_change_s"] = e2e_c - e2e_b
    pair["ttft_change_s"] = ((pair["first_token_at_candidate"] - pair["arrival_at_candidate"])
                             - (pair["first_token_at_baseline"] - pair["arrival_at_baseline"]))
    pair["lost"] = lost
    pair = pair[lost | (pair["e2e_change_s"] > 0)]        # got worse at all
    order = pair.sort_values(["lost", "e2e_change_s", "request_id"],
                             ascending=[False, False, True])
    return order.head(top)[["request_id", *extra, "status_baseline", "status_candidate",
                            "ttft_change_s", "e2e_change_s"]].reset_index(drop=True)


# -- running both arms --------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    """What both arms are fed: a trace file's trace, a paper workload, or the bursty
    multi-customer example (``traces.synthetic.bursty_customers``), redrawn per repeat."""

    trace: object = None             # a Trace, or None
    workload: str | None = None      # a traces.workloads name or "bursty"
    rate: float = 0.5
    num_requests: int | None = None
    duration_s: float | None = None

    def make(self, config: RunConfig, seed: int):
        from sim.engine.cluster import workload_trace
        from traces.synthetic import bursty_customers

        if self.trace is not None:
            return self.trace
        if self.workload == "bursty":
            trace = bursty_customers(rate=self.rate, duration_s=self.duration_s or 1200.0,
                                     seed=seed)
            return trace.head(self.num_requests) if self.num_requests else trace
        changes = {"workload.name": self.workload, "workload.rate": self.rate, "seed": seed,
                   "workload.trace": None}
        if self.num_requests is not None or self.duration_s is not None:
            changes.update({"workload.num_requests": self.num_requests,
                            "workload.duration_s": self.duration_s})
        return workload_trace(config.replace(**changes))


def _run_arm(job):
    """One (arm, repeat): the records and the summary (module level, for process pools)."""
    from sim.engine.cluster import simulate

    config, inputs, seed = job
    result = simulate(config.replace(seed=seed), inputs.make(config, seed))
    summary = {k: v for k, v in result.summary.items() if k != "config"}
    return result.records, summary


def run_pairs(baseline: RunConfig, candidate: RunConfig, inputs: Inputs, repeats: int = 1,
              seed: int = 0, workers: int | None = None, progress: bool = True,
              ray_address: str | None = None) -> list[tuple[tuple, tuple]]:
    """[(baseline (records, summary), candidate (records, summary))] per repeat; repeat k
    feeds both arms the trace drawn with seed ``seed + k`` (a trace file: the same trace,
    so more than one repeat of it adds nothing and is refused)."""
    from sim.runs.sweep import run_parallel

    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if inputs.trace is not None and repeats > 1:
        raise ConfigError("a trace file replays the same arrivals every time, so repeats "
                          "would be identical; its confidence intervals come from a bootstrap "
                          "over requests (use --repeats 1)")
    jobs = [(cfg, inputs, seed + k) for k in range(repeats) for cfg in (baseline, candidate)]
    out = run_parallel(_run_arm, jobs, workers, progress, ray_address, desc="compare")
    return [(out[2 * k], out[2 * k + 1]) for k in range(repeats)]


def compare(runs, ttft_slo_s: float, tpot_slo_s: float, limits: Limits, seed: int = 0) -> dict:
    """Effects, verdict and most-regressed requests of paired runs [((records, summary),
    (records, summary))]."""
    pairs = [tuple(Arm.of(arm[0], ttft_slo_s, tpot_slo_s, arm[1].get("usd_per_request"),
                          arm[1].get("energy_j")) for arm in (b, c)) for b, c in runs]
    result = paired_effects(pairs, limits, seed)
    result["verdict"] = verdict(result["effects"], limits)
    result["limits"] = {"improve": limits.improve_key, "limits": limits.limits,
                        "confidence": limits.confidence}
    result["slo"] = {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s}
    result["regressed"] = regressions(runs[0][0][0], runs[0][1][0]).to_dict("records")
    return result


def write_outputs(out: Path, runs, result: dict) -> None:
    """Both arms' records per repeat, their summaries (costs, failures, timings), the
    comparison and the most-regressed requests."""
    import pandas as pd

    from traces.jsonout import dumps
    from traces.schema import write_records

    for arm, index in (("baseline", 0), ("candidate", 1)):
        (out / arm).mkdir(parents=True, exist_ok=True)
        for k, pair in enumerate(runs):
            records, summary = pair[index]
            write_records(records, out / arm / f"records-{k}.parquet")
            (out / arm / f"summary-{k}.json").write_text(dumps(summary, indent=2) + "\n")
    (out / "comparison.json").write_text(dumps(result, indent=2) + "\n")
    pd.DataFrame(result["regressed"]).to_csv(out / "regressed.csv", index=False)


def load_recorded(path) -> tuple:
    """(records, summary) of a ``hawk real run`` / ``hawk replay`` / ``hawk simulate --out``
    directory or records file; the summary is ``summary.json`` beside the records (or {})."""
    from traces.compare import load_run

    run = load_run(path)
    if run.frame is None:
        raise ConfigError(f"{path}: a trace has no outcomes to compare; give a run's records")
    return run.frame, dict(run.summary_file or {})
