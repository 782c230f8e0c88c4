"""The candidates ``hawk plan`` may simulate (``sim.runs.capacity`` explains the search):
what the space allows (``Space``), the roofline bounds on one instance's rate
(``phase_capacity``, ``aggregated_capacity``), and the configurations left after the
validity, memory and roofline checks (``candidates``), disaggregated and aggregated."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.config import ConfigError, RunConfig
from sim.runs.verdict import DEPLOYMENTS, with_kind

#: mechanisms tried first on each hardware choice (the others only on the cheapest that meets
#: the target: a mechanism changes no price, only how well the hardware serves)
PREFERRED = ("GN-HAWK", "GG-Direct")


@dataclass(frozen=True)
class Space:
    """What the planner may choose from (None: every catalog device with a timing table)."""

    prefill_devices: tuple | None = None
    decode_devices: tuple | None = None
    tps: tuple = (1, 2, 4, 8)
    decode_batch_sizes: tuple | None = None     # None: the device's default
    mechanisms: tuple | None = None
    max_instances: int = 8
    max_candidates: int = 24         # configurations simulated at the asked rate, at most
    max_knees: int = 6               # of which knees are bisected (meeting the target first)
    aggregated_devices: tuple | None = None     # None: every device with a timing table
    deployments: tuple = DEPLOYMENTS  # "aggregated", "disaggregated" or both

    def __post_init__(self) -> None:
        bad = [d for d in self.deployments if d not in DEPLOYMENTS]
        if bad or not self.deployments:
            raise ConfigError(f"--deployments {list(self.deployments)}: choose from "
                              f"{list(DEPLOYMENTS)}")


# -- bounds ---------------------------------------------------------------------------------

def phase_capacity(config: RunConfig, role: str, prompt: float, output: float) -> float:
    """Best-case requests/s of one ``role`` instance (raises ``ConfigError`` if the weights do
    not fit): full prefill batches of ``prompt``-token prompts, or a decode batch as large as
    its batch size and KV memory allow, at the mean context."""
    return _capacity(config, getattr(config.cluster, role), role, prompt, output)


def aggregated_capacity(config: RunConfig, prompt: float, output: float) -> tuple[float, float]:
    """(optimistic, pessimistic) requests/s of one aggregated instance: its prefill work
    alone or its decode work alone at best (each as ``phase_capacity`` prices it), and both
    one after the other (a mixed step overlaps them, so the truth lies between)."""
    inst = config.cluster.aggregated
    pre = _capacity(config, inst, "prefill", prompt, output)
    dec = _capacity(config, inst, "decode", prompt, output)
    if not (pre > 0 and dec > 0):
        return 0.0, 0.0
    return min(pre, dec), 1.0 / (1.0 / pre + 1.0 / dec)


def _capacity(config: RunConfig, inst, role: str, prompt: float, output: float) -> float:
    from hardware.kv_layout import blocks_for
    from sim.engine.cluster import kv_capacity_blocks, make_predictor

    blocks = kv_capacity_blocks(config, inst)
    predictor = make_predictor(config, inst)
    if role == "prefill":
        k = max(1, min(inst.max_batch_size, int(inst.max_batch_tokens // prompt)))
        return k / predictor.prefill_time([int(prompt)] * k)
    per_request = blocks_for(int(prompt + output), inst.block_size)
    batch = min(inst.max_batch_size, blocks // per_request)
    if batch < 1:
        return 0.0
    step = predictor.decode_step_time(batch, int(prompt + output / 2))
    return batch / (output * step)


def _mean_lengths(workload: str) -> tuple[float, float]:
    from traces.workloads import length_table, workload_spec

    prompt, output = length_table(workload_spec(workload).lengths_file)
    return float(np.mean(prompt)), float(np.mean(output))


def candidates(base: RunConfig, space: Space, rate: float, target: float):
    """([(the hardware choice under each applicable mechanism, preferred first, its roofline
    rate bound)], counts of what each check pruned): the disaggregated candidates, then the
    aggregated ones (as ``space.deployments`` asks)."""
    from hardware.catalog import devices
    from sim.models.predictor import load_profile

    timed = set(load_profile(base.cluster.profile))
    kinds = {name: d.kind for name, d in devices().items() if name in timed}
    for names in (space.prefill_devices, space.decode_devices, space.aggregated_devices):
        for device in names or ():
            if device not in kinds:
                raise ConfigError(f"--devices: {device!r} has no timing table in profile "
                                  f"{base.cluster.profile!r}; choose from {sorted(kinds)}")
    lengths = _mean_lengths(base.workload.name)
    pruned = {"invalid": 0, "memory": 0, "roofline": 0}
    out = []
    if "disaggregated" in space.deployments:
        out += _disaggregated(with_kind(base, "disaggregated"), space, rate, target, kinds,
                              lengths, pruned)
    if "aggregated" in space.deployments:
        out += _aggregated(base, space, rate, target, kinds, lengths, pruned)
    return out, pruned


def _prune(pruned: dict, exc: ConfigError) -> None:
    pruned["memory" if ("weights" in str(exc) or " fit" in str(exc)) else "invalid"] += 1


def _counts(rate: float, target: float, high: float, low: float, space: Space,
            pruned: dict) -> list[int]:
    """Instance counts to try for a phase (or an aggregated pool) serving at best ``high``
    and at worst ``low`` requests/s an instance: from the fewest that could keep up to the
    fewest that surely can, plus one, at most 3 counts and ``space.max_instances``."""
    need = math.ceil(rate * target / high) if high > 0 else math.inf
    pruned["roofline"] += min(need, space.max_instances + 1) - 1
    if need > space.max_instances:                # counts below need cannot keep up
        return []
    sure = math.ceil(rate * target / low) if low > 0 else need
    top = min(max(sure, need + 1), need + 2, space.max_instances)
    return list(range(need, top + 1))


def _disaggregated(base: RunConfig, space: Space, rate: float, target: float, kinds: dict,
                   lengths: tuple, pruned: dict) -> list:
    from sim.models.transfer import MECHANISMS

    phases = {role: _phase_options(base, role, names, space, rate, target, kinds, lengths,
                                   pruned)
              for role, names in (("prefill", space.prefill_devices),
                                  ("decode", space.decode_devices))}
    out = []
    mechanisms = space.mechanisms or PREFERRED + tuple(m for m in MECHANISMS
                                                       if m not in PREFERRED)
    for pre, pre_cap, _ in phases["prefill"]:
        kv_dtype = base.replace(**pre).cluster.prefill.kv_dtype
        for dec, dec_cap, kind in phases["decode"]:
            same = {"cluster.decode.kv_dtype": kv_dtype} if kind == "gpu" else {}
            configs = []                  # a GPU->GPU copy keeps the prefill side's KV dtype
            for mech in (m for m in mechanisms if MECHANISMS[m].destination == kind):
                try:
                    configs.append(base.replace(**pre, **dec, **same,
                                                **{"cluster.link.mechanism": mech,
                                                   "workload.rate": rate}))
                except ConfigError:
                    pruned["invalid"] += 1
            if configs:
                out.append((configs, min(pre_cap, dec_cap)))
    return out


def _phase_options(base, role, names, space, rate, target, kinds, lengths, pruned) -> list:
    """(changes, roofline rate bound, device kind) of each device, TP, batch size and count
    of one phase."""
    options = []
    allowed = names or tuple(n for n in kinds if role == "decode" or kinds[n] == "gpu")
    sizes = space.decode_batch_sizes if role == "decode" else None
    for device in allowed:
        for tp in space.tps:
            for size in sizes or (None,):
                changes = {f"cluster.{role}.device": device, f"cluster.{role}.tp": tp}
                if size is not None:
                    changes[f"cluster.{role}.max_batch_size"] = size
                try:
                    cap = phase_capacity(base.replace(**changes), role, *lengths)
                except ConfigError as exc:
                    _prune(pruned, exc)
                    continue
                for n in _counts(rate, target, cap, cap, space, pruned):
                    options.append(({**changes, f"cluster.{role}.num_instances": n},
                                    n * cap, kinds[device]))
    return options


def _aggregated(base: RunConfig, space: Space, rate: float, target: float, kinds: dict,
                lengths: tuple, pruned: dict) -> list:
    """Aggregated candidates: each device at each TP, with the KV dtype of the base's
    disaggregated prefill side where the device runs it (the same KV precision on both
    shapes), N instances (``_counts`` between ``aggregated_capacity``'s two bounds)."""
    from hardware.catalog import devices

    agg = with_kind(base, "aggregated")
    kv_dtype = with_kind(base, "disaggregated").cluster.prefill.kv_dtype
    if base.cluster.kind == "aggregated":
        kv_dtype = base.cluster.aggregated.kv_dtype
    out = []
    for device in space.aggregated_devices or tuple(kinds):
        same = ({"cluster.aggregated.kv_dtype": kv_dtype}
                if kv_dtype in devices()[device].serving.kv_dtypes else {})
        for tp in space.tps:
            changes = {"cluster.aggregated.device": device, "cluster.aggregated.tp": tp,
                       **same, "workload.rate": rate}
            try:
                config = agg.replace(**changes)
                high, low = aggregated_capacity(config, *lengths)
            except ConfigError as exc:
                _prune(pruned, exc)
                continue
            for n in _counts(rate, target, high, low, space, pruned):
                out.append(([config.replace(**{"cluster.aggregated.num_instances": n})],
                             n * high))
    return out
