"""Per-device efficiencies fitted to that device's published measurements (``fit_device``;
``hawk devices --fit``).

Each device has a plan (``PLANS``): the fields held fixed, each with its reason, and the free
parameters, each with physical bounds and the evidence for them. A parameter may set several
fields at once (one ``memory_efficiency`` for every stream of DRAM). The fit starts every
parameter at the middle of its bounds (geometric for a rate or efficiency, arithmetic for a
time: a neutral start, the same for every refit), minimises
the log ratios model / measured of the device's points with ``scipy.optimize.least_squares``
to convergence, and reports the optimiser's status and evaluations; it also starts from the
quarter points of the bounds and keeps the lowest cost, reporting each start's. Leave-one-out
refits from those same starts without each point in turn and predicts it. A plan must have fewer free
parameters than the device has distinct settings (two figures of one setting count once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hardware import catalog
from sim.models.efficiency import Efficiency
from sim.models.rooflines import roofline
from sim.paper.device_points import DevicePoint, device_points


@dataclass(frozen=True)
class Param:
    """A free parameter: the Efficiency ``fields`` it sets, its bounds and their source. An
    upper bound of None is the shortest measured step of ``phase`` on the device."""

    name: str
    fields: tuple[str, ...]
    lo: float
    hi: float | None
    source: str
    phase: str = ""


_MEMORY = ("prefill_memory_efficiency", "decode_memory_efficiency",
           "decode_attention_efficiency")
_OVERLAP = ("vLLM and tt-metal issue each all-reduce after its row-parallel matmul on the "
            "compute stream: nothing overlaps")
_GPU = (
    Param("prefill_compute_efficiency", ("prefill_compute_efficiency",), 0.3, 0.9,
          "dense BF16 GEMMs at prefill shapes reach 60-85% of peak (cuBLAS); capped at 0.9"),
    Param("prefill_attention_efficiency", ("prefill_attention_efficiency",), 0.05, 0.9,
          "causal attention kernels: from unfused (scores in HBM) to FlashAttention's ~70%"),
    Param("memory_efficiency", _MEMORY, 0.5, 0.95,
          "HBM streaming reaches 80-93% of peak bandwidth in copy benchmarks"),
    Param("decode_compute_efficiency", ("decode_compute_efficiency",), 0.05, 0.9,
          "skinny GEMMs (batch <= 64 rows) run far below peak"),
    Param("prefill_step_overhead_s", ("prefill_step_overhead_s",), 0.0, None,
          "launch, scheduling and sampling: at most the shortest measured prefill",
          "prefill"),
    Param("step_overhead_s", ("step_overhead_s",), 0.0, None,
          "launch, scheduling and sampling: at most the shortest measured decode step",
          "decode"),
    Param("decode_per_seq_s", ("decode_per_seq_s",), 0.0, 1e-3,
          "assumption: host work per sequence per step (sampler, inputs, block tables) under "
          "1 ms"),
    Param("allreduce_hop_latency_s", ("allreduce_hop_latency_s",), 0.0, 30e-6,
          "NCCL ring step latency over NVLink is a few us; 30 us allows a kernel launch"),
    Param("allreduce_bus_gb_s", ("allreduce_bus_gb_s",), 20.0, None,
          "NCCL ring bus bandwidth: at most the NVLink rate (catalog tp_link_gb_s)", "link"),
)
_HOST_BOUND = ("the measured steps are host-bound: at batch 1 the A100's decode step takes "
               "42.4 ms at TP4 and 43.0 at TP8 while each GPU's weight read halves, and "
               "the batch's growth is the same at both; the host launches ahead of the "
               "GPUs (asynchronous CUDA launches), so a step is max(host, device)")
_GPU_FIXED = {"allreduce_latency_s": (0.0, "carried by allreduce_hop_latency_s"),
              "allreduce_overlap": (0.0, _OVERLAP), "host_overlap": (True, _HOST_BOUND)}
_TT = (
    Param("prefill_compute_efficiency", ("prefill_compute_efficiency",), 0.02, 0.9,
          "tt-metal prefill matmuls: from a few % to 90% of the dense BF16 peak"),
    Param("memory_efficiency", _MEMORY, 0.2, 0.95,
          "GDDR6 streaming: 20-95% of the channels' peak"),
    Param("prefill_step_overhead_s", ("prefill_step_overhead_s",), 0.0, None,
          "host op dispatch of an untraced prefill: at most the shortest measured TTFT",
          "prefill"),
    Param("step_overhead_s", ("step_overhead_s",), 0.0, None,
          "traced decode dispatch and sampling: at most the shortest measured decode step",
          "decode"),
)
_TT_FIXED = {
    "decode_compute_efficiency": (0.3, "not identifiable: decode at batch <= 32 is memory- "
                                  "and overhead-bound (the paper profile's assumption)"),
    "allreduce_latency_s": (40e-6, "Ethernet CCL between boards (the paper profile's)"),
    "allreduce_overlap": (0.0, _OVERLAP),
    "host_overlap": (False, "tt-metal decode replays a captured trace and the host's per-step "
                     "work (sampling, reading the token back, the next inputs) waits on the "
                     "device: they add (max(host, device) fits no better: rms log residual "
                     "0.087 vs 0.086 on p150a, leaving two parameters unidentified; 0.082 vs "
                     "0.069 on n300)"),
}
_PER_SEQ_TT = Param("decode_per_seq_s", ("decode_per_seq_s",), 0.0, 1e-3,
                    "assumption: host work per sequence per step under 1 ms")

#: device -> (free parameters, fixed fields {field: (value, reason)})
PLANS: dict[str, tuple[tuple[Param, ...], dict]] = {
    "a100-sxm": (_GPU, _GPU_FIXED),
    "h100-sxm": (_GPU, _GPU_FIXED),
    "p150a": (_TT, {**_TT_FIXED, "allreduce_bus_gb_s": (
        0.0, "the catalog's assumed 50 GB/s: free, it would leave as many parameters as "
        "settings"), "decode_per_seq_s": (0.0, "8B steps at batch 1 and 32 differ by 1%")}),
    "n300": (_TT + (_PER_SEQ_TT,), {**_TT_FIXED, "allreduce_bus_gb_s": (
        0.0, "the catalog's 25 GB/s: free, it would leave as many parameters as settings")}),
}


def bounds(device: str, points: list[DevicePoint]) -> list[tuple[float, float]]:
    """Each free parameter's (lo, hi) on ``device``, open upper bounds resolved."""
    out = []
    for p in PLANS[device][0]:
        hi = p.hi
        if hi is None and p.phase == "link":
            hi = catalog.devices()[device].tp_link_gb_s
        elif hi is None:
            hi = min(q.value_s for q in points if q.phase == p.phase)
        out.append((p.lo, hi))
    return out


