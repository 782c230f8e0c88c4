"""``hawk calibrate --targets paper``: fit the paper profile's free parameters to named targets.

The fit is honest by construction:

- ``PARAMETERS`` names every free parameter, its place in the profile, its starting point and
  its bounds (physically defensible ranges, stated in sim/profiles/paper.toml beside each).
  Every other number of the profile is an assumption or a published figure, never fitted.
- ``paper_targets()`` names every target (docs/paper.md section 6, ``sim.paper_checks.TARGETS``):
  Figure 9, Table 1, and for both workloads the knees, the throughput gap and Table 8. There
  are clearly fewer parameters than targets.
- ``fit`` runs ``scipy.optimize.least_squares`` (bounded, trust-region) from the starting point
  on residuals scaled by each target's tolerance (ratios 15% relative, knees 0.05 req/s, gaps
  2 points), so a residual of 1 is a target just missed.
- ``leave_one_out`` predicts each target by a refit that did not see it: the same
  ``least_squares`` on the other targets' residuals, warm-started from the full fit's optimum
  (at most ``LOO_NFEV`` function evaluations, each with its Jacobian), then the model's value
  for the left-out target at that refit. The refits run in parallel over targets.

The serving targets come from sweeps of ``hawk paper``'s length (``FIT_REQUESTS`` per point)
on one seed, the same arrivals for every parameter vector (common random numbers), with the
knee interpolated between grid rates, so the objective moves smoothly with the parameters.
Its noise is stated, not hidden: ``noise`` evaluates the fitted profile on ``NOISE_SEEDS`` and
records each target's standard deviation over seeds beside its residual. ``hawk paper`` then
reports every target at its full settings beside the fit's record. The fit writes the profile
(values substituted into the template, comments kept) and ``<profile>_fit.toml``
(``sim.fit_record``).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from sim.fit_record import fit_record, report_lines, to_toml
from sim.paper_checks import Target, load_fit_record, paper_targets, residual  # noqa: F401

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
FIT_REQUESTS = {"chatbot": 1500, "summarization": 1500}   # as hawk paper: shorter runs put
                                                           # knees too high (queues build slowly)
FIT_RATES = {"chatbot": [round(0.2 + 0.1 * k, 2) for k in range(19)],         # 0.2..2.0
             "summarization": [round(0.2 + 0.1 * k, 2) for k in range(14)]}    # 0.2..1.5
LOO_NFEV = 5         # each left-out refit: function evaluations from the full fit's optimum
NOISE_SEEDS = (0, 1, 2, 3, 4)   # the fitted profile's serving targets over these seeds


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
    from sim import paper

    text = render(template, with_derived(values))
    path = Path(workdir) / f"fit_{hashlib.sha1(text.encode()).hexdigest()[:16]}.toml"
    if not path.exists():
        path.write_text(text)
    profile = str(path)
    result = {"fig9": paper.figure9(profile, sizes_mb=(10, 1280)), "table1": paper.table1(profile),
              "knees": {}, "throughput_at_knee": {}, "efficiency": {}}
    for workload in ("chatbot", "summarization"):
        serving = _serving(workload, profile, seed) if reduced else paper.serving(
            workload, ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"), profile=profile)
        result["knees"][workload] = {n: r["knee_rate"] for n, r in serving.items()}
        result["throughput_at_knee"][workload] = {
            n: (r["at_knee"] or {}).get("output_tokens_per_s") for n, r in serving.items()}
        result["efficiency"][workload] = paper.efficiency(serving)
    from sim.paper_checks import TARGETS, target_values

    result["targets"] = TARGETS
    return {what: ours for _, what, ours, _ in target_values(result)}


def _serving(workload: str, profile: str, seed: int = 0) -> dict:
    """Reduced sweeps: rates ascend until attainment stays below 90% twice; the knee is
    interpolated where attainment crosses 90% (None: below it at the lowest rate).

    Each configuration's sweep and its run at the knee are kept on disk beside the profile,
    keyed by what its simulation reads (``_simulation_key``): a vector that changes only
    power or prices, or only another device's efficiencies, reuses the timeline; power and
    cost at the knee are always priced under this vector's profile."""
    import pickle

    from sim import paper
    from sim.cluster import simulate
    from sim.predictor import load_profile_table

    table, out = load_profile_table(profile), {}
    for name in ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"):
        config = paper.serving_config(name, workload, profile).replace(
            **{"workload.num_requests": FIT_REQUESTS[workload]})
        memo = Path(profile).parent / f"sweep_{_simulation_key(config, table, seed)}.pkl"
        if memo.exists():
            knee, stats, summary = pickle.loads(memo.read_bytes())
        else:
            att, below = [], 0
            for rate in FIT_RATES[workload]:
                att.append(simulate(config.replace(**{"workload.rate": rate, "seed": seed})
                                    ).summary["slo_attainment"])
                below = below + 1 if att[-1] < 0.9 else 0
                if below == 2:
                    break
            knee = interpolated_knee(FIT_RATES[workload][:len(att)], att)
            stats = summary = None
            if math.isfinite(knee):
                run = simulate(config.replace(**{"workload.rate": knee, "seed": seed}))
                stats, summary = run.stats, run.summary
            partial = memo.with_suffix(f".{os.getpid()}.part")     # whole files only
            partial.write_bytes(pickle.dumps((knee, stats, summary)))
            os.replace(partial, memo)
        at_knee = (paper.run_efficiency(stats, summary, config, table)
                   if summary is not None else None)
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
                "rates": FIT_RATES, "kv": table.get("kv"), "serving": table.get("serving"),
                "transfer": table.get("transfer"),
                "efficiency": {d: eff.get(d) for d in (cl.prefill.device, cl.decode.device)}}
    text = json.dumps(relevant, sort_keys=True, default=str).replace(cl.profile, "<profile>")
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def interpolated_knee(rates, attainment, target: float = 0.9) -> float:
    """Where attainment first crosses ``target``, linear between grid rates; NaN if it is
    below at the lowest rate; the last rate if it never falls below."""
    if not attainment or attainment[0] < target:
        return math.nan
    for k in range(1, len(attainment)):
        if attainment[k] < target:
            a0, a1 = attainment[k - 1], attainment[k]
            return rates[k - 1] + (a0 - target) / (a0 - a1) * (rates[k] - rates[k - 1])
    return rates[len(attainment) - 1]


