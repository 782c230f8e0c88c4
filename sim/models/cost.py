"""What a cluster costs: the one cost model, for a run's summary and for the capacity planner.

Every input is a table of the profile (sim/profiles/paper.toml states each one's source, or
marks it an assumption); ``hawk plan --catalog FILE`` lays a user's figures over the
profile's ``[cost]`` table key by key (``with_overrides``).

- device price: the catalog's ``price_usd`` (hardware/catalog/devices.toml, sourced there),
  unless the profile's ``[price]`` overrides one;
- amortisation period: ``[cost] lifetime_years``, straight-line (default 3.0);
- pricing: ``[cost] model``, ``"amortised"`` (prices over the period, the default) or
  ``"hourly"`` (``[cost.hourly_usd]``, $ per device-hour);
- electricity: ``[cost] usd_per_kwh`` (default 0.0);
- hosting: ``[cost.host]`` ``price_usd``, ``devices_per_host``, ``power_w``: the servers the
  devices sit in; an instance of tp devices takes ceil(tp / devices_per_host) of them (a TP
  group stays in one box, instances never share one);
- network: ``[cost.nic]`` ``price_usd``, ``power_w``: one RDMA NIC per instance carries its KV
  cache (sim/engine/link.py). An aggregated instance moves no KV cache but serves its clients
  through a NIC of its own, priced alike (an assumption).

The devices, hosts and NICs are those of the instance tables the cluster serves from
(``[cluster] kind``: prefill and decode, aggregated, or all three).

A ``[cost.host]`` or ``[cost.nic]`` table left out is not priced (no servers or NICs are
counted); a profile without ``[cost]`` is amortised over 3 years with free electricity. The
paper profile gives every table.

- Capital per second (``capital_usd_per_s``): amortised, (devices + hosts + NICs) / the
  period; hourly, the devices' rates, taken to cover their share of the host and the NIC (an
  assumption: cloud on-demand prices are per accelerator of a whole machine).
- Energy: the devices' joules of the run (``sim.models.power.run_energy``) + the hosts' and
  NICs' power over the run's span, at ``usd_per_kwh``, in either pricing.
- Cost per successful request (``usd_per_success``) = (capital per second x span + energy $)
  / requests finished; the summary's ``usd_per_request`` and the planner's
  ``usd_per_success`` are this one figure.
- Cost efficiency (docs/paper.md 5, ``tokens_per_s_per_dollar``) = output tokens/s over the
  summed price of the serving devices only (``capex_usd``), as the paper defines it.

Pure functions of ``(stats, summary, config, profile)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sim.models.power import profile_of, roles_of, run_energy

SECONDS_PER_YEAR = 365.25 * 24 * 3600
J_PER_KWH = 3.6e6
PRICINGS = ("amortised", "hourly")
#: keys of ``[cost]`` and of its sub-tables
COST_KEYS = ("model", "lifetime_years", "usd_per_kwh", "hourly_usd", "host", "nic")
HOST_KEYS = ("price_usd", "devices_per_host", "power_w")
NIC_KEYS = ("price_usd", "power_w")


@dataclass(frozen=True)
class CostInputs:
    """The profile's ``[cost]`` table, checked (the module docstring says what each means)."""

    model: str = "amortised"
    lifetime_years: float = 3.0
    usd_per_kwh: float = 0.0
    hourly_usd: dict = field(default_factory=dict)      # device -> $ per device-hour
    host: dict | None = None                            # HOST_KEYS, and a source
    nic: dict | None = None                             # NIC_KEYS, and a source

    def __post_init__(self) -> None:
        if self.model not in PRICINGS:
            raise ValueError(f"[cost] model {self.model!r} must be 'amortised' or 'hourly'")
        if not _number(self.lifetime_years) or self.lifetime_years <= 0:
            raise ValueError(f"[cost] lifetime_years {self.lifetime_years!r} must be > 0")
        if not _number(self.usd_per_kwh) or self.usd_per_kwh < 0:
            raise ValueError(f"[cost] usd_per_kwh {self.usd_per_kwh!r} must be >= 0")
        for name, table, keys in (("host", self.host, HOST_KEYS), ("nic", self.nic, NIC_KEYS)):
            for key in keys if table is not None else ():
                value = table.get(key)
                if not _number(value) or value < 0:
                    raise ValueError(f"[cost.{name}] {key} must be a number >= 0, got {value!r}")
        if self.host is not None and not self.host["devices_per_host"] >= 1:
            raise ValueError("[cost.host] devices_per_host must be >= 1")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cost_inputs(profile: dict) -> CostInputs:
    """The checked ``[cost]`` table of ``profile`` (unknown keys named)."""
    table = profile.get("cost", {})
    unknown = sorted(set(table) - set(COST_KEYS))
    if unknown:
        raise ValueError(f"[cost] has unknown key(s) {unknown}; allowed: {list(COST_KEYS)}")
    return CostInputs(**table)


