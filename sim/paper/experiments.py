"""The paper's experiments (section 6 of HAWK, docs/paper.md): Figure 9, Table 1, serving
sweeps and Table 8.

Every number comes from the ``paper`` profile (sim/profiles/paper.toml) and the simulator:

- ``figure9``: isolated transfer latency vs size, each mechanism over GG-Host.
- ``table1``: 4x A100 vs 4x p150a at 512 in / 128 out / batch 32 (roofline predictors).
- ``serving``: rate sweeps per workload and configuration (``sim.runs.sweep``, in parallel), knee at
  90% SLO attainment on the paper's rate grid and bisected past it (``sim.paper.knees``),
  output throughput at the grid knee (over the whole run, ``throughput_at_knee``, and over the
  steady window, ``steady_throughput_at_knee``: no ramp, no drain, what the throughput targets
  take), then power and cost there.
- ``run_paper``: all of it as one JSON-ready dict, next to the paper's figures (``TARGETS``),
  with each claim of the paper's section 6 checked (``sim.paper.checks``).

Configurations set ``cluster.link.mechanism`` to a ``hardware.mechanism_specs.MECHANISMS``
name: the simulator prices every transfer with that mechanism and uses its decode-side memory
pool.
"""

from __future__ import annotations

import math

from hardware import catalog
from sim.models import cost as cost_mod
from sim.models import power as power_mod
from sim.config import RunConfig
from sim.engine.cluster import make_predictor
from sim.paper.checks import TARGETS, checks
from sim.paper.knees import BISECTION_STEPS, grid_index, refine_knee
from sim.models.predictor import load_profile_table
from sim.paper.devices_report import devices_summary
from sim.paper.sensitivity_table import load as sensitivity_table
from traces import metrics
from sim.models.transfer import MECHANISMS, isolated_latency, pricing_for, transfer_params

PROFILE = "paper"
MODEL = "llama-3.1-70b"
WORKLOADS = ("chatbot", "summarization")
#: configuration -> (decode device, mechanism)
CONFIGS = {
    "GG-Host": ("a100-pcie", "GG-Host"),
    "GN-Host": ("p150a", "GN-Host"),
    "GG-Direct": ("a100-pcie", "GG-Direct"),
    "GN-HAWK": ("p150a", "GN-HAWK"),
    "GGH-Direct": ("ggh", "GG-Direct"),
    "GN-Direct": ("p150a", "GN-Direct"),
}
FIG9_MECHANISMS = ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK")
FIG9_SIZES_MB = (10, 20, 40, 80, 160, 320, 640, 1280)


def settings(profile: str = PROFILE) -> dict:
    return load_profile_table(profile)["serving"]


def _decode_device(name: str, profile: str) -> str:
    device = CONFIGS[name][0]
    return settings(profile)["ggh_decode_device"] if device == "ggh" else device


def base_config(name: str, workload: str = "chatbot", profile: str = PROFILE) -> RunConfig:
    """The run configuration of paper configuration ``name`` (mechanism not yet applied)."""
    from traces.workloads import WORKLOADS as SPECS

    s, kv = settings(profile), load_profile_table(profile)["kv"]
    device = _decode_device(name, profile)
    npu = catalog.device(device).kind == "npu"
    spec = SPECS[workload]
    return RunConfig().replace(**{
        "cluster.profile": profile, "cluster.model": MODEL,
        "cluster.prefill.device": "a100-pcie", "cluster.prefill.tp": s["tp"],
        "cluster.prefill.kv_dtype": kv["gpu_kv_dtype"],
        "cluster.prefill.block_size": s["prefill_block_size"],
        "cluster.prefill.weight_format": "bfloat16",
        "cluster.prefill.max_batch_size": s["prefill_max_batch_size"],
        "cluster.prefill.max_batch_tokens": s["prefill_max_batch_tokens"],
        "cluster.policies.prefill_batching": s["prefill_batching"],
        "cluster.decode.device": device, "cluster.decode.tp": s["tp"],
        "cluster.decode.kv_dtype": kv["npu_kv_dtype"] if npu else kv["gpu_kv_dtype"],
        "cluster.decode.block_size": s["npu_block_size"] if npu else s["prefill_block_size"],
        "cluster.decode.weight_format": "tt-mixed" if npu else "bfloat16",
        "cluster.decode.max_batch_size": s["npu_decode_max_batch_size" if npu
                                           else "gpu_decode_max_batch_size"],
        "cluster.decode.max_num_blocks": s["npu_kv_blocks"] if npu else 0,
        "workload.name": workload, "slo.ttft_s": spec.ttft_slo_s, "slo.tpot_s": spec.tpot_slo_s,
    })