def efficiency(device: str, values: dict[str, float]) -> Efficiency:
    """The Efficiency of ``device`` with these free-parameter values and the fixed fields."""
    params, fixed = PLANS[device]
    fields = {k: v for k, (v, _) in fixed.items()}
    for p in params:
        for f in p.fields:
            fields[f] = values[p.name]
    return Efficiency(**fields)


def model_times(points: list[DevicePoint], eff: Efficiency) -> np.ndarray:
    """The roofline's seconds for each point under ``eff`` (one predictor per setup)."""
    preds: dict[tuple, RooflinePredictor] = {}
    out = np.empty(len(points))
    for i, q in enumerate(points):
        setup = (q.device, q.model, q.tp, q.weight_format, q.kv_dtype)
        pred = preds.get(setup)
        if pred is None:
            pred = preds[setup] = roofline(
                catalog.models()[q.model], catalog.devices()[q.device], q.tp, eff,
                q.weight_format, q.kv_dtype)
        if q.phase == "prefill":
            out[i] = pred.prefill_time([q.prompt_tokens] * q.batch)
        else:
            out[i] = pred.decode_step_time(q.batch, int(round(q.batch * q.context)))
    return out


def fit_points(device: str, points: list[DevicePoint]) -> dict:
    """Least squares of log(model / measured) over ``points`` from the neutral start."""
    from scipy.optimize import least_squares

    params = PLANS[device][0]
    box = bounds(device, points)
    lo, hi = np.array([b[0] for b in box]), np.array([b[1] for b in box])
    measured = np.array([q.value_s for q in points])

    def values(u: np.ndarray) -> dict[str, float]:
        return {p.name: _scale(lo[i], hi[i], u[i]) for i, p in enumerate(params)}

    def residuals(u: np.ndarray) -> np.ndarray:
        return np.log(model_times(points, efficiency(device, values(u))) / measured)

    runs = []
    for u0 in STARTS:
        run = least_squares(residuals, np.full(len(params), u0), bounds=(0.0, 1.0),
                            method="trf", ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=5000)
        runs.append((u0, run))
    best = min(r.cost for _, r in runs)
    u0, result = next((u, r) for u, r in runs if r.cost <= best * (1 + 1e-9) + 1e-15)
    start = np.full(len(params), u0)
    fitted = values(result.x)
    at_bound = [p.name for i, p in enumerate(params)
                if result.x[i] < 0.01 or result.x[i] > 0.99]   # within 1% of the range
    # a parameter the points do not move (a zero column of the Jacobian at the optimum) is
    # not identified: it stays where it started and counts in no degree of freedom
    column = np.linalg.norm(result.jac, axis=0)
    unidentified = [p.name for i, p in enumerate(params) if column[i] <= 1e-9 * column.max()]
    return {"values": fitted, "start": values(start), "start_u": u0,
            "starts": [{"u": u, "cost": float(r.cost), "nfev": int(r.nfev),
                        "status": int(r.status)} for u, r in runs],
            "status": int(result.status),
            "message": str(result.message), "nfev": int(result.nfev),
            "njev": int(result.njev or 0), "cost": float(result.cost),
            "converged": bool(result.status > 0), "at_bound": at_bound,
            "unidentified": unidentified,
            "effective_free": len(params) - len(unidentified),
            "bounds": dict(zip([p.name for p in params], box))}


