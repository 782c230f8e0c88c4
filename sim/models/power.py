"""Power and energy of a run: per device, per phase, from the simulator's busy times.

A device's ASIC power is its board power in the current phase times that phase's ASIC
fraction (both from the profile's ``[power.<device>]`` table: assumptions of the scenario,
capped by the device's board power in the catalog). Over a run of ``T`` seconds a
prefill device is busy (prefill phase) for its instance's ``prefill_busy_s`` and idle for the
rest; a decode device likewise with ``decode_busy_s``. Utilisation = busy / T. So

    E_device = busy x prefill_or_decode_w x f_phase + (T - busy) x idle_w x f_idle

summed over the ``tp`` devices of every instance. Power efficiency (docs/paper.md 5, docs/design.md)
= output tokens/s over the average summed ASIC power = output tokens per joule.

An aggregated instance (``sim.engine.aggregated``) runs both phases in the same steps, so a
step's power follows what bounds it on the roofline, with the two phases' own figures: a
compute-bound step (its prompt chunks' FLOPs outweigh the bytes it streams) draws the prefill
phase's power, a memory-bound one (decodes alone, or a small chunk beside many decodes) the
decode phase's. ``StepMeter`` wraps the instance's predictor and adds up its compute-bound
seconds (``RooflinePredictor.mixed_step``; a table predictor, which has no roofline, counts a
step with a prompt chunk as compute-bound): the stats' ``aggregated_compute_bound_s``, the
rest of ``aggregated_busy_s`` being memory-bound. So

    E_aggregated = busy_c x P_prefill + (busy - busy_c) x P_decode + (T - busy) x P_idle

A ``kind = "both"`` cluster sums its P/D pool's and its aggregated pool's devices.

Pure functions of ``(stats, summary, config, profile)``; no simulation state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PowerModel:
    """Board power per phase (W) and the ASIC fraction of each."""

    idle_w: float
    prefill_w: float
    decode_w: float
    asic_fraction_idle: float
    asic_fraction_prefill: float
    asic_fraction_decode: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            limit = 1.0 if f.name.startswith("asic") else 5000.0
            if not isinstance(value, (int, float)) or not 0.0 <= value <= limit:
                raise ValueError(f"[power] {f.name} = {value!r} must be in [0, {limit}]")

    def asic_w(self, phase: str) -> float:
        """ASIC power (W) of one device in ``phase`` ("idle", "prefill" or "decode")."""
        if phase not in ("idle",) + PHASES:
            raise ValueError(f"phase {phase!r} must be 'idle', 'prefill' or 'decode'")
        return getattr(self, f"{phase}_w") * getattr(self, f"asic_fraction_{phase}")

    def average_w(self, phase: str, utilisation: float) -> float:
        """Average ASIC power of one device busy in ``phase`` a ``utilisation`` share of time."""
        u = min(max(utilisation, 0.0), 1.0)
        return u * self.asic_w(phase) + (1.0 - u) * self.asic_w("idle")


def power_model(profile: dict, device: str) -> PowerModel:
    """The ``[power.<device>]`` table of a loaded profile: board power per phase, never above
    the device's board power in the catalog (the one home of that figure)."""
    from hardware import catalog

    table = profile.get("power", {})
    if device not in table:
        raise ValueError(f"profile has no [power.{device}] table; has {sorted(table)}")
    names = {f.name for f in fields(PowerModel)}
    model = PowerModel(**{k: v for k, v in table[device].items() if k in names})
    spec = catalog.devices().get(device)
    for phase in ("idle",) + PHASES:
        watts = getattr(model, f"{phase}_w")
        if spec is not None and watts > spec.board_power_w:
            raise ValueError(f"[power.{device}] {phase}_w = {watts} W exceeds the "
                             f"{spec.board_power_w:g} W board power of the catalog's {spec.name}")
    return model


def profile_of(config, profile=None) -> dict:
    """``profile`` if given, else the tables of the config's profile."""
    if profile is not None:
        return profile
    from sim.models.predictor import load_profile_table

    return load_profile_table(config.cluster.profile)


def device_energy_j(model: PowerModel, phase: str, busy_s: float, span_s: float) -> float:
    """Joules of one device busy ``busy_s`` of ``span_s`` seconds in ``phase``."""
    if span_s <= 0:
        return 0.0
    busy = min(max(busy_s, 0.0), span_s)
    return busy * model.asic_w(phase) + (span_s - busy) * model.asic_w("idle")