# -- the fit ------------------------------------------------------------------------------
@dataclass
class Fit:
    values: dict[str, float]
    predicted: dict[str, float]        # every target's value at the fit
    residuals: dict[str, float]        # scaled by tolerance
    loo: dict[str, float]              # each target's value from a refit that did not see it
    loo_residuals: dict[str, float]
    num_evaluations: int               # the full fit's model evaluations
    cost: float
    loo_evaluations: dict[str, int] = field(default_factory=dict)  # each refit's new ones
    loo_moves: dict[str, float] = field(default_factory=dict)  # how far each refit moved


class _Objective:
    """Parameters in [0, 1] (log-scaled between bounds) -> scaled residuals, memoised."""

    def __init__(self, params, targets, evaluate: Callable[[dict], dict], workers: int = 1,
                 cache: dict | None = None):
        self.params, self.targets, self.evaluate = params, targets, evaluate
        self.cache: dict[tuple, dict] = dict(cache or {})
        self.workers = workers

    def values(self, u: np.ndarray) -> dict[str, float]:
        return {p.name: float(math.exp(math.log(p.low) + ui * (math.log(p.high) - math.log(p.low))))
                for p, ui in zip(self.params, np.clip(u, 0.0, 1.0))}

    def unit(self, values: dict[str, float]) -> np.ndarray:
        return np.array([(math.log(values[p.name]) - math.log(p.low))
                         / (math.log(p.high) - math.log(p.low)) for p in self.params])

    def outputs(self, us: list[np.ndarray]) -> list[dict]:
        keys = [tuple(np.round(u, 12)) for u in us]
        todo = {k: self.values(u) for k, u in zip(keys, us) if k not in self.cache}
        if todo:
            results = _map(self.evaluate, list(todo.values()), self.workers)
            self.cache.update(zip(todo, results))
        return [self.cache[k] for k in keys]

    def residuals(self, out: dict, targets=None) -> np.ndarray:
        return np.array([residual(t, out.get(t.name)) for t in (targets or self.targets)])

    def __call__(self, u: np.ndarray) -> np.ndarray:
        return self.residuals(self.outputs([u])[0])

    def jacobian(self, u: np.ndarray, step: float = 0.04) -> np.ndarray:
        """Forward differences, each column one evaluation (in parallel with workers)."""
        base = self(u)
        shifted = []
        for j in range(len(u)):
            v = u.copy()
            v[j] = v[j] + step if v[j] + step <= 1.0 else v[j] - step
            shifted.append(v)
        outs = self.outputs(shifted)
        cols = [(self.residuals(o) - base) / (v[j] - u[j])
                for j, (o, v) in enumerate(zip(outs, shifted))]
        return np.column_stack(cols)


