"""Published measurements of each device, one ``DevicePoint`` per figure (``device_points``).

The files live in ``hardware/catalog/measured/`` (its README names sources, licences and
columns), so nothing here reads outside the package:

- ``splitwise-perf-model.csv`` (Splitwise, ISCA 2024, MIT): Llama 2 70B on DGX A100-80GB and
  DGX H100-80GB at TP 2/4/8. Its ``a100-80gb`` and ``h100-80gb`` rows are the catalog's
  ``a100-sxm`` and ``h100-sxm`` (DGX boards: SXM modules on NVLink). Each distinct setting is
  one point, the mean of its repeats: a prefill point (``prompt_time``: the whole batch's
  prefill) per (prompt, batch), a decode point (``token_time``: the mean time per output token,
  one step of the batch) per (prompt, batch, output length), at each sequence's mean context
  over its generation, prompt + output / 2. The power-capped H100 and BLOOM rows are not used:
  the catalog has no capped device and no BLOOM.
- ``tt-metal.csv``: tt-metal's published tables, each row with its file and commit. TTFT is
  taken as the prefill of one 128-token prompt (the demos prefill each user on its own);
  tokens/s/user as one decode step of the batch at 128 tokens of context per user ("the
  throughput of the first token generated after prefill").

A point the model must not be judged on carries ``excluded``, the reason, and stays listed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

#: Splitwise's hardware names -> catalog devices
SPLITWISE_DEVICES = {"a100-80gb": "a100-sxm", "h100-80gb": "h100-sxm"}
SPLITWISE_SOURCE = ("Splitwise perf_model.csv (Patel et al., ISCA 2024; github.com/Mutinifni/"
                    "splitwise-sim data/perf_model.csv, MIT)")
TT_METAL_URL = "https://github.com/tenstorrent/tt-metal/blob/{commit}/{file}"

#: settings whose rows are not the stated batch (see _excluded)
_TP2_BATCH64 = ("not a batch of 64: its prefill (796 ms on A100, 361 on H100) is below "
                "batch 32's (6607, 2394); at TP2, 160 GB less 138 GB of bf16 weights leaves "
                "little room for 64 x 640 tokens x 320 KiB = 13.4 GB of KV")


@dataclass(frozen=True)
class DevicePoint:
    """One published measurement: ``value_s`` seconds of a ``phase`` ("prefill": one batch
    of ``batch`` prompts of ``prompt_tokens``; "decode": one step of ``batch`` sequences of
    ``context`` tokens each) of ``model`` on ``tp`` devices of ``device``."""

    device: str
    model: str
    tp: int
    phase: str
    batch: int
    prompt_tokens: int
    context: float
    value_s: float
    spread: float            # repeats' standard deviation / mean; 0 where one figure
    weight_format: str
    kv_dtype: str
    source: str
    excluded: str | None = None
    tag: str = ""            # tells apart two published figures of one setting


    @property
    def key(self) -> str:
        """A short unique name: device, model, TP, phase and setting."""
        setting = (f"p{self.prompt_tokens}" if self.phase == "prefill"
                   else f"ctx{self.context:g}")
        key = f"{self.device}/{self.model}/tp{self.tp}/{self.phase}/b{self.batch}/{setting}"
        return f"{key}/{self.tag}" if self.tag else key


def device_points() -> tuple[DevicePoint, ...]:
    """Every published point: Splitwise's, then tt-metal's."""
    return _splitwise() + _tt_metal()


def _read(name: str) -> list[dict]:
    text = resources.files("hardware").joinpath("catalog", "measured", name).read_text()
    return list(csv.DictReader(text.splitlines()))


@lru_cache(maxsize=None)
def _splitwise() -> tuple[DevicePoint, ...]:
    groups: dict[tuple, list[float]] = {}
    for row in _read("splitwise-perf-model.csv"):
        device = SPLITWISE_DEVICES.get(row["hardware"])
        if device is None or row["model"] != "llama2-70b":
            continue
        tp, prompt, batch = int(row["tensor_parallel"]), int(row["prompt_size"]), \
            int(row["batch_size"])
        groups.setdefault((device, tp, "prefill", prompt, batch, 0), []).append(
            float(row["prompt_time"]) / 1e3)
        groups.setdefault((device, tp, "decode", prompt, batch, int(row["token_size"])),
                          []).append(float(row["token_time"]) / 1e3)
    points = []
    for (device, tp, phase, prompt, batch, tokens), values in sorted(groups.items()):
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        context = prompt if phase == "prefill" else prompt + tokens / 2
        points.append(DevicePoint(
            device, "llama-2-70b", tp, phase, batch, prompt, context, mean, var ** 0.5 / mean,
            "bfloat16", "bfloat16", f"{SPLITWISE_SOURCE}, {len(values)} runs",
            _TP2_BATCH64 if (tp, batch) == (2, 64) else None))
    return tuple(points)


@lru_cache(maxsize=None)
def _tt_metal() -> tuple[DevicePoint, ...]:
    points = []
    for row in _read("tt-metal.csv"):
        where = (f"tt-metal {row['file']} @ {row['commit'][:10]}, {row['row']}"
                 + (f", release {row['release']}" if row["release"] else ""))
        common = dict(device=row["device"], model=row["model"], tp=int(row["num_devices"]),
                      batch=int(row["batch"]), prompt_tokens=int(row["prompt_tokens"]),
                      context=float(row["prompt_tokens"]), spread=0.0,
                      weight_format="tt-mixed", kv_dtype="bfloat8_b",
                      tag=f"{row['file'].split('/')[-1].split('.')[0]}-b{row['batch']}")
        points.append(DevicePoint(phase="prefill", value_s=float(row["ttft_ms"]) / 1e3,
                                  source=f"{where}: TTFT {row['ttft_ms']} ms", **{
                                      **common, "batch": 1}))
        points.append(DevicePoint(
            phase="decode", value_s=1.0 / float(row["tokens_per_s_per_user"]),
            source=f"{where}: {row['tokens_per_s_per_user']} t/s/u", **common))
    return tuple(points)


def tt_metal_url(point_source: str) -> str:
    """The GitHub address of a tt-metal point's file at its commit (from the CSV row)."""
    for row in _read("tt-metal.csv"):
        if row["file"] in point_source and row["commit"][:10] in point_source:
            return TT_METAL_URL.format(commit=row["commit"], file=row["file"])
    raise ValueError(f"not a tt-metal point: {point_source!r}")
