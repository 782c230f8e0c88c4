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
- ``leave_one_out`` predicts each target by a fit that did not see it: from the full fit's
  optimum, without that target's residual, Gauss-Newton steps on the full fit's Jacobian
  (``LOO_STEPS`` steps, each one true evaluation), then the model's value for the left-out
  target at that refit. Cheaper than refitting from the start, and stated as such.

The serving targets come from sweeps of ``hawk paper``'s length (``FIT_REQUESTS`` per point)
with one seed and a coarser grid, the knee interpolated between grid rates, so the objective moves with the parameters; ``hawk paper``
then reports every target at its full settings beside the fit's record. The fit writes the
profile (values substituted into the template, comments kept) and ``<profile>_fit.toml``.
"""

from __future__ import annotations

import hashlib
import math
import re
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sim.paper_checks import Target, load_fit_record, paper_targets, residual  # noqa: F401

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
FIT_REQUESTS = {"chatbot": 1500, "summarization": 1500}   # as hawk paper: shorter runs put
                                                           # knees too high (queues build slowly)
FIT_RATES = {"chatbot": [round(0.2 + 0.1 * k, 2) for k in range(19)],         # 0.2..2.0
             "summarization": [round(0.2 + 0.1 * k, 2) for k in range(14)]}    # 0.2..1.5
LOO_STEPS = 1


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
def model(values: dict[str, float], template: str, workdir: str, reduced: bool = True) -> dict:
    """Every target's value under ``template`` with ``values`` set (one profile file per
    vector in ``workdir``, so worker processes and caches never mix two vectors)."""
    from sim import paper

    text = render(template, with_derived(values))
    path = Path(workdir) / f"fit_{hashlib.sha1(text.encode()).hexdigest()[:16]}.toml"
    if not path.exists():
        path.write_text(text)
    profile = str(path)
    result = {"fig9": paper.figure9(profile, sizes_mb=(10, 1280)), "table1": paper.table1(profile),
              "knees": {}, "throughput_at_knee": {}, "efficiency": {}}
    for workload in ("chatbot", "summarization"):
        serving = _serving(workload, profile) if reduced else paper.serving(
            workload, ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"), profile=profile)
        result["knees"][workload] = {n: r["knee_rate"] for n, r in serving.items()}
        result["throughput_at_knee"][workload] = {
            n: (r["at_knee"] or {}).get("output_tokens_per_s") for n, r in serving.items()}
        result["efficiency"][workload] = paper.efficiency(serving)
    from sim.paper_checks import TARGETS, target_values

    result["targets"] = TARGETS
    return {what: ours for _, what, ours, _ in target_values(result)}


def _serving(workload: str, profile: str) -> dict:
    """Reduced sweeps: rates ascend until attainment stays below 90% twice; the knee is
    interpolated where attainment crosses 90% (None: below it at the lowest rate)."""
    from sim import paper
    from sim.cluster import simulate

    out = {}
    for name in ("GG-Host", "GN-Host", "GG-Direct", "GN-HAWK"):
        config = paper.serving_config(name, workload, profile).replace(
            **{"workload.num_requests": FIT_REQUESTS[workload]})
        att, below = [], 0
        for rate in FIT_RATES[workload]:
            att.append(simulate(config.replace(**{"workload.rate": rate, "seed": 0})
                                ).summary["slo_attainment"])
            below = below + 1 if att[-1] < 0.9 else 0
            if below == 2:
                break
        knee = interpolated_knee(FIT_RATES[workload][:len(att)], att)
        out[name] = {"knee_rate": knee, "at_knee": paper.at_rate(config, knee, [0])}
    return out


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
    loo: dict[str, float]              # each target's value from a fit that did not see it
    loo_residuals: dict[str, float]
    num_evaluations: int
    cost: float


class _Objective:
    """Parameters in [0, 1] (log-scaled between bounds) -> scaled residuals, memoised."""

    def __init__(self, params, targets, evaluate: Callable[[dict], dict], workers: int = 1):
        self.params, self.targets, self.evaluate = params, targets, evaluate
        self.cache: dict[tuple, dict] = {}
        self.workers = workers

    def values(self, u: np.ndarray) -> dict[str, float]:
        return {p.name: float(math.exp(math.log(p.low) + ui * (math.log(p.high) - math.log(p.low))))
                for p, ui in zip(self.params, np.clip(u, 0.0, 1.0))}

    def unit(self, values: dict[str, float]) -> np.ndarray:
        return np.array([(math.log(values[p.name]) - math.log(p.low))
                         / (math.log(p.high) - math.log(p.low)) for p in self.params])

    def outputs(self, us: list[np.ndarray]) -> list[dict]:
        keys = [tuple(np.round(u, 12)) for u in us]
        todo = [(k, self.values(u)) for k, u in zip(keys, us) if k not in self.cache]
        if todo:
            vectors = [v for _, v in todo]
            if self.workers > 1 and len(vectors) > 1:
                with ProcessPoolExecutor(self.workers) as pool:
                    results = list(pool.map(self.evaluate, vectors))
            else:
                results = [self.evaluate(v) for v in vectors]
            for (k, _), r in zip(todo, results):
                self.cache[k] = r
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


def fit(params, targets, evaluate: Callable[[dict], dict], start: dict | None = None,
        max_nfev: int = 12, workers: int = 1, loo: bool = True) -> Fit:
    """Least squares from ``start`` (default: each parameter's ``start``) within bounds."""
    from scipy.optimize import least_squares

    if len(params) >= len(targets):
        raise ValueError(f"{len(params)} free parameters for {len(targets)} targets: a fit "
                         f"needs clearly fewer parameters than targets")
    obj = _Objective(params, targets, evaluate, workers)
    u0 = obj.unit(start or {p.name: p.start for p in params})
    res = least_squares(obj, u0, jac=lambda u: obj.jacobian(u), bounds=(0.0, 1.0),
                        method="trf", x_scale=1.0, max_nfev=max_nfev, xtol=1e-3, ftol=1e-3)
    best = obj.outputs([res.x])[0]
    r = obj.residuals(best)
    loo_values = leave_one_out(obj, res.x, obj.jacobian(res.x)) if loo else {}
    return Fit(values=obj.values(res.x),
               predicted={t.name: best.get(t.name) for t in targets},
               residuals={t.name: float(x) for t, x in zip(targets, r)},
               loo=loo_values,
               loo_residuals={t.name: residual(t, loo_values.get(t.name)) for t in targets
                              if t.name in loo_values},
               num_evaluations=len(obj.cache), cost=float(0.5 * r @ r))


def leave_one_out(obj: _Objective, u: np.ndarray, jac: np.ndarray) -> dict[str, float]:
    """Each target's value from a refit without it: ``LOO_STEPS`` damped Gauss-Newton steps
    from ``u`` on the other targets' residuals with the full fit's Jacobian, within bounds."""
    n = len(obj.targets)
    xs = [u.copy() for _ in range(n)]
    for _ in range(LOO_STEPS):                     # one step for every target at once
        outs = obj.outputs(xs)
        for i, (x, o) in enumerate(zip(xs, outs)):
            keep = [k for k in range(n) if k != i]
            r, j = obj.residuals(o)[keep], jac[keep]
            step = np.linalg.solve(j.T @ j + 1e-3 * np.eye(len(x)), -j.T @ r)
            xs[i] = np.clip(x + step, 0.0, 1.0)
    outs = obj.outputs(xs)
    return {t.name: o.get(t.name) for t, o in zip(obj.targets, outs)}


# -- the command --------------------------------------------------------------------------
def calibrate(targets: str = "paper", profile: str = "paper", max_nfev: int = 8,
              workers: int = 2, write: bool = True) -> dict:
    """Fit ``PARAMETERS`` to the named target set; write the profile and its fit record."""
    if targets != "paper":
        raise ValueError(f"--targets {targets!r}: the one target set is 'paper'")
    import functools

    template = (PROFILE_DIR / f"{profile}.toml").read_text()
    tlist = paper_targets()
    with tempfile.TemporaryDirectory(prefix="hawk-fit-") as workdir:
        evaluate = functools.partial(model, template=template, workdir=workdir)
        result = fit(PARAMETERS, tlist, evaluate, max_nfev=max_nfev, workers=workers)
    record = fit_record(result, tlist)
    if write:
        (PROFILE_DIR / f"{profile}.toml").write_text(render(template,
                                                            with_derived(result.values)))
        (PROFILE_DIR / f"{profile}_fit.toml").write_text(to_toml(record))
    return record


def fit_record(result: Fit, targets) -> dict:
    return {
        "method": "scipy.optimize.least_squares (trf, bounded), forward-difference Jacobian; "
                  "leave-one-out: damped Gauss-Newton refit without the target from the fit, "
                  f"{LOO_STEPS} steps on the fit's Jacobian",
        "free_parameters": len(PARAMETERS), "num_targets": len(targets),
        "fit_requests": dict(FIT_REQUESTS), "num_evaluations": result.num_evaluations,
        "parameters": {p.name: {"start": p.start, "low": p.low, "high": p.high,
                                "fitted": result.values[p.name]} for p in PARAMETERS},
        "targets": {t.name: {"kind": t.kind, "paper": t.paper,
                             "fit_value": result.predicted.get(t.name),
                             "residual": result.residuals[t.name],
                             "loo_value": result.loo.get(t.name),
                             "loo_residual": result.loo_residuals.get(t.name)}
                    for t in targets},
    }


def to_toml(record: dict) -> str:
    """A small TOML writer for the fit record (scalars, strings, nested tables)."""
    lines = ["# Written by `hawk calibrate --targets paper` (sim/calibrate.py); do not edit.",
             "# NaN: the paper's 'never reaches 90%'; a missing value: no knee in the model."]

    def scalar(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if v is None:
            return None
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.6g}"
        return str(v)

    def emit(prefix: str, table: dict) -> None:
        simple = {k: v for k, v in table.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix:
            lines.append(f"\n[{prefix}]")
        for k, v in simple.items():
            s = scalar(v)
            if s is not None:
                lines.append(f"{_key(k)} = {s}")
        for k, v in nested.items():
            emit(f"{prefix}.{_key(k)}" if prefix else _key(k), v)

    emit("", record)
    return "\n".join(lines) + "\n"


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else '"' + k + '"'


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="fit the profile's free parameters to targets")
    p.add_argument("--targets", default="paper", help="target set (paper)")
    p.add_argument("--max-evaluations", type=int, default=8,
                   help="least-squares iterations (each one Jacobian)")
    p.add_argument("--workers", type=int, default=2, help="parallel model evaluations")
    p.add_argument("--dry-run", action="store_true", help="fit and report; write nothing")
    p.set_defaults(func=_handler)


def _handler(args) -> int:
    from sim.config import ConfigError

    try:
        record = calibrate(args.targets, max_nfev=args.max_evaluations, workers=args.workers,
                           write=not args.dry_run)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    print(report_lines(record))
    return 0


def report_lines(record: dict) -> str:
    rows = [f"{record['free_parameters']} free parameters, {record['num_targets']} targets "
            f"({record['num_evaluations']} model evaluations)", "",
            f"{'parameter':45s} {'start':>10s} {'fitted':>10s}  bounds"]
    for name, p in record["parameters"].items():
        rows.append(f"{name:45s} {p['start']:10.4g} {p['fitted']:10.4g}  "
                    f"[{p['low']:.4g}, {p['high']:.4g}]")
    rows += ["", f"{'target':55s} {'paper':>8s} {'fit':>8s} {'resid':>6s} {'LOO':>8s} "
             f"{'LOO res':>7s}"]
    fmt = lambda x: "never" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"
    for name, t in record["targets"].items():
        lr = t.get("loo_residual")
        rows.append(f"{name:55s} {fmt(t['paper']):>8s} {fmt(t.get('fit_value')):>8s} "
                    f"{t['residual']:+6.2f} {fmt(t.get('loo_value')):>8s} "
                    f"{'' if lr is None else f'{lr:+7.2f}'}")
    return "\n".join(rows)