class StepMeter:
    """A predictor that adds up the seconds of the compute-bound steps it prices for one
    aggregated instance (``compute_bound_s``); every other call goes to ``inner``. Each step
    an aggregated instance prices with ``mixed_step_time`` is one it runs (a run it cuts
    short is one of decodes only, never compute-bound)."""

    def __init__(self, inner):
        self.inner = inner
        self.compute_bound_s = 0.0
        self.decode_time = inner.decode_time                    # the hot calls, unwrapped
        self.decode_next_boundary = inner.decode_next_boundary

    def mixed_step_time(self, prefill_chunks, decode_contexts) -> float:
        duration, compute_bound = self.inner.mixed_step(prefill_chunks, decode_contexts)
        if compute_bound:
            self.compute_bound_s += duration
        return duration

    def __getattr__(self, name):
        return getattr(self.inner, name)


def roles_of(config) -> tuple[str, ...]:
    """The instance tables a run's cluster serves from (its ``kind``)."""
    kind = getattr(config.cluster, "kind", "disaggregated")
    return {"disaggregated": PHASES, "aggregated": ("aggregated",),
            "both": PHASES + ("aggregated",)}[kind]


def aggregated_energy_j(model: PowerModel, busy_s: float, compute_bound_s: float,
                        span_s: float) -> float:
    """Joules of one device of an aggregated instance busy ``busy_s`` of ``span_s`` seconds,
    ``compute_bound_s`` of them in compute-bound steps (the module docstring)."""
    if span_s <= 0:
        return 0.0
    busy = min(max(busy_s, 0.0), span_s)
    bound = min(max(compute_bound_s, 0.0), busy)
    return (bound * model.asic_w("prefill") + (busy - bound) * model.asic_w("decode")
            + (span_s - busy) * model.asic_w("idle"))


def run_energy(stats: dict, summary: dict, config, profile: dict | None = None) -> dict:
    """Energy of every device of a run, by phase (and aggregated pool); average power; output
    tokens per joule."""
    profile = profile_of(config, profile)
    span = float(summary["simulated_time_s"])
    out: dict = {"span_s": span}
    total = 0.0
    for phase in roles_of(config):
        inst = getattr(config.cluster, phase)
        if phase == "aggregated":
            total += _aggregated_energy(stats, inst, power_model(profile, inst.device), span,
                                        out)
            continue
        model = power_model(profile, inst.device)
        busy = list(stats[f"{phase}_busy_s"])
        joules = [inst.tp * device_energy_j(model, phase, b, span) for b in busy]
        out[f"{phase}_energy_j"] = float(sum(joules))
        out[f"{phase}_utilisation"] = [b / span if span > 0 else 0.0 for b in busy]
        out[f"{phase}_devices"] = inst.tp * len(busy)
        total += sum(joules)
    out["energy_j"] = total
    out.update(_average(total, span, summary))
    return out


def _aggregated_energy(stats: dict, inst, model: PowerModel, span: float, out: dict) -> float:
    busy = list(stats["aggregated_busy_s"])
    # a cells run's merged stats carry no compute-bound seconds: its busy time is priced at
    # the decode phase's power (memory-bound), as every step was before the meter existed
    bound = list(stats.get("aggregated_compute_bound_s", [0.0] * len(busy)))
    joules = sum(inst.tp * aggregated_energy_j(model, b, c, span) for b, c in zip(busy, bound))
    out["aggregated_energy_j"] = float(joules)
    out["aggregated_utilisation"] = [b / span if span > 0 else 0.0 for b in busy]
    out["aggregated_compute_bound_share"] = (sum(bound) / sum(busy) if sum(busy) > 0
                                             else 0.0)
    out["aggregated_devices"] = inst.tp * len(busy)
    return float(joules)


def _average(total: float, span: float, summary: dict) -> dict:
    out = {}
    out["average_power_w"] = total / span if span > 0 else 0.0
    tps = float(summary["output_tokens_per_s"])
    out["tokens_per_joule"] = tps / out["average_power_w"] if out["average_power_w"] > 0 else 0.0
    return out


def decode_power_w(profile: dict, device: str, num_devices: int) -> float:
    """Summed ASIC power of ``num_devices`` devices decoding flat out (Table 1's setting)."""
    return num_devices * power_model(profile, device).asic_w("decode")