def with_overrides(profile: dict, overrides: dict) -> dict:
    """``profile`` with ``overrides`` (a ``[cost]``-shaped table) laid over its ``[cost]``
    table key by key (a sub-table's keys one by one), checked."""
    unknown = sorted(set(overrides) - set(COST_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {list(COST_KEYS)}")
    cost = dict(profile.get("cost", {}))
    for key, value in overrides.items():
        old = cost.get(key)
        cost[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    out = {**profile, "cost": cost}
    cost_inputs(out)
    return out


def device_price(profile: dict, device: str) -> float:
    """The profile's ``[price]`` override for ``device``, else the catalog's price."""
    from hardware import catalog

    known = catalog.devices()
    overrides = profile.get("price", {})
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"profile [price] names unknown device(s) {unknown}; choose from "
                         f"{sorted(known)}")
    if device in overrides:
        return float(overrides[device])
    return float(catalog.lookup(known, device, "device").price_usd)


def devices_of(config) -> list[tuple[str, int]]:
    """(device, count) for each instance table of a run: the prefill and the decode side,
    the aggregated pool, or all three (``[cluster] kind``)."""
    cl = config.cluster
    return [(getattr(cl, p).device, getattr(cl, p).tp * getattr(cl, p).num_instances)
            for p in roles_of(config)]


def hosts_and_nics(config, inputs: CostInputs) -> tuple[int, int]:
    """Servers and NICs the cluster needs (0 of what the profile does not price)."""
    hosts = nics = 0
    for p in roles_of(config):
        inst = getattr(config.cluster, p)
        if inputs.host is not None:
            hosts += inst.num_instances * math.ceil(inst.tp / inputs.host["devices_per_host"])
        if inputs.nic is not None:
            nics += inst.num_instances
    return hosts, nics


def capex_usd(config, profile: dict | None = None) -> float:
    """Summed price of every device in the cluster (the paper's cost-efficiency divisor)."""
    profile = profile_of(config, profile)
    return sum(n * device_price(profile, dev) for dev, n in devices_of(config))


def tokens_per_s_per_dollar(summary: dict, config, profile: dict | None = None) -> float:
    return float(summary["output_tokens_per_s"]) / capex_usd(config, profile)


def capital_usd_per_s(config, profile: dict | None = None) -> float:
    """Dollars per second of holding the cluster: devices, hosts and NICs amortised, or the
    devices' hourly rates."""
    profile = profile_of(config, profile)
    inputs = cost_inputs(profile)
    if inputs.model == "hourly":
        missing = [dev for dev, _ in devices_of(config) if dev not in inputs.hourly_usd]
        if missing:
            raise ValueError(f"[cost.hourly_usd] has no rate for {missing}")
        return sum(n * float(inputs.hourly_usd[dev]) for dev, n in devices_of(config)) / 3600.0
    hosts, nics = hosts_and_nics(config, inputs)
    total = (capex_usd(config, profile) + hosts * _get(inputs.host, "price_usd")
             + nics * _get(inputs.nic, "price_usd"))
    return total / (inputs.lifetime_years * SECONDS_PER_YEAR)


def overhead_power_w(config, profile: dict | None = None) -> float:
    """The hosts' and NICs' own draw, watts (beside the devices')."""
    inputs = cost_inputs(profile_of(config, profile))
    hosts, nics = hosts_and_nics(config, inputs)
    return hosts * _get(inputs.host, "power_w") + nics * _get(inputs.nic, "power_w")


def _get(table: dict | None, key: str) -> float:
    return 0.0 if table is None else float(table[key])


def usd_per_success(summary: dict, config, profile: dict | None = None) -> float:
    """(Capital + energy) dollars of a run over its finished requests, from its summary's
    ``simulated_time_s``, ``energy_j`` (the devices') and ``num_finished``; inf if none."""
    money = _dollars(config, profile_of(config, profile), float(summary["simulated_time_s"]),
                     float(summary["energy_j"]))
    done = int(summary["num_finished"])
    return (money[0] + money[1]) / done if done else math.inf


def _dollars(config, profile: dict, span_s: float, device_j: float) -> tuple[float, float]:
    """(capital, energy) dollars of holding the cluster ``span_s`` seconds while its devices
    use ``device_j`` joules."""
    joules = device_j + overhead_power_w(config, profile) * span_s
    return (capital_usd_per_s(config, profile) * span_s,
            joules / J_PER_KWH * cost_inputs(profile).usd_per_kwh)


def run_cost(stats: dict, summary: dict, config, profile: dict | None = None) -> dict:
    """Capital and energy dollars of a run, per successful request, and tokens/s per dollar."""
    profile = profile_of(config, profile)
    energy = run_energy(stats, summary, config, profile)
    capital, energy_usd = _dollars(config, profile, energy["span_s"], energy["energy_j"])
    done = int(summary["num_finished"])
    return {"capex_usd": capex_usd(config, profile), "capital_usd": capital,
            "energy_usd": energy_usd, "total_usd": capital + energy_usd,
            "usd_per_request": (capital + energy_usd) / done if done else float("nan"),
            "tokens_per_s_per_dollar": tokens_per_s_per_dollar(summary, config, profile),
            "tokens_per_joule": energy["tokens_per_joule"]}