def _map(function, items: list, workers: int) -> list:
    """``function`` over ``items`` in order, in a process pool when ``workers`` > 1."""
    if workers > 1 and len(items) > 1:
        with ProcessPoolExecutor(min(workers, len(items))) as pool:
            return list(pool.map(function, items))
    return [function(item) for item in items]


def _least_squares(obj: _Objective, u0: np.ndarray, max_nfev: int):
    """scipy's bounded trust-region least squares, at most ``max_nfev`` residual evaluations
    (the start counts as one). Once they are spent, scipy still asks for the Jacobian at the
    last accepted point, only for its stopping test: it gets the previous one, which leaves
    the result unchanged and saves a Jacobian's evaluations."""
    from scipy.optimize import least_squares

    state = {"nfev": 0, "jac": None}

    def fun(u):
        state["nfev"] += 1
        return obj(u)

    def jac(u):
        if state["jac"] is None or state["nfev"] < max_nfev:
            state["jac"] = obj.jacobian(u)
        return state["jac"]

    return least_squares(fun, u0, jac=jac, bounds=(0.0, 1.0), method="trf", x_scale=1.0,
                         max_nfev=max_nfev, xtol=1e-3, ftol=1e-3)


def fit(params, targets, evaluate: Callable[[dict], dict], start: dict | None = None,
        max_nfev: int = 12, workers: int = 1, loo: bool = True,
        loo_nfev: int = LOO_NFEV, on_fit: Callable[[dict], None] | None = None) -> Fit:
    """Least squares from ``start`` (default: each parameter's ``start``) within bounds; then,
    with ``loo``, every target's leave-one-out refit (``leave_one_out``). ``on_fit`` is called
    with the fitted values before the refits start."""
    if len(params) >= len(targets):
        raise ValueError(f"{len(params)} free parameters for {len(targets)} targets: a fit "
                         f"needs clearly fewer parameters than targets")
    obj = _Objective(params, targets, evaluate, workers)
    res = _least_squares(obj, obj.unit(start or {p.name: p.start for p in params}), max_nfev)
    best = obj.outputs([res.x])[0]
    r = obj.residuals(best)
    num_evaluations = len(obj.cache)
    if on_fit is not None:
        on_fit(obj.values(res.x))
    loo_values, loo_evals, loo_moves = {}, {}, {}
    if loo:
        obj.jacobian(res.x)          # every refit starts here: its first Jacobian is shared
        loo_values, loo_evals, loo_moves = leave_one_out(obj, res.x, loo_nfev)
    return Fit(values=obj.values(res.x),
               predicted={t.name: best.get(t.name) for t in targets},
               residuals={t.name: float(x) for t, x in zip(targets, r)},
               loo=loo_values,
               loo_residuals={t.name: residual(t, loo_values.get(t.name)) for t in targets
                              if t.name in loo_values},
               num_evaluations=num_evaluations, cost=float(0.5 * r @ r),
               loo_evaluations=loo_evals, loo_moves=loo_moves)


def leave_one_out(obj: _Objective, u: np.ndarray, max_nfev: int = LOO_NFEV
                  ) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """Each target's value from a refit without it: ``least_squares`` on the other targets,
    from the full fit's optimum ``u`` (the full fit's evaluations shared as a cache), at most
    ``max_nfev`` function evaluations; refits in parallel over targets with ``obj.workers``.
    Returns the values, each refit's number of new model evaluations, and how far it moved
    (the largest change of a parameter, as a share of its log-scaled range; 0: no step the
    refit tried lowered the other targets' residuals, so the prediction is the fit's)."""
    jobs = [(obj.params, obj.targets, i, obj.evaluate, u, obj.cache, max_nfev)
            for i in range(len(obj.targets))]
    done = _map(_refit_without, jobs, obj.workers)
    names = [t.name for t in obj.targets]
    return ({n: d[0] for n, d in zip(names, done)}, {n: d[1] for n, d in zip(names, done)},
            {n: d[2] for n, d in zip(names, done)})


