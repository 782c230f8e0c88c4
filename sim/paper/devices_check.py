"""The roofline model beside every published measurement of each device (``check``;
``hawk devices --check``).

Rows come from ``sim.paper.device_points``: Splitwise's measured Llama 2 70B prefills and
decode steps on DGX A100 and DGX H100 at TP 2/4/8, and tt-metal's published Llama 3.1 8B and
70B figures on p150 and n300, each with its source. The model's value is the profile's
roofline for the same setting (``sim.paper.devices_fit.model_times``). A point marked
excluded stays listed with its reason and counts in no summary.

Serving figures (``SERVING``) are listed apart: whole-server TPOTs whose batch is inferred,
not measured steps, and no fit uses them:

- vLLM on 4x A100 80GB, Llama 3.1 70B, ShareGPT (docs/facts.md 6): TPOT mean 44.9 ms at
  1 req/s and 74 ms at 4 req/s. The batch is not published; we take Little's law with
  ShareGPT's mean output (189 tokens): batch ~ rate x 189 x TPOT, context ~ 750 + 95.
"""

from __future__ import annotations

from sim.models.efficiency import load_profile
from sim.paper.device_points import DevicePoint, device_points

#: the share of the measured value a point may miss by and count as reproduced
TOLERANCE = 0.10

#: (device, what, batch, context per sequence, published seconds, source)
SERVING = (
    ("a100-pcie", "vLLM TPOT at 1 req/s", 8, 845, 0.0449,
     "vLLM, 4x A100 80GB, Llama 3.1 70B, ShareGPT (docs/facts.md 6); batch from Little's law"),
    ("a100-pcie", "vLLM TPOT at 4 req/s", 56, 845, 0.074,
     "vLLM, 4x A100 80GB, Llama 3.1 70B, ShareGPT (docs/facts.md 6); batch from Little's law"),
)


def check(profile: str = "grounded") -> list[dict]:
    """One row per published point: the model under ``profile`` against the measurement."""
    from sim.paper.devices_fit import model_times

    effs = load_profile(profile)
    rows = []
    for q in device_points():
        row = {"key": q.key, "device": q.device, "model_name": q.model, "tp": q.tp,
               "phase": q.phase, "setting": setting(q), "measured": q.value_s,
               "spread": q.spread, "source": q.source, "excluded": q.excluded,
               "model": None, "error": None}
        if q.device in effs:
            row["model"] = float(model_times([q], effs[q.device])[0])
            row["error"] = row["model"] / q.value_s - 1.0
        rows.append(row)
    return rows


def check_serving(profile: str = "grounded") -> list[dict]:
    """The serving figures (``SERVING``) under ``profile``'s devices, where it has them."""
    from hardware import catalog
    from sim.models.rooflines import roofline

    effs = load_profile(profile)
    rows = []
    for device, what, batch, context, published, source in SERVING:
        row = {"device": device, "what": what, "setting": f"batch {batch}, ctx {context}",
               "measured": published, "source": source, "model": None, "error": None}
        if device in effs:
            pred = roofline(catalog.models()["llama-3.1-70b"], catalog.devices()[device], 4,
                            effs[device], "bfloat16", "fp8")
            row["model"] = pred.decode_step_time(batch, batch * context)
            row["error"] = row["model"] / published - 1.0
        rows.append(row)
    return rows


def setting(q: DevicePoint) -> str:
    """A point's setting in words: ``prefill 8 x 512`` or ``decode b32 ctx 128``."""
    if q.phase == "prefill":
        return f"prefill {q.batch} x {q.prompt_tokens}"
    return f"decode b{q.batch} ctx {q.context:g}"


def summary(rows: list[dict]) -> dict:
    """How many judged points (not excluded, with a model value) are within ``TOLERANCE``,
    per device and in all."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["excluded"] or r["error"] is None:
            continue
        for key in (r["device"], "all"):
            s = out.setdefault(key, {"points": 0, "within": 0, "worst": 0.0})
            s["points"] += 1
            s["within"] += abs(r["error"]) <= TOLERANCE
            s["worst"] = max(s["worst"], abs(r["error"]))
    return {k: out[k] for k in sorted(out, key=lambda k: k == "all")}   # "all" last
