"""The paper profile's free parameters fitted to named targets (``hawk calibrate --targets
paper``, whose command is ``sim.commands.calibrate``).

The fit is honest by construction:

- ``PARAMETERS`` names every free parameter, its place in the profile, its starting point and
  its bounds (physically defensible ranges, stated in sim/profiles/paper.toml beside each).
  Every other number of the profile is an assumption or a published figure, never fitted.
- ``paper_targets()`` names every target (docs/paper.md section 6, ``sim.paper.checks.TARGETS``):
  Figure 9, Table 1, and for both workloads the knees, the throughput gap and Table 8. There
  are clearly fewer parameters than targets.
- ``fit`` runs ``scipy.optimize.least_squares`` (bounded, trust-region) from the starting point
  on residuals scaled by each target's tolerance (ratios 15% relative, knees 0.05 req/s, gaps
  2 points), so a residual of 1 is a target just missed.
- ``leave_one_out`` predicts each target by a refit that did not see it, warm-started from the
  full fit's optimum. The fit, the refits and ``noise`` live in ``sim.paper.fit``; this
  module gives them the parameters, the targets and the model, and writes the results.

The serving targets come from sweeps of ``hawk paper``'s length (``FIT_REQUESTS`` per point)
on one seed, the same arrivals for every parameter vector (common random numbers), with the
knee interpolated between grid rates, so the objective moves smoothly with the parameters.
Its noise is stated, not hidden: ``noise`` evaluates the fitted profile on ``NOISE_SEEDS`` and
records each target's standard deviation over seeds beside its residual. ``hawk paper`` then
reports every target at its full settings beside the fit's record. The fit writes the profile
(values substituted into the template, comments kept) and ``<profile>_fit.toml``
(``sim.paper.fit_record``).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sim.paper.fit import LOO_NFEV, NOISE_SEEDS, Fit, fit, leave_one_out, noise  # noqa: F401
from sim.paper.fit_record import fit_record, to_toml
from sim.paper.checks import Target, load_fit_record, paper_targets, residual  # noqa: F401

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
FIT_REQUESTS = {"chatbot": 1500, "summarization": 1500}   # as hawk paper: shorter runs put
                                                           # knees too high (queues build slowly)
FIT_RATES = {"chatbot": [round(0.2 + 0.1 * k, 2) for k in range(19)],         # 0.2..2.0
             "summarization": [round(0.2 + 0.1 * k, 2) for k in range(14)]}    # 0.2..1.5


@dataclass(frozen=True)
class Parameter:
    """One free parameter: ``[table] key`` of the profile, its start and bounds."""

    table: str
    key: str
    start: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.start <= self.high:
            raise ValueError(f"parameter {self.name}: need 0 < low <= start <= high, got "
                             f"{self.low}, {self.start}, {self.high}")

    @property
    def name(self) -> str:
        return f"{self.table}.{self.key}"


#: the paper profile's free parameters (starting points: physical priors, not earlier fits)
PARAMETERS = (
    Parameter("transfer", "request_setup_s", 0.005, 1e-4, 0.05),
    Parameter("transfer", "host_copy_gb_s", 8.0, 0.3, 20.0),
    Parameter("transfer", "host_relayout_fixed_s", 0.05, 1e-3, 0.5),
    Parameter("transfer", "host_relayout_gb_s", 1.2, 0.1, 10.0),
    Parameter("transfer", "rdma_read_gb_s", 10.0, 2.0, 22.5),
    Parameter("efficiency.a100-pcie", "allreduce_bus_gb_s", 10.0, 4.0, 25.0),
    Parameter("efficiency.p150a", "prefill_compute_efficiency", 0.05, 0.01, 0.6),
    Parameter("efficiency.p150a", "decode_memory_efficiency", 0.5, 0.2, 0.9),
    Parameter("efficiency.p150a", "decode_attention_efficiency", 0.5, 0.02, 1.0),
    Parameter("power.p150a", "decode_w", 120.0, 60.0, 300.0),
    Parameter("price", "a100-pcie", 10000.0, 8000.0, 15000.0),
)


#: values the fit sets from fitted ones by a stated rule (not free): the H100 PCIe instance
#: sits in the same server class, its TP ring crossing the same kind of root complex at PCIe
#: Gen5, twice the A100's Gen4 rate
DERIVED = {
    "efficiency.h100-pcie.allreduce_bus_gb_s":
        lambda v: 2.0 * v["efficiency.a100-pcie.allreduce_bus_gb_s"],
}


def with_derived(values: dict[str, float]) -> dict[str, float]:
    return {**values, **{name: rule(values) for name, rule in DERIVED.items()}}


# -- the profile as text: values in, comments kept ----------------------------------------
def render(template: str, values: dict[str, float]) -> str:
    """``template`` with each ``table.key`` of ``values`` set (the line keeps its comment)."""
    out = template
    for name, value in values.items():
        table, key = name.rsplit(".", 1)
        header = re.search(rf"(?m)^\[{re.escape(table)}\]\s*$", out)
        if header is None:
            raise ValueError(f"profile template has no [{table}] table for {name}")
        nxt = re.search(r"(?m)^\[", out[header.end():])
        end = header.end() + nxt.start() if nxt else len(out)
        section = out[header.end():end]
        line = re.compile(rf"(?m)^({re.escape(key)}\s*=\s*)([^#\n]*?)(\s*(#.*)?)$")
        if not line.search(section):
            raise ValueError(f"profile template has no {key} in [{table}]")
        text = f"{value:.6g}"
        if "." not in text and "e" not in text:
            text += ".0"
        section = line.sub(lambda m: _aligned(m, text), section, count=1)
        out = out[:header.end()] + section + out[end:]
    return out


def _aligned(m: re.Match, text: str) -> str:
    comment = m.group(3) or ""
    width = len(m.group(2)) + (len(comment) - len(comment.lstrip()))
    pad = max(1, width - len(text)) if comment.strip() else 0
    return m.group(1) + text + (" " * pad + comment.strip() if comment.strip() else "")


# -- the model: every target for one parameter vector -------------------------------------
def model(values: dict[str, float], template: str, workdir: str, reduced: bool = True,
          seed: int = 0) -> dict:
    """Every target's value under ``template`` with ``values`` set (one profile file per
    vector in ``workdir``, so worker processes and caches never mix two vectors); the
    reduced sweeps run on arrivals of ``seed``."""
    from sim.paper import experiments as paper

    text = render(template, with_derived(values))
    path = Path(workdir) / f"fit_{hashlib.sha1(text.encode()).hexdigest()[:16]}.toml"
    if not path.exists():
        path.write_text(text)
    profile = str(path)
    result = {"fig9": paper.figure9(profile, sizes_mb=(10, 1280)), "table1": paper.table1(profile),
              "knees": {}, "steady_throughput_at_knee": {}, "efficiency": {}}
    for workload in ("chatbot", "summarization"):
        serving = _serving(workload, profile, seed) if reduced else paper.serving(
            workload, ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"), profile=profile)
        result["knees"][workload] = {n: r["knee_rate"] for n, r in serving.items()}
        result["steady_throughput_at_knee"][workload] = {        # the gap targets' measure
            n: (r["at_knee"] or {}).get("steady_output_tokens_per_s") for n, r in serving.items()}
        result["efficiency"][workload] = paper.efficiency(serving)
    from sim.paper.checks import TARGETS, target_values

    result["targets"] = TARGETS
    return {what: ours for _, what, ours, _ in target_values(result)}


def _serving(workload: str, profile: str, seed: int = 0) -> dict:
    """Reduced sweeps: rates ascend until attainment stays below 90% twice; the knee is
    ``traces.metrics.knee`` over the rates swept, interpolated where attainment crosses 90%
    after its highest passing rate (NaN: no rate passes). At the knee: power, cost and the
    steady-window output throughput (the throughput gap targets' measure).

    Each configuration's sweep and its run at the knee are kept on disk beside the profile,
    keyed by what its simulation reads (``_simulation_key``): a vector that changes only
    power or prices, or only another device's efficiencies, reuses the timeline; power and
    cost at the knee are always priced under this vector's profile."""
    import pickle

    from sim.paper import experiments as paper
    from sim.engine.cluster import simulate
    from sim.models.predictor import load_profile_table
    from traces import metrics

    table, out = load_profile_table(profile), {}
    for name in ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"):
        config = paper.serving_config(name, workload, profile).replace(
            **{"workload.num_requests": FIT_REQUESTS[workload]})
        memo = Path(profile).parent / f"sweep_{_simulation_key(config, table, seed)}.pkl"
        if memo.exists():
            knee, stats, summary, steady = pickle.loads(memo.read_bytes())
        else:
            att, below = [], 0
            for rate in FIT_RATES[workload]:
                att.append(simulate(config.replace(**{"workload.rate": rate, "seed": seed})
                                    ).summary["slo_attainment"])
                below = below + 1 if att[-1] < 0.9 else 0
                if below == 2:
                    break
            knee = metrics.knee(FIT_RATES[workload][:len(att)], att, interpolate=True)
            stats = summary = steady = None
            if math.isfinite(knee):
                run = simulate(config.replace(**{"workload.rate": knee, "seed": seed}))
                stats, summary = run.stats, run.summary
                steady = metrics.steady_output_tokens_per_s(run.records)
            partial = memo.with_suffix(f".{os.getpid()}.part")     # whole files only
            partial.write_bytes(pickle.dumps((knee, stats, summary, steady)))
            os.replace(partial, memo)
        at_knee = (dict(paper.run_efficiency(stats, summary, config, table),
                        steady_output_tokens_per_s=steady) if summary is not None else None)
        out[name] = {"knee_rate": knee, "at_knee": at_knee}
    return out


def _simulation_key(config, table: dict, seed: int) -> str:
    """What a fit sweep's timeline depends on: the configuration, the seed, the fit's
    settings and the profile's tables the simulator reads ([kv], [serving], [transfer] and
    the efficiencies of the two instances' devices; not [power], [price] or [cost], which
    only price a finished run)."""
    import json

    cl = config.cluster
    eff = table.get("efficiency", {})
    relevant = {"config": repr(config), "seed": seed, "requests": FIT_REQUESTS,
                "at_knee": "whole run and steady window",
                "rates": FIT_RATES, "kv": table.get("kv"), "serving": table.get("serving"),
                "transfer": table.get("transfer"),
                "efficiency": {d: eff.get(d) for d in (cl.prefill.device, cl.decode.device)}}
    text = json.dumps(relevant, sort_keys=True, default=str).replace(cl.profile, "<profile>")
    return hashlib.sha1(text.encode()).hexdigest()[:20]


# -- the fit, written --------------------------------------------------------------------
def calibrate(targets: str = "paper", profile: str = "paper", max_nfev: int = 8,
              workers: int = 2, write: bool = True, loo_nfev: int = LOO_NFEV,
              cache_dir: str | None = None, say=None) -> dict:
    """Fit ``PARAMETERS`` to the named target set; write the profile as soon as it is fitted,
    and its record once the leave-one-out refits and the noise are in. ``cache_dir``: keep
    the fit's profiles and sweeps there, for a later run to reuse (default: a temporary
    folder). ``say(text)`` hears each phase as it starts."""
    say = say or (lambda text: None)
    if targets != "paper":
        raise ValueError(f"--targets {targets!r}: the one target set is 'paper'")
    import functools
    import time

    template = (PROFILE_DIR / f"{profile}.toml").read_text()
    tlist = paper_targets()
    clock = [time.monotonic()]

    def write_profile(values: dict[str, float]) -> None:
        clock.append(time.monotonic())
        say(f"fitted in {clock[-1] - clock[0]:.0f} s; leave-one-out refits next "
            f"({len(tlist)} targets)")
        if write:
            (PROFILE_DIR / f"{profile}.toml").write_text(render(template, with_derived(values)))

    with tempfile.TemporaryDirectory(prefix="hawk-fit-") as scratch:
        workdir = cache_dir or scratch
        Path(workdir).mkdir(parents=True, exist_ok=True)
        evaluate = functools.partial(model, template=template, workdir=workdir)
        result = fit(PARAMETERS, tlist, evaluate, max_nfev=max_nfev, workers=workers,
                     loo_nfev=loo_nfev, on_fit=write_profile)
        clock.append(time.monotonic())
        say(f"noise over {len(NOISE_SEEDS)} seeds next")
        spread = noise(result.values, evaluate, tlist, workers=workers)
        clock.append(time.monotonic())
    settings = {"max_nfev": max_nfev, "loo_nfev": loo_nfev, "fit_requests": dict(FIT_REQUESTS),
                "noise_seeds": list(NOISE_SEEDS)}
    record = fit_record(result, tlist, PARAMETERS, spread, settings)
    if write:
        (PROFILE_DIR / f"{profile}_fit.toml").write_text(to_toml(record))
    # not in the written record (same fit, same bytes): the command prints them
    record["wall_s"] = {"fit": clock[1] - clock[0], "loo": clock[2] - clock[1],
                        "noise": clock[3] - clock[2]}
    return record