#: where each fit starts, as the position u in [0, 1] between every parameter's bounds: the
#: neutral middle first, then the quarter points (a max(host, device) step is flat in the
#: parameters of whichever side is shorter, so one start can stall); the lowest cost wins
STARTS = (0.5, 0.25, 0.75)


def _scale(lo: float, hi: float, u: float) -> float:
    """The value at ``u`` in [0, 1] between the bounds: geometric for a rate or efficiency
    (lo > 0: a scale, whose neutral middle is sqrt(lo hi)), arithmetic from 0 for a time."""
    return float(lo * (hi / lo) ** u) if lo > 0 else float(lo + u * (hi - lo))


def settings(points: list[DevicePoint]) -> int:
    """Distinct settings among ``points`` (two figures of one setting count once)."""
    return len({q.key.rsplit("/", 1)[0] if q.tag else q.key for q in points})


def fit_device(device: str, loo: bool = True) -> dict:
    """Fit ``device``'s plan to its points that are not excluded; with ``loo``, each point's
    leave-one-out prediction from a refit without it (same neutral start)."""
    if device not in PLANS:
        raise ValueError(f"no fit plan for device {device!r}; choose one of {sorted(PLANS)}")
    points = [q for q in device_points() if q.device == device and q.excluded is None]
    num_settings = settings(points)
    if len(PLANS[device][0]) >= num_settings:
        raise ValueError(f"{device}: {len(PLANS[device][0])} free parameters for "
                         f"{num_settings} settings")
    full = fit_points(device, points)
    model = model_times(points, efficiency(device, full["values"]))
    rows = [{"key": q.key, "measured_s": q.value_s, "model_s": float(m),
             "error": float(m / q.value_s - 1.0)} for q, m in zip(points, model)]
    out = {"device": device, "num_points": len(points), "num_settings": num_settings,
           "num_free": len(PLANS[device][0]), "fit": full, "rows": rows,
           "rms_log_residual": math.sqrt(2.0 * full["cost"] / len(points))}
    out["sensitivity"] = sensitivity(device, points, full)
    if loo:
        for i, row in enumerate(rows):
            rest = points[:i] + points[i + 1:]
            refit = fit_points(device, rest)
            held = model_times([points[i]], efficiency(device, refit["values"]))[0]
            row["loo_model_s"] = float(held)
            row["loo_error"] = float(held / points[i].value_s - 1.0)
            row["loo_nfev"], row["loo_status"] = refit["nfev"], refit["status"]
    return out


def sensitivity(device: str, points: list[DevicePoint], fit: dict) -> dict[str, dict]:
    """Per free parameter: the largest relative move of any prefill and any decode point's
    model time when that parameter alone goes to its lower and to its upper bound (the
    others at the fit). A parameter that moves nothing could be dropped."""
    base = model_times(points, efficiency(device, fit["values"]))
    phases = np.array([q.phase for q in points])
    out = {}
    for name, (lo, hi) in fit["bounds"].items():
        moves = {"prefill": 0.0, "decode": 0.0}
        for value in (lo, hi):
            moved = model_times(points, efficiency(device, {**fit["values"], name: value}))
            change = np.abs(moved / base - 1.0)
            for phase in moves:
                if (phases == phase).any():
                    moves[phase] = max(moves[phase], float(change[phases == phase].max()))
        out[name] = moves
    return out
