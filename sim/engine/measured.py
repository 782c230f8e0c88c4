"""The simulator's parts from a measured profile directory (``sim.models.profile_dir``).

``measured_parts(config)`` is what ``sim.engine.cluster.simulate`` takes instead of the catalogs when
``cluster.profile`` names a directory: the tables as a ``TablePredictor``, the transfer time per
request interpolated in bytes (``MeasuredPricing``), pulls one at a time (``SerialLink``, as the
decode worker's puller thread), the KV capacities of [serving], and power from the paper
profile's tables of the catalog devices the workers stand for. A profile of one engine serving
both phases (``[serving] engine = "aggregated"``, ``hawk profile --endpoint``) gives an
aggregated instance its predictor (``mixed_step_time`` of the table), its KV blocks and the
API latency its records are shifted by; it has no transfer pricing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import simpy
from simpy.events import Timeout

from sim.config import ConfigError
from sim.models.profile_dir import MeasuredProfile, TransferTable, is_profile_dir, load_profile_dir


class MeasuredPricing:
    """``sim.models.transfer``'s pricing interface over transfer.csv: one request's KV takes the
    measured seconds of its bytes (times the serving loop's transfer factor for the mechanism
    the profile's session ran), all before the KV lands (``before_s``, served one at a time
    by ``SerialLink``); nothing is paid by the prefill engine and nothing slows decode."""

    save_time = None
    host_slowdown = 1.0

    def __init__(self, profile: MeasuredProfile, mechanism: str):
        if mechanism not in profile.transfer:
            raise ConfigError(f"{Path(profile.path) / 'transfer.csv'}: no points for "
                                  f"mechanism {mechanism}; it measured "
                                  f"{sorted(profile.transfer)}")
        self.profile, self.table = profile, TransferTable(profile.transfer[mechanism])
        # the serving loop's pulls over the table's (loop.csv), for the mechanism it ran
        self.factor = (profile.loop["transfer"][0] if mechanism == profile.default_mechanism
                       else 1.0)

    def price(self, num_tokens: int):
        from sim.models.transfer import TransferCost

        nbytes = self.profile.kv_bytes(int(num_tokens))
        return TransferCost(before_s=self.factor * self.table(nbytes), wire_bytes=nbytes,
                            after_s=0.0, host_cpu_s=0.0, num_writes=0)


class SerialLink:
    """A decode worker's puller: one transfer at a time, first come first served, each taking
    its ``before_s`` (the measured seconds); the bytes are counted, not timed. The same
    interface as ``sim.engine.link.KVLink``; a transfer's ``arg`` starts with its request, whose
    ``transfer_start_at`` becomes the instant its pull begins (the real worker's stamp)."""

    def __init__(self, env: simpy.Environment, ledger):
        self.env, self.ledger = env, ledger
        self.free_at = 0.0
        self.busy_time = 0.0
        self.bytes_moved = 0.0
        self.num_active = 0

    def start(self, before_s: float, wire_bytes: float, on_done, arg, host=None,
              host_s: float = 0.0) -> None:
        now = self.env.now
        begin = self.free_at if self.free_at > now else now
        self.ledger.transfer_start_at[arg[0]] = begin
        self.free_at = begin + before_s
        self.busy_time += before_s
        self.bytes_moved += float(wire_bytes)
        self.num_active += 1
        Timeout(self.env, self.free_at - now).callbacks.append(
            lambda _ev: self._done(on_done, arg))

    def _done(self, on_done, arg) -> None:
        self.num_active -= 1
        on_done(arg)

    def busy_within(self, t: float) -> float:
        """Seconds of [0, t] with a pull running (``t`` = now, the end of a run)."""
        return self.busy_time - max(0.0, self.free_at - t)


@dataclass
class MeasuredParts:
    """What ``sim.engine.cluster.simulate`` takes from a measured profile instead of the catalogs."""

    profile: MeasuredProfile
    predictor: object
    pricing: MeasuredPricing
    prefill_blocks: int
    decode_blocks: int
    tables: dict                    # [power], [price], [cost] of the paper profile

    @property
    def api_latency_s(self) -> float:
        """The API server's and the client's round trip beside the engine's steps ([serving]
        api_latency_s; 0 for the real mode's workers): it delays every request's first token
        and finish alike (the engine, seeing every arrival that much later, runs the same
        steps that much later)."""
        return self.profile.serving["api_latency_s"]

    @property
    def frontend_request_s(self) -> float:
        """Seconds the engine's front end (its API server, and the client on the same host)
        spends on each request before the engine sees it, one request at a time ([serving]
        frontend_request_s of ``hawk profile --endpoint``; 0 when not measured): requests
        arriving faster than that queue there (``sim.engine.pools.frontend_arrivals``)."""
        return self.profile.serving.get("frontend_request_s", 0.0)

    @property
    def frontend_token_s(self) -> float:
        """Seconds the front end spends streaming each token ([serving] frontend_token_s:
        the API server's CPU per token over the decode points; 0 when not measured)."""
        return self.profile.serving.get("frontend_token_s", 0.0)

    @property
    def has_front_end(self) -> bool:
        """Whether the profile measured more of the front end than a constant latency."""
        s = self.profile.serving
        return bool(s.get("frontend_request_s") or s.get("frontend_token_s")
                    or s.get("api_latency_samples_s"))

    def request_latencies(self, n: int, seed: int):
        """Each of ``n`` requests' round trip beside the engine: drawn (seeded by ``seed``)
        from the floor's measured ones ([serving] api_latency_samples_s, one per floor
        request), so a stall the floor met now and then meets the requests as often; the
        constant ``api_latency_s`` when the profile has no samples."""
        import numpy as np

        samples = self.profile.serving["api_latency_samples_s"]
        if not samples:
            return np.full(n, self.api_latency_s)
        return np.random.default_rng(seed).choice(np.asarray(samples, dtype=float), size=n)

    @property
    def request_overhead_s(self) -> float:
        """Seconds each request adds to the step that admits it beyond the table's price of
        its prefill there: the churn point's cost per request ([serving] request_churn_s)
        less what ``mixed_step_time`` charges a one-token prompt joining that point's step
        (never below 0; 0 when not measured)."""
        s = self.profile.serving
        if not s.get("request_churn_s"):
            return 0.0
        context = [s["churn_context"]] * s["churn_batch"]
        priced = (self.predictor.mixed_step_time([(1, 0)], context)
                  - self.predictor.mixed_step_time([], context))
        return max(0.0, s["request_churn_s"] - priced)

    def restore_time(self, tokens: int, how: str) -> float:
        """A preempted request's KV back: recomputed, priced by the prefill table (the real
        workers never preempt: they reserve up front; swap has no measured PCIe figure)."""
        if how != "recompute":
            raise ConfigError("cluster.decode.admission: a measured profile has no PCIe figure "
                              "to swap KV with; use oracle-reserve (as the real workers) or "
                              "on-demand-recompute")
        return self.predictor.prefill_time([tokens])

    def extrapolation(self) -> dict:
        """Axes where the run left the measured ranges (empty when none did)."""
        out = self.predictor.extrapolated()
        if self.pricing is None:
            return out
        table = self.pricing.table
        if table.seen is not None and (table.seen[0] < table.range[0]
                                       or table.seen[1] > table.range[1]):
            out["transfer_bytes"] = {"measured": list(table.range), "used": table.seen}
        return out


def measured_parts(config) -> MeasuredParts | None:
    """The measured parts of a run whose ``cluster.profile`` is a directory, else None."""
    cl = config.cluster
    if not is_profile_dir(cl.profile):
        return None
    from sim.models.predictor import load_profile_table

    profile = load_profile_dir(cl.profile)
    s = profile.serving
    tables = {k: v for k, v in load_profile_table("paper").items()
              if k in ("power", "price", "cost")}
    if s["engine"] == "aggregated":         # one engine, both phases: no KV moves
        if cl.kind != "aggregated":
            raise ConfigError(f"cluster.kind = {cl.kind!r}: the profile {cl.profile} measured "
                              f"one engine serving both phases ([serving] engine = "
                              f"\"aggregated\"); leave cluster.kind unset or \"aggregated\"")
        return MeasuredParts(profile, profile.predictor(), None, 0,
                             -(-s["num_kv_tokens"] // cl.aggregated.block_size), tables)
    return MeasuredParts(profile, profile.predictor(),
                         MeasuredPricing(profile, cl.link.mechanism), s["prefill_num_blocks"],
                         -(-s["num_kv_tokens"] // cl.decode.block_size), tables)


class ChurnPriced:
    """A predictor whose mixed steps cost ``overhead_s`` more per request whose prompt starts
    in them (a first chunk: nothing of it computed before); everything else is ``base``'s."""

    def __init__(self, base, overhead_s: float):
        self.base, self.overhead_s = base, overhead_s

    def __getattr__(self, name):
        return getattr(self.base, name)

    def mixed_step_time(self, prefill_chunks, decode_contexts) -> float:
        new = sum(1 for _, computed in prefill_chunks if computed == 0)
        return self.base.mixed_step_time(prefill_chunks, decode_contexts) + new * self.overhead_s

    def mixed_step(self, prefill_chunks, decode_contexts) -> tuple[float, bool]:
        t, bound = self.base.mixed_step(prefill_chunks, decode_contexts)
        new = sum(1 for _, computed in prefill_chunks if computed == 0)
        return t + new * self.overhead_s, bound