def serving_config(name: str, workload: str = "chatbot", profile: str = PROFILE) -> RunConfig:
    """``base_config`` with its mechanism."""
    return base_config(name, workload, profile).replace(
        **{"cluster.link.mechanism": CONFIGS[name][1]})


# -- Figure 9 -----------------------------------------------------------------------------
def figure9(profile: str = PROFILE, sizes_mb=FIG9_SIZES_MB) -> list[dict]:
    """Rows (size_mb, mechanism, latency_s, normalized to GG-Host at that size)."""
    params = transfer_params(profile)
    per_mb = load_profile_table(profile)["kv"]["figure9_mb"]
    bpt = load_profile_table(profile)["kv"]["gpu_bytes_per_token"]
    rows = []
    for size in sizes_mb:
        tokens = max(1, round(size * per_mb / bpt))
        lat = {}
        for mech in FIG9_MECHANISMS + ("GN-Direct", "GN-PerPage"):
            name = "GG-Direct" if MECHANISMS[mech].destination == "gpu" else "GN-HAWK"
            pricing = pricing_for(base_config(name, profile=profile), mech)
            lat[mech] = isolated_latency(pricing.price(tokens), params.wire_gb_s(mech) * 1e9)
        for mech, value in lat.items():
            rows.append({"size_mb": size, "mechanism": mech, "tokens": tokens,
                         "latency_s": value, "normalized": value / lat["GG-Host"]})
    return rows