def _refit_without(job) -> tuple[float | None, int, float]:
    params, targets, i, evaluate, u, cache, max_nfev = job
    obj = _Objective(params, [t for k, t in enumerate(targets) if k != i], evaluate, 1, cache)
    res = _least_squares(obj, u, max_nfev)
    value = obj.outputs([res.x])[0].get(targets[i].name)
    return value, len(obj.cache) - len(cache), float(np.max(np.abs(res.x - u)))


def noise(values: dict[str, float], evaluate: Callable[..., dict], targets,
          seeds=NOISE_SEEDS, workers: int = 1) -> dict[str, float]:
    """Each target's standard deviation over ``seeds`` at ``values`` (0 for the closed-form
    ones): how far one seed's value, on which the fit runs, may sit from the mean. NaN where
    some seeds give no value (no knee) and others do."""
    import functools

    outs = _map(functools.partial(_seeded, evaluate, values), list(seeds), workers)
    out = {}
    for t in targets:
        xs = [o.get(t.name) for o in outs]
        finite = [x for x in xs if x is not None and math.isfinite(x)]
        out[t.name] = (float(np.std(finite)) if len(finite) == len(xs)
                       else 0.0 if not finite else math.nan)   # never reached on any seed: 0
    return out


def _seeded(evaluate, values, seed):
    return evaluate(values, seed=seed)


# -- the command --------------------------------------------------------------------------
def calibrate(targets: str = "paper", profile: str = "paper", max_nfev: int = 8,
              workers: int = 2, write: bool = True, loo_nfev: int = LOO_NFEV,
              cache_dir: str | None = None) -> dict:
    """Fit ``PARAMETERS`` to the named target set; write the profile as soon as it is fitted,
    and its record once the leave-one-out refits and the noise are in. ``cache_dir``: keep
    the fit's profiles and sweeps there, for a later run to reuse (default: a temporary
    folder)."""
    if targets != "paper":
        raise ValueError(f"--targets {targets!r}: the one target set is 'paper'")
    import functools
    import time

    template = (PROFILE_DIR / f"{profile}.toml").read_text()
    tlist = paper_targets()
    clock = [time.monotonic()]

    def write_profile(values: dict[str, float]) -> None:
        clock.append(time.monotonic())
        if write:
            (PROFILE_DIR / f"{profile}.toml").write_text(render(template, with_derived(values)))

    with tempfile.TemporaryDirectory(prefix="hawk-fit-") as scratch:
        workdir = cache_dir or scratch
        Path(workdir).mkdir(parents=True, exist_ok=True)
        evaluate = functools.partial(model, template=template, workdir=workdir)
        result = fit(PARAMETERS, tlist, evaluate, max_nfev=max_nfev, workers=workers,
                     loo_nfev=loo_nfev, on_fit=write_profile)
        clock.append(time.monotonic())
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


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="fit the profile's free parameters to targets")
    p.add_argument("--targets", default="paper", help="target set (paper)")
    p.add_argument("--max-evaluations", type=int, default=8,
                   help="least-squares function evaluations of the fit (each with a Jacobian)")
    p.add_argument("--loo-evaluations", type=int, default=LOO_NFEV,
                   help="the same for each leave-one-out refit, from the fit's optimum")
    p.add_argument("--workers", type=int, default=2,
                   help="parallel model evaluations (Jacobian columns, refits, seeds)")
    p.add_argument("--dry-run", action="store_true", help="fit and report; write nothing")
    p.add_argument("--cache-dir", help="keep the fit's simulations here, for a later run")
    p.set_defaults(func=_handler)


def _handler(args) -> int:
    from sim.config import ConfigError

    try:
        for flag in ("max_evaluations", "loo_evaluations", "workers"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: "
                                 f"must be at least 1")
        record = calibrate(args.targets, max_nfev=args.max_evaluations, workers=args.workers,
                           write=not args.dry_run, loo_nfev=args.loo_evaluations,
                           cache_dir=args.cache_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    print(report_lines(record))
    wall = record["wall_s"]
    print(f"\nwall time: fit {wall['fit']:.0f} s, leave-one-out refits {wall['loo']:.0f} s, "
          f"noise over seeds {wall['noise']:.0f} s")
    return 0
