"""The fit behind ``hawk calibrate`` (``sim.paper.calibrate``): bounded least squares on scaled
residuals, leave-one-out refits, and each target's noise over seeds.

Nothing here knows the profile or the simulator: ``evaluate`` maps a parameter vector (a dict
of values) to every target's value, and each ``sim.paper.checks.Target`` scales its residual
by its tolerance, so a residual of 1 is a target just missed.

- ``fit`` runs ``scipy.optimize.least_squares`` (bounded, trust-region) from the starting point,
  each parameter log-scaled between its bounds to [0, 1] (``_Objective``).
- ``leave_one_out`` predicts each target by a refit that did not see it: the same
  ``least_squares`` on the other targets' residuals, warm-started from the full fit's optimum
  (at most ``LOO_NFEV`` function evaluations, each with its Jacobian), then the model's value
  for the left-out target at that refit. The refits run in parallel over targets.
- ``noise`` evaluates the fitted values on ``NOISE_SEEDS`` and gives each target's standard
  deviation over seeds.
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sim.paper.checks import residual

LOO_NFEV = 5         # each left-out refit: function evaluations from the full fit's optimum
NOISE_SEEDS = (0, 1, 2, 3, 4)   # the fitted profile's serving targets over these seeds


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
