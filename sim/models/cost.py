"""Cost of a run: device prices, tokens/s per dollar, and cost per successful request.

Prices are the device catalog's ``price_usd`` (US dollars per device, sourced in
``hardware/catalog/devices.toml``), unless the profile's ``[price]`` table overrides one where
its scenario assumes a different figure (and says why there). Cost
efficiency (docs/paper.md 5) = output tokens/s over the summed price of all prefill and decode
devices. Cost per successful request = (capital + energy) over the run / requests finished:

- capital: ``"amortised"``: price / (``lifetime_years`` in seconds) per device-second, or
  ``"hourly"``: the ``[cost.hourly_usd]`` rate per device-hour (``[cost] model``);
- energy: ``sim.models.power.run_energy`` joules at ``usd_per_kwh``.

Pure functions of ``(stats, summary, config, profile)``.
"""

from __future__ import annotations

from sim.models.power import PHASES, profile_of, run_energy

SECONDS_PER_YEAR = 365.25 * 24 * 3600
J_PER_KWH = 3.6e6


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
    """(device, count) for the prefill and the decode side of a run."""
    cl = config.cluster
    return [(getattr(cl, p).device, getattr(cl, p).tp * getattr(cl, p).num_instances)
            for p in PHASES]


def capex_usd(config, profile: dict | None = None) -> float:
    """Summed price of every device in the cluster."""
    profile = profile_of(config, profile)
    return sum(n * device_price(profile, dev) for dev, n in devices_of(config))


def tokens_per_s_per_dollar(summary: dict, config, profile: dict | None = None) -> float:
    return float(summary["output_tokens_per_s"]) / capex_usd(config, profile)


def capital_usd_per_s(config, profile: dict | None = None) -> float:
    """Dollars per second of holding the cluster (amortised or rented)."""
    profile = profile_of(config, profile)
    cost = profile.get("cost", {})
    mode = cost.get("model", "amortised")
    if mode == "amortised":
        years = float(cost.get("lifetime_years", 3.0))
        if years <= 0:
            raise ValueError(f"[cost] lifetime_years {years} must be > 0")
        return capex_usd(config, profile) / (years * SECONDS_PER_YEAR)
    if mode == "hourly":
        rates = cost.get("hourly_usd", {})
        missing = [dev for dev, _ in devices_of(config) if dev not in rates]
        if missing:
            raise ValueError(f"[cost.hourly_usd] has no rate for {missing}")
        return sum(n * float(rates[dev]) for dev, n in devices_of(config)) / 3600.0
    raise ValueError(f"[cost] model {mode!r} must be 'amortised' or 'hourly'")


def run_cost(stats: dict, summary: dict, config, profile: dict | None = None) -> dict:
    """Capital and energy dollars of a run, per successful request, and tokens/s per dollar."""
    profile = profile_of(config, profile)
    energy = run_energy(stats, summary, config, profile)
    span = energy["span_s"]
    capital = capital_usd_per_s(config, profile) * span
    energy_usd = energy["energy_j"] / J_PER_KWH * float(profile.get("cost", {}).get(
        "usd_per_kwh", 0.0))
    done = int(summary["num_finished"])
    return {"capex_usd": capex_usd(config, profile), "capital_usd": capital,
            "energy_usd": energy_usd, "total_usd": capital + energy_usd,
            "usd_per_request": (capital + energy_usd) / done if done else float("nan"),
            "tokens_per_s_per_dollar": tokens_per_s_per_dollar(summary, config, profile),
            "tokens_per_joule": energy["tokens_per_joule"]}