# -- Table 1 ------------------------------------------------------------------------------
def table1(profile: str = PROFILE, prompt: int = 512, output: int = 128, batch: int = 32) -> dict:
    """A100 over p150a: prefill and decode speed; p150a over A100: decode power and cost eff."""
    table = load_profile_table(profile)
    gpu = base_config("GG-Direct", profile=profile).cluster.decode
    npu = base_config("GN-HAWK", profile=profile).cluster.decode
    cfg = base_config("GG-Direct", profile=profile)
    budget = settings(profile)["prefill_max_batch_tokens"]
    per_batch = max(1, budget // prompt)
    chunks = [min(per_batch, batch - k) for k in range(0, batch, per_batch)]
    out = {}
    for key, inst in (("gpu", gpu), ("npu", npu)):
        pred = make_predictor(cfg, inst)
        out[f"{key}_prefill_s"] = sum(pred.prefill_time([prompt] * n) for n in chunks)
        steps = output - 1
        out[f"{key}_decode_s"] = pred.decode_time(batch, batch * (prompt + 1), steps)
        tps = batch * steps / out[f"{key}_decode_s"]
        out[f"{key}_decode_tokens_per_s"] = tps
        out[f"{key}_decode_tokens_per_j"] = tps / power_mod.decode_power_w(table, inst.device,
                                                                          inst.tp)
        out[f"{key}_decode_tokens_per_s_per_usd"] = tps / (
            inst.tp * cost_mod.device_price(table, inst.device))
    out["prefill_ratio"] = out["npu_prefill_s"] / out["gpu_prefill_s"]
    out["decode_ratio"] = out["npu_decode_s"] / out["gpu_decode_s"]
    out["decode_power_ratio"] = out["npu_decode_tokens_per_j"] / out["gpu_decode_tokens_per_j"]
    out["decode_cost_ratio"] = (out["npu_decode_tokens_per_s_per_usd"]
                                / out["gpu_decode_tokens_per_s_per_usd"])
    return out


# -- serving ------------------------------------------------------------------------------
def sweep_settings(workload: str, quick: bool, profile: str = PROFILE) -> dict:
    s = settings(profile)
    prefix = "quick_" if quick else ""
    return {"rates": s[f"{prefix}{workload}_rates"],
            "seeds": s[f"{prefix}seeds"], "num_requests": s[f"{prefix}num_requests"]}


def serving(workload: str, names=tuple(CONFIGS), quick: bool = False, workers: int | None = None,
            profile: str = PROFILE, say=None) -> dict:
    """Per configuration: the sweep rows, the knee on the paper's grid and bisected
    (``sim.paper.knees``), output throughput at the grid knee (whole run and steady window),
    power and cost there. The sweep's own runs give the values at the knee."""
    from sim.runs.sweep import summarize_sweep

    opts = sweep_settings(workload, quick, profile)
    _on_grid(opts["rates"], f"{'quick_' if quick else ''}{workload}_rates", profile)
    out = {}
    for k, name in enumerate(names):
        if say is not None:
            say(f"{workload}, {name} ({k + 1} of {len(names)}): {len(opts['rates'])} rates x "
                f"{len(opts['seeds'])} seeds of {opts['num_requests']:,} requests")
        config = serving_config(name, workload, profile).replace(
            **{"workload.num_requests": opts["num_requests"]})
        points = _points(config, opts["rates"], opts["seeds"], workers)
        summary = summarize_sweep(points)
        summary["num_failed_out_of_memory"] = sum(
            p.summary["statuses"].get("failed_out_of_memory", 0) for p in points)
        searched: list = []
        knee = refine_knee(_meets(config, opts["seeds"], searched, summary["target"]),
                           summary["rows"], summary["target"],
                           BISECTION_STEPS if name in TARGETS["knees"][workload] else 0)
        summary["knee_swept"] = summary["knee_rate"]    # highest swept rate meeting it
        summary.update(knee_rate=knee["grid"], knee_bisected=knee["bisected"],
                       knee_bracket=knee["bracket"], num_knee_search_runs=len(searched))
        summary["at_knee"] = values_at(points + searched, knee["grid"])
        summary["output_tokens_per_s_at_knee"] = (summary["at_knee"] or {}).get(
            "output_tokens_per_s")
        out[name] = summary
    return out


def _on_grid(rates, field: str, profile: str) -> None:
    from sim.config import ConfigError

    for rate in rates:
        try:
            grid_index(rate)
        except ValueError as exc:
            raise ConfigError(f"profile {profile} [serving] {field}: {exc}") from None


def _points(config: RunConfig, rates, seeds, workers) -> list:
    from sim.runs.sweep import run_parallel

    jobs = [(config, float(r), int(s)) for r in rates for s in seeds]
    return run_parallel(_paper_point, jobs, workers, progress=False, desc="sweep")


def _paper_point(args: tuple[RunConfig, float, int]):
    """One sweep point with its efficiency and steady-window throughput (``at_rate``)."""
    from sim.engine.cluster import simulate
    from sim.runs.sweep import SweepPoint

    config, rate, seed = args
    run = simulate(config.replace(**{"workload.rate": rate, "seed": seed}))
    row = run_efficiency(run.stats, run.summary, config,
                         load_profile_table(config.cluster.profile))
    # output throughput in the steady window (no ramp, no drain: traces.metrics)
    row["steady_output_tokens_per_s"] = (
        metrics.steady_output_tokens_per_s(run.records) if run.records is not None
        else math.nan)
    return SweepPoint(rate, seed, {**run.summary, "at_rate": row})


def _meets(config: RunConfig, seeds, searched: list, target: float):
    """``meets(rate)`` for the knee search: the mean attainment over ``seeds`` meets
    ``target``; its runs are appended to ``searched``. They run in this process: a pool
    started for a run or two costs more than the runs (each worker warms up its caches)."""
    def meets(rate: float) -> bool:
        points = _points(config, [rate], seeds, workers=1)
        searched.extend(points)
        values = [p.summary["slo_attainment"] for p in points
                  if p.summary.get("slo_attainment") is not None]
        return bool(values) and sum(values) / len(values) >= target
    return meets


def values_at(points: list, rate) -> dict | None:
    """Power, cost and throughput at ``rate``, averaged over the seeds run there (None for a
    missing or NaN rate)."""
    if rate is None or math.isnan(rate):
        return None
    rows = [p.summary["at_rate"] for p in points if abs(p.rate - rate) < 1e-9]
    if not rows:
        return None
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def run_efficiency(stats: dict, summary: dict, config: RunConfig, profile: dict) -> dict:
    """Output throughput, power and cost of one finished run under the ``profile`` tables."""
    energy = power_mod.run_energy(stats, summary, config, profile)
    money = cost_mod.run_cost(stats, summary, config, profile)
    return {"output_tokens_per_s": summary["output_tokens_per_s"],
            "average_power_w": energy["average_power_w"],
            "tokens_per_joule": energy["tokens_per_joule"],
            "tokens_per_s_per_dollar": money["tokens_per_s_per_dollar"],
            "usd_per_request": money["usd_per_request"],
            "prefill_utilisation": energy["prefill_utilisation"][0],
            "decode_utilisation": energy["decode_utilisation"][0]}


def efficiency(results: dict) -> dict:
    """Power and cost efficiency of GN-HAWK over GG-Direct and over GGH-Direct at their knees."""
    out = {}
    hawk = (results.get("GN-HAWK") or {}).get("at_knee")
    for base in ("GG-Direct", "GGH-Direct"):
        ref = (results.get(base) or {}).get("at_knee")
        key = "" if base == "GG-Direct" else "_vs_ggh"
        if hawk is None or ref is None:
            out[f"power_ratio{key}"] = out[f"cost_ratio{key}"] = math.nan
            continue
        out[f"power_ratio{key}"] = hawk["tokens_per_joule"] / ref["tokens_per_joule"]
        out[f"cost_ratio{key}"] = hawk["tokens_per_s_per_dollar"] / ref["tokens_per_s_per_dollar"]
    return out


def run_paper(quick: bool = False, workers: int | None = None, profile: str = PROFILE,
              workloads=WORKLOADS, names=tuple(CONFIGS), say=None) -> dict:
    """Every experiment, as the JSON object ``hawk paper --json`` prints. ``say(text)``
    hears each sweep as it starts."""
    out = {"profile": profile, "quick": quick,
           "fig9": figure9(profile), "table1": table1(profile),
           "knees": {}, "knees_bisected": {}, "throughput_at_knee": {}, "steady_throughput_at_knee": {},
           "efficiency": {}, "sweeps": {}}
    for workload in workloads:
        res = serving(workload, names, quick, workers, profile, say)
        out["sweeps"][workload] = res
        out["knees"][workload] = {n: r["knee_rate"] for n, r in res.items()}
        out["knees_bisected"][workload] = {n: r["knee_bisected"] for n, r in res.items()}
        out["throughput_at_knee"][workload] = {n: r["output_tokens_per_s_at_knee"]
                                               for n, r in res.items()}
        out["steady_throughput_at_knee"][workload] = {
            n: (r["at_knee"] or {}).get("steady_output_tokens_per_s") for n, r in res.items()}
        out["efficiency"][workload] = efficiency(res)
    out["targets"] = TARGETS
    out["checks"] = checks(out)
    out["devices"] = devices_summary(profile)
    out["sensitivity"] = sensitivity_table(profile)
    out.update(fit_summary(out, profile))
    return out


def fit_summary(result: dict, profile: str = PROFILE) -> dict:
    """The fit behind the profile (``hawk calibrate``'s record) beside this run.

    ``free_parameters``, ``num_targets``; ``residuals``: each target's miss here, scaled by its
    tolerance; ``loo``: each target's value from a refit that did not see it, its error and
    residual (from the record); ``fit``: one row per target with all of these and the fit's
    own value and noise. Each fitted check gains ``loo_value`` and ``loo_holds``: whether the
    prediction of a fit without that target holds it too (a check holds honestly only then).
    Empty without a record."""
    from sim.paper.checks import Target, load_fit_record, residual, target_values

    record = load_fit_record(profile) if not profile.endswith(".toml") else None
    if record is None:
        return {"free_parameters": None, "num_targets": None, "residuals": {}, "loo": {},
                "fit": []}
    ours = {what: value for _, what, value, _ in target_values(result)}
    residuals, loo, rows = {}, {}, []
    for name, t in record["targets"].items():
        target = Target(name, t["kind"], t["paper"])
        residuals[name] = residual(target, ours.get(name))
        loo[name] = {"value": t.get("loo_value"), "error": t.get("loo_error"),
                     "residual": t.get("loo_residual")}
        rows.append({"target": name, "kind": t["kind"], "paper": t["paper"],
                     "ours": ours.get(name), "residual": residuals[name],
                     "fit_value": t.get("fit_value"), "fit_residual": t.get("residual"),
                     "noise": t.get("noise"), "loo_value": t.get("loo_value"),
                     "loo_error": t.get("loo_error"), "loo_residual": t.get("loo_residual")})
    for check in result.get("checks", []):
        if check.get("fitted"):
            lr = loo.get(check["target"], {}).get("residual")
            check["loo_value"] = loo.get(check["target"], {}).get("value")
            check["loo_holds"] = lr is not None and abs(lr) <= 1.0
    return {"free_parameters": record["free_parameters"], "num_targets": record["num_targets"],
            "parameters": record["parameters"], "residuals": residuals, "loo": loo,
            "fit": rows, "fit_method": record["method"]}
