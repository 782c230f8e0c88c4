"""The roofline and the transfer model fitted to a measured profile directory (``hawk real
profile``), so a user can time devices they only have catalog entries for with the factors
their own machine showed. The command is ``hawk calibrate --profile DIR``
(``sim.commands.calibrate``).

What is fitted, from where, to what:

- The roofline (``sim.models.predictor.RooflinePredictor``, one device, tp 1, so no all-reduce) of the
  profile's model on a ``DeviceSpec`` of the measuring machine. Its peak FLOP rate and memory
  bandwidth are [machine] ``peak_tflops`` / ``memory_bandwidth_gb_s`` where the profile gives
  them, else an estimate stated in ``machine_spec`` (FP32 FMA throughput of AVX2 cores at
  2.5 GHz per torch thread, and 20 GB/s of DRAM bandwidth). The efficiencies are fractions of
  those figures, so they are only as absolute as the figures are. ``--device NAME`` writes the
  fitted factors as ``[efficiency.NAME]`` of a catalog device, so a run on that device's
  datasheet figures (``cluster.profile = "fit.toml"``) extrapolates what the measured machine
  showed to it.
- Free parameters (``ROOFLINE``): the five efficiency factors that apply to one device and the
  step overhead; the efficiencies are fitted in log10 (they span decades), all bounded, from the
  stated starting point. Residuals: (predicted - measured) / measured for every row of
  prefill.csv (a batch of ``num_seqs`` equal prompts) and decode.csv (p50 seconds).
- Per mechanism of transfer.csv: a fixed latency plus bytes over a bandwidth (two parameters),
  on the same relative residuals.

Each fit is ``scipy.optimize.least_squares`` (trust-region reflective, bounded) and needs more
points than parameters. A factor whose roofline term binds at no measured point cannot be
determined by the data (any larger value fits as well): the report and the TOML say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from hardware.catalog import DeviceSpec, ServingRules
from sim.config import ConfigError
from sim.models.predictor import Efficiency, RooflinePredictor
from sim.models.profile_dir import MeasuredProfile, load_profile_dir

#: the estimate used when the profile states no peak: per torch thread, 2 AVX2 FMA units x 8
#: FP32 lanes x 2 FLOPs at 2.5 GHz = 80 GFLOP/s; DRAM: 20 GB/s (one core's streaming reads)
ESTIMATED_GFLOPS_PER_THREAD = 80.0
ESTIMATED_MEMORY_GB_S = 20.0


@dataclass(frozen=True)
class Parameter:
    """One free parameter: its start and bounds; ``log``: fitted as log10 of the value."""

    name: str
    start: float
    low: float
    high: float
    log: bool = True

    def to_x(self, value: float) -> float:
        return math.log10(value) if self.log else value

    def of_x(self, x: float) -> float:
        return 10.0 ** x if self.log else x


ROOFLINE = (Parameter("prefill_compute_efficiency", 0.3, 1e-6, 1.0),
            Parameter("prefill_memory_efficiency", 0.3, 1e-6, 1.0),
            Parameter("decode_compute_efficiency", 0.3, 1e-6, 1.0),
            Parameter("decode_memory_efficiency", 0.3, 1e-6, 1.0),
            Parameter("decode_attention_efficiency", 0.3, 1e-6, 1.0),
            Parameter("step_overhead_s", 1e-3, 0.0, 1.0, log=False))
#: the efficiencies, each pricing one roofline term that may bind nowhere in a profile
TERMS = tuple(p.name for p in ROOFLINE if p.name.endswith("efficiency"))


def machine_spec(profile: MeasuredProfile) -> tuple[DeviceSpec, str]:
    """The measuring machine as a ``DeviceSpec``, and how its figures were obtained."""
    m = profile.machine
    threads = m.get("threads", 1) if isinstance(m.get("threads"), int) else 1
    peak, bandwidth = m.get("peak_tflops"), m.get("memory_bandwidth_gb_s")
    if isinstance(peak, (int, float)) and isinstance(bandwidth, (int, float)):
        how = "the profile's [machine] peak_tflops and memory_bandwidth_gb_s"
    else:
        peak = ESTIMATED_GFLOPS_PER_THREAD * threads / 1e3
        bandwidth = ESTIMATED_MEMORY_GB_S
        how = (f"estimated: {threads} torch thread(s) x {ESTIMATED_GFLOPS_PER_THREAD:g} GFLOP/s "
               f"(AVX2 FP32 FMA at 2.5 GHz), {ESTIMATED_MEMORY_GB_S:g} GB/s DRAM")
    rules = ServingRules(["bfloat16"], ["bfloat16"], 16, 16, 32, 0.9, "free-memory")
    spec = DeviceSpec("measured", str(m.get("description", "the measuring machine")), "cpu",
                      float(peak), 0.0, float(bandwidth), 0.0, 0.0, 0.0, how, rules)
    return spec, how


def _efficiency(values: dict) -> Efficiency:
    return Efficiency(allreduce_latency_s=0.0, **values)


def _roofline_residuals(profile: MeasuredProfile, spec: DeviceSpec, values: dict):
    """Relative residuals of prefill rows, then decode rows; and the predictor."""
    pred = RooflinePredictor(profile.model, spec, 1, _efficiency(values))
    p = profile.prefill
    prefill = np.array([pred.prefill_time(_prompts(n, t)) for n, t, _ in p])
    d = profile.decode
    decode = np.array([pred.decode_step_time(int(b), int(c)) for b, c, _ in d])
    return (prefill - p[:, 2]) / p[:, 2], (decode - d[:, 2]) / d[:, 2], pred


def _prompts(num_seqs: float, tokens: float) -> list[int]:
    """A batch of ``num_seqs`` prompts totalling ``tokens`` (as equal as whole tokens allow)."""
    n, t = int(num_seqs), int(tokens)
    return [t // n + (1 if k < t % n else 0) for k in range(n)]


def fit_roofline(profile: MeasuredProfile, spec: DeviceSpec, max_nfev: int = 200) -> dict:
    """Fit ``ROOFLINE`` to prefill.csv and decode.csv; the fitted values, residuals, binding."""
    from scipy.optimize import least_squares

    params = ROOFLINE
    num_points = len(profile.prefill) + len(profile.decode)
    if num_points <= len(params):
        raise ConfigError(f"{profile.path}: {num_points} prefill and decode points for "
                          f"{len(params)} parameters; measure more points")

    def values(x) -> dict:
        return {p.name: p.of_x(v) for p, v in zip(params, x)}

    def residuals(x) -> np.ndarray:
        return np.concatenate(_roofline_residuals(profile, spec, values(x))[:2])

    x0 = np.array([p.to_x(p.start) for p in params])
    bounds = ([p.to_x(p.low) if p.log else p.low for p in params],
              [p.to_x(p.high) if p.log else p.high for p in params])
    result = least_squares(residuals, x0, bounds=bounds, method="trf", x_scale=1.0,
                           diff_step=1e-4, max_nfev=max_nfev)
    fitted = values(result.x)
    prefill_r, decode_r, _ = _roofline_residuals(profile, spec, fitted)
    binds = _binding(profile, spec, fitted)
    return {"values": fitted, "prefill": prefill_r, "decode": decode_r,
            "undetermined": [name for name, moves in binds.items() if not moves],
            "num_evaluations": int(result.nfev), "num_points": num_points}


def _binding(profile: MeasuredProfile, spec: DeviceSpec, values: dict) -> dict[str, bool]:
    """Whether each efficiency moves any prediction: its roofline term is the larger one at
    some measured point (checked by nudging it 0.1%, through the predictor's interface)."""
    base = np.concatenate(_roofline_residuals(profile, spec, values)[:2])
    out = {}
    for name in TERMS:
        moved = np.concatenate(_roofline_residuals(
            profile, spec, {**values, name: values[name] * 0.999})[:2])
        out[name] = bool(np.any(np.abs(moved - base) > 1e-9 * (1 + np.abs(base))))
    return out


def fit_transfer(points: np.ndarray, mechanism: str, where: str) -> dict:
    """latency_s + bytes / (bandwidth_gb_s x 1e9) fitted to one mechanism's (bytes, seconds).
    Start: half the fastest time, and the bandwidth of the slope between the end points."""
    from scipy.optimize import least_squares

    nbytes, seconds = points[:, 0], points[:, 1]
    if len(points) <= 2:
        raise ConfigError(f"{where}: {len(points)} points of {mechanism} for 2 parameters; "
                          f"measure more sizes")
    slope = (seconds[-1] - seconds[0]) / (nbytes[-1] - nbytes[0])
    start = (0.5 * float(seconds.min()), 1.0 / (slope * 1e9) if slope > 0 else 1.0)

    def model(x) -> np.ndarray:
        return x[0] + nbytes / (10.0 ** x[1] * 1e9)

    x0 = np.array([start[0], math.log10(min(max(start[1], 1e-4), 1e4))])
    result = least_squares(lambda x: (model(x) - seconds) / seconds, x0,
                           bounds=([0.0, -4.0], [10.0, 4.0]), method="trf")
    return {"latency_s": float(result.x[0]), "bandwidth_gb_s": float(10.0 ** result.x[1]),
            "start": start, "residuals": (model(result.x) - seconds) / seconds}


def calibrate_profile(path, device: str | None = None) -> dict:
    """Both fits on the profile at ``path``: the record ``write_toml`` and ``report`` take.
    ``device``: the catalog device the fitted factors are written for (default "measured")."""
    from hardware import catalog

    if device is not None and device not in catalog.devices():
        raise ConfigError(f"--device {device!r}: the fitted factors are written for a catalog "
                          f"device, one of {sorted(catalog.devices())}")
    profile = load_profile_dir(path)
    spec, how = machine_spec(profile)
    roofline = fit_roofline(profile, spec)
    transfer = {m: fit_transfer(points, m, str(Path(profile.path) / "transfer.csv"))
                for m, points in sorted(profile.transfer.items())}
    return {"profile": profile, "device": spec, "device_source": how,
            "key": device or "measured", "roofline": roofline, "transfer": transfer}


def rms(residuals) -> float:
    r = np.asarray(residuals, dtype=np.float64)
    return float(np.sqrt(np.mean(r * r))) if len(r) else math.nan


def report(record: dict) -> str:
    """Fitted values against their bounds, then every table's residuals, per point and RMS."""
    profile, fit = record["profile"], record["roofline"]
    lines = [f"roofline of {profile.model.name} on {record['device'].name}: "
             f"{record['device'].peak_tflops:.4g} TFLOPS, "
             f"{record['device'].memory_bandwidth_gb_s:.4g} GB/s ({record['device_source']})",
             f"{len(ROOFLINE)} parameters, {fit['num_points']} points, "
             f"{fit['num_evaluations']} evaluations", "",
             f"{'parameter':30s} {'start':>10s} {'fitted':>10s}  bounds"]
    for p in ROOFLINE:
        note = ("  not determined: its term binds at no point (any larger value fits as well)"
                if p.name in fit["undetermined"] else "")
        lines.append(f"{p.name:30s} {p.start:10.4g} {fit['values'][p.name]:10.4g}  "
                     f"[{p.low:g}, {p.high:g}]{note}")
    lines += ["", f"prefill.csv: RMS relative residual {rms(fit['prefill']):.2%}"]
    lines += [f"  {int(n):3d} seqs {int(t):6d} tokens  {s * 1e3:9.3f} ms  {r:+7.2%}"
              for (n, t, s), r in zip(profile.prefill, fit["prefill"])]
    lines += [f"decode.csv: RMS relative residual {rms(fit['decode']):.2%}"]
    lines += [f"  batch {int(b):3d} context {int(c):7d}  {s * 1e3:9.3f} ms  {r:+7.2%}"
              for (b, c, s), r in zip(profile.decode, fit["decode"])]
    for m, t in record["transfer"].items():
        lines += [f"transfer.csv {m}: {t['latency_s'] * 1e3:.4g} ms + bytes / "
                  f"{t['bandwidth_gb_s']:.4g} GB/s; RMS relative residual {rms(t['residuals']):.2%}"]
        lines += [f"  {b:12.0f} B  {s * 1e3:9.3f} ms  {r:+7.2%}"
                  for (b, s), r in zip(profile.transfer[m], t["residuals"])]
    return "\n".join(lines)


def write_toml(record: dict, out: Path) -> None:
    """A profile usable as ``cluster.profile``: the paper profile (sim/profiles/paper.toml)
    with ``[efficiency.<key>]`` replaced by the fit, then the device figures the fit is
    relative to, the transfer fits and the residuals."""
    profile, fit, spec = record["profile"], record["roofline"], record["device"]
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    paper = (Path(__file__).resolve().parents[1] / "profiles" / "paper.toml").read_text()
    lines = [f"# Fitted by `hawk calibrate --profile {profile.path}` ({when}) with",
             "# scipy.optimize.least_squares (bounded) on relative residuals of the p50 times:",
             f"# [efficiency.{record['key']}] and the tables after it. Every other table is the",
             "# paper profile's, as it was then.", "",
             _without_table(paper, f"efficiency.{record['key']}").rstrip(), "",
             "# -- Fitted to the measured profile " + "-" * 56,
             "# The efficiencies below are fractions of [measured_device]'s figures.", "",
             "[measured_device]", f'key = "{record["key"]}"',
             f"peak_tflops = {spec.peak_tflops!r}",
             f"memory_bandwidth_gb_s = {spec.memory_bandwidth_gb_s!r}",
             f'source = "{record["device_source"]}"', "",
             f"[efficiency.{record['key']}]"]
    for p in ROOFLINE:
        what = ("NOT DETERMINED: its term binds at no measured point, so any value at least "
                "this large fits as well" if p.name in fit["undetermined"] else "FITTED")
        lines.append(f"{p.name} = {float(fit['values'][p.name])!r}  # {what}; start {p.start:g}, "
                     f"bounds [{p.low:g}, {p.high:g}]")
    lines += ["allreduce_latency_s = 0.0  # tp 1: no all-reduce", ""]
    for m, t in record["transfer"].items():
        lines += [f"[measured_transfer.{m}]",
                  f"latency_s = {t['latency_s']!r}  # FITTED; start {t['start'][0]:.4g}",
                  f"bandwidth_gb_s = {t['bandwidth_gb_s']!r}  # FITTED; start "
                  f"{t['start'][1]:.4g}", ""]
    lines += ["[fit]", f"num_roofline_parameters = {len(ROOFLINE)}",
              f"num_roofline_points = {fit['num_points']}",
              f"prefill_rms_relative = {rms(fit['prefill'])!r}",
              f"decode_rms_relative = {rms(fit['decode'])!r}"]
    lines += [f"transfer_rms_relative_{m.replace('-', '_')} = {rms(t['residuals'])!r}"
              for m, t in record["transfer"].items()]
    out.write_text("\n".join(lines) + "\n")


def _without_table(text: str, name: str) -> str:
    """TOML ``text`` without table ``[name]``: its header line up to the next blank line."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.strip() == f"[{name}]":
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"

