"""Build a simulated cluster from a ``RunConfig`` and run a trace through it.

``simulate(config)`` is the one entry point: it makes the workload (or takes a trace), wires
router -> prefill instances -> KV link -> decode instances, runs SimPy to completion, and
returns a ``RunResult`` with the records table and the summary metrics.
"""

from __future__ import annotations

import dataclasses

import math
import time
from dataclasses import dataclass, field

import simpy

from hardware import catalog
from policies import resolve
from traces import metrics
from traces.tenants import by_tenant
from sim.config import ConfigError, InstanceConfig, RunConfig, provenance
from sim.engine import pools
from sim.engine.decode import DecodeInstance
from sim.engine.ledger import Ledger
from sim.engine.link import KVLink
from sim.engine.memory import make_pool, pool_for
from sim.models.predictor import Predictor, load_profile
from sim.models.rooflines import roofline
from sim.engine.prefill import PrefillInstance
from sim.engine.prefix_cache import make_cache, summary_of as prefix_summary, \
    totals as prefix_totals
from sim.engine.measured import SerialLink, measured_parts
from sim.engine.router import Router
from sim.engine.timers import run_events
from sim.config.run_size import check_run_size, expected_num_requests
from sim.models.transfer import pricing_for, transfer_params
from traces.trace import Trace
from traces.workloads import make_workload


@dataclass
class RunResult:
    config: RunConfig
    records: object                 # pandas DataFrame, traces.schema columns
    summary: dict
    stats: dict = field(default_factory=dict)
    aggregate: object = None        # a streamed run's traces.aggregate.RecordsAggregate


def make_predictor(config: RunConfig, inst: InstanceConfig) -> Predictor:
    cluster = config.cluster
    profile = load_profile(cluster.profile)
    if inst.device not in profile:
        raise ConfigError(f"profile {cluster.profile!r} has no efficiency table for device "
                          f"{inst.device!r}")
    return roofline(catalog.model(cluster.model), catalog.device(inst.device), inst.tp,
                    profile[inst.device], inst.weight_format, inst.kv_dtype)


def kv_capacity_blocks(config: RunConfig, inst: InstanceConfig) -> int:
    """KV blocks of one instance: usable device memory minus weights, in blocks.

    Raises ``ConfigError`` when the weights alone do not fit."""
    model = catalog.model(config.cluster.model)
    dev = catalog.device(inst.device)
    usable = dev.memory_bytes * inst.tp * inst.memory_utilization
    weights = model.weight_bytes(inst.weight_format)
    if weights >= usable:
        raise ConfigError(
            f"cluster.{inst.role}: {model.name} weights in {inst.weight_format} take "
            f"{weights / 1e9:.1f} GB, but {inst.tp}x {dev.name} offer {usable / 1e9:.1f} GB "
            f"(memory_utilization {inst.memory_utilization}); raise tp or choose a smaller "
            f"weight_format")
    free = usable - weights
    if inst.kv_cache_gb:                # None or 0: no cap
        free = min(free, inst.kv_cache_gb * 1e9)
    block_bytes = model.kv_block_bytes(inst.kv_dtype, inst.block_size, inst.tp)
    blocks = int(free // block_bytes)
    if inst.max_num_blocks and inst.max_num_blocks > blocks:   # None or 0: memory decides
        raise ConfigError(f"cluster.{inst.role}.max_num_blocks = {inst.max_num_blocks}, but only "
                          f"{blocks} blocks of {block_bytes / 1e6:.2f} MB fit in the "
                          f"{free / 1e9:.1f} GB left for the KV cache")
    return inst.max_num_blocks or blocks


def workload_trace(config: RunConfig) -> Trace:
    w = config.workload
    if w.trace is not None:
        from traces.loaders import load_trace

        trace, _report = load_trace(w.trace, max_requests=w.num_requests)
        if w.num_requests is not None:
            trace = trace.head(w.num_requests)
        return trace.until(w.duration_s) if w.duration_s is not None else trace
    check_run_size(expected_num_requests(w), what="workload")
    return make_workload(w.name, w.rate, w.num_requests, w.duration_s, seed=config.seed)


@dataclass
class _Parts:
    """What a run is built from: the catalogs and a named profile, or a measured profile
    directory (``sim.engine.measured``)."""

    model: object
    predictors: tuple
    pricing: object
    blocks: tuple                   # (prefill send-buffer blocks, decode pool blocks)
    make_link: object               # (env, ledger) -> the link of one decode node
    make_pool: object               # decode blocks -> the decode pool
    restore_time: object
    measured: object = None         # sim.engine.measured.MeasuredParts, or None


def _parts(config: RunConfig, predictors, pricing) -> _Parts:
    cl = config.cluster
    m = measured_parts(config)
    if m is not None:
        return _Parts(m.profile.model, predictors or (m.predictor, m.predictor),
                      pricing or m.pricing, (m.prefill_blocks, m.decode_blocks), SerialLink,
                      lambda n: make_pool("block", n, cl.decode.block_size), m.restore_time, m)
    predictors = predictors or (make_predictor(config, cl.prefill),
                                make_predictor(config, cl.decode))
    blocks = (kv_capacity_blocks(config, cl.prefill), kv_capacity_blocks(config, cl.decode))
    try:
        pricing = pricing or pricing_for(config)
    except ValueError as exc:
        raise ConfigError(f"cluster.link.mechanism: {exc}") from exc
    bandwidth_gb_s = cl.link.bandwidth_gb_s or transfer_params(cl.profile).wire_gb_s(
        cl.link.mechanism)
    return _Parts(catalog.model(cl.model), predictors, pricing, blocks,
                  lambda env, _: KVLink(env, bandwidth_gb_s * 1e9, cl.link.latency_s),
                  lambda n: pool_for(config, n), restore_time(config, predictors[1]))


def simulate(config: RunConfig | None = None, trace: Trace | None = None, *,
             until: float | None = None, predictors: tuple | None = None, pricing=None,
             monitor_interval_s: float | None = None, progress: bool = False,
             eager_arrivals: bool = False, stream=None) -> RunResult:
    """Run ``trace`` (default: the config's workload) through the configured cluster.

    ``until`` cuts the run at that simulated instant (open requests become ``unfinished``).
    ``predictors`` = (prefill, decode) replaces the roofline predictors (e.g. tables);
    ``pricing`` replaces the mechanism's transfer pricing (``price(num_tokens) -> cost``).
    ``monitor_interval_s`` samples the number of requests in the system at that interval
    (``stats["in_system"]``: (instant, count) pairs). ``progress`` shows a bar of arrivals
    on stderr for long runs (100,000 requests or more; only on a terminal).
    ``eager_arrivals`` gives every arrival its own timer even with one prefill instance (the
    reference that lazy admission is tested against). ``stream`` (a ``sim.engine.stream.Stream``)
    runs in bounded memory: requests load in chunks, records go to its Parquet dataset as
    they end, the summary comes from streaming aggregates and ``records`` is None."""
    config = config or RunConfig()
    if config.cells.count > 1:
        raise ConfigError(f"cells.count = {config.cells.count}: a run of cells goes through "
                          f"sim.runs.cells.run.simulate_cells (hawk simulate --cells); simulate() runs one "
                          f"router domain and would silently ignore the others")
    if stream is not None and any(getattr(config.cluster, role).prefix_caching
                                  for role in ("prefill", "decode", "aggregated")
                                  if getattr(config.cluster, role, None) is not None):
        raise ConfigError("prefix_caching: a streamed run does not carry the trace's prefix "
                          "hashes; run it without streaming (--no-stream)")
    if config.cluster.kind == "aggregated":      # no P/D pool (sim.engine.pools)
        return _simulate_aggregated(config, trace, until, predictors, stream)
    if stream is None:
        trace = trace if trace is not None else workload_trace(config)
        check_run_size(len(trace), what=f"a trace of {len(trace):,} requests")
    cl = config.cluster
    parts = _parts(config, predictors, pricing)
    model, (prefill_pred, decode_pred), pricing = parts.model, parts.predictors, parts.pricing
    prefill_blocks, decode_blocks = parts.blocks
    measured = parts.measured

    wall = time.perf_counter()
    env = simpy.Environment()
    if stream is None:
        ledger = Ledger(trace)
    else:
        from sim.engine.stream import open_ledger

        ledger = open_ledger(config, trace, stream, until, monitor_interval_s is not None)
    # each decode node pulls through its own NIC (sim.engine.link: nodes meet at a switch); a
    # measured profile's decode worker pulls one request at a time (sim.engine.measured)
    links = [parts.make_link(env, ledger) for _ in range(cl.decode.num_instances)]
    decode_route = resolve("decode_routing", cl.decode_routing)
    decodes = [DecodeInstance(env, k, ledger, decode_pred, links[k],
                              memory=parts.make_pool(decode_blocks),
                              pricing=pricing,
                              max_batch_size=cl.decode.max_batch_size,
                              host_slowdown=getattr(pricing, "host_slowdown", 1.0),
                              fast_forward=cl.fast_forward, admission=cl.decode.admission,
                              max_tokens=min(model.max_context,
                                             decode_blocks * cl.decode.block_size),
                              restore_time=parts.restore_time)
               for k in range(cl.decode.num_instances)]
    for d in decodes if cl.decode.prefix_caching else ():   # pulls only what it lacks
        d.prefix = make_cache(trace, decode_blocks * cl.decode.block_size)
    counter = [0]

    faulty = config.faults.active

    def route_to_decode(i: int, source) -> None:
        live = [d for d in decodes if not d.lost] or decodes if faulty else decodes
        k = decode_route([d.load for d in live], [_free_blocks(d.memory) for d in live],
                         counter[0])
        counter[0] += 1
        live[k].offer(i, source)

    # With one decode instance there is nothing to decide.
    to_decode = decodes[0].offer if len(decodes) == 1 else route_to_decode

    pol = cl.policies          # FCFS batching and arrival order: the prefill fast path
    pick = None if pol.prefill_batching == "fcfs" else resolve("prefill_batching",
                                                                pol.prefill_batching)
    make_fair = None if pol.fairness == "fcfs" else resolve("fairness", pol.fairness)
    prefills = [PrefillInstance(env, k, ledger, prefill_pred,
                                max_batch_size=cl.prefill.max_batch_size,
                                max_batch_tokens=cl.prefill.max_batch_tokens,
                                buffer_blocks=prefill_blocks, block_size=cl.prefill.block_size,
                                on_prefilled=to_decode, pick=pick,
                                fairness=make_fair(pol.tenant_weights, pol.priority_tenants)
                                if make_fair else None,
                                prefix=make_cache(trace, prefill_blocks * cl.prefill.block_size)
                                if cl.prefill.prefix_caching else None)
                for k in range(cl.prefill.num_instances)]
    for p in prefills:           # a host-staged save blocks the prefill engine (sim.models.transfer)
        p.save_time = getattr(pricing, "save_time", None)
    bar = None
    if progress and ledger.n >= 100_000:
        from tqdm import tqdm

        bar = tqdm(total=ledger.n, desc="arrivals", unit="req", disable=None, leave=False)
    pool = None                  # kind "both": an aggregated pool beside (sim.engine.pools)
    if cl.kind == "both":
        pool = pools.beside_pd(env, config, ledger, prefills, decodes, model.max_context,
                               make_predictor(config, cl.aggregated),
                               kv_capacity_blocks(config, cl.aggregated))
        for a in pool if monitor_interval_s is not None else ():
            a.ahead = False           # the monitor counts requests ended by now
    else:
        Router(env, ledger, prefills, decodes, resolve("routing", cl.routing),
               model.max_context, bar, eager=eager_arrivals)
    samples: list[tuple[float, int]] = []
    if monitor_interval_s is not None:
        env.process(_monitor(env, ledger, monitor_interval_s, samples))
    if faulty:
        _inject_faults(env, config, decodes, route_to_decode)
    try:
        run_events(env, until)
    except BaseException as exc:
        if stream is not None:              # the records so far stay readable
            ledger.close(exc)
        raise
    if bar is not None:
        bar.close()
    if stream is None:
        records = ledger.frame(cut_at=until)
        summary = metrics.summarize(records, config.slo.ttft_s, config.slo.tpot_s)
        tenants = by_tenant(records, config.slo.ttft_s, config.slo.tpot_s)
        in_decode = metrics.mean_in_decode(records, float(env.now))
    else:
        records = None
        ledger.close()
        summary, tenants = ledger.summary()
        in_decode = ledger.aggregate.decode_span_s / float(env.now) if env.now > 0 else math.nan
    wall = time.perf_counter() - wall
    if tenants is not None:
        summary["tenants"] = tenants
    summary["sim_wall_time_s"] = wall
    summary["simulated_time_s"] = float(env.now)
    stats = {
        "prefill_busy_s": [p.busy_within(env.now) for p in prefills],
        "prefill_batches": [p.num_batches for p in prefills],
        "decode_busy_s": [d.busy_within(env.now) for d in decodes],
        "decode_iterations": [d.num_iterations for d in decodes],
        "decode_wakeups": [d.num_wakeups for d in decodes],
        "link_busy_s": max(link.busy_within(env.now) for link in links),   # busiest NIC
        "link_bytes": sum(link.bytes_moved for link in links),
        "prefill_buffer_blocks": prefill_blocks,
        "decode_capacity_blocks": decode_blocks,
        "decode_memory": [d.memory.stats() for d in decodes],
        "decode_preemptions": [d.num_preemptions for d in decodes],
        "failed_transfer_attempts": decodes[0].faults.num_failed_attempts if faulty else 0,
        "in_system": samples,
    }
    slots = config.cluster.decode.num_instances * config.cluster.decode.max_batch_size
    occupancy = in_decode / slots
    summary.update(metrics.utilization(stats, float(env.now), occupancy))
    caches = [p.prefix for p in prefills + (pool or []) if p.prefix is not None]
    if caches:
        stats["prefix_cache"] = prefix_totals(caches)
        summary.update(prefix_summary(stats["prefix_cache"]))
    if decodes[0].prefix is not None:
        stats["decode_prefix_cache"] = prefix_totals([d.prefix for d in decodes])
        summary.update(prefix_summary(stats["decode_prefix_cache"], "decode_"))
    if pool is not None:             # its stats first: the cost model prices every pool
        pools.add_pool(summary, stats, pool, config, float(env.now), records)
    summary.update(_power_and_cost(stats, summary, config,
                                   measured.tables if measured is not None else None))
    if measured is not None:
        summary["profile"] = {"path": measured.profile.path,
                              "complete": measured.profile.complete,
                              "extrapolated": measured.extrapolation()}
    summary["config"] = provenance(config)      # every resolved value and where it came from
    return RunResult(config, records, summary, stats,
                     aggregate=None if stream is None else ledger.aggregate)


def _run_aggregated(config: RunConfig, trace, until, stream, predictor, m):
    """One run of the aggregated pool on ``trace``: (env, ledger, pool)."""
    inst = config.cluster.aggregated
    env = simpy.Environment()
    if stream is None:
        ledger = Ledger(trace)
    else:
        from sim.engine.stream import open_ledger

        ledger = open_ledger(config, trace, stream, until, False)
    pool = pools.aggregated_pool(env, config, ledger, predictor, m.decode_blocks if m is not None
                                 else kv_capacity_blocks(config, inst),
                                 trace if stream is None else None)
    pools.start_arrivals(env, config, ledger, pool, m.profile.model.max_context if m is not None
                         else catalog.model(config.cluster.model).max_context)
    try:
        run_events(env, until)
    except BaseException as exc:
        if stream is not None:
            ledger.close(exc)
        raise
    return env, ledger, pool


def _simulate_aggregated(config: RunConfig, trace, until, predictors, stream) -> RunResult:
    """``simulate`` for ``kind = "aggregated"``: the same records and summary keys
    (``sim.engine.pools``); ``predictors`` = (predictor, ...) replaces the roofline."""
    if stream is None:
        trace = trace if trace is not None else workload_trace(config)
        check_run_size(len(trace), what=f"a trace of {len(trace):,} requests")
    inst = config.cluster.aggregated
    m = measured_parts(config)          # an engine measured from outside (hawk profile)
    if m is not None and m.api_latency_s and stream is not None:
        raise ConfigError(f"cluster.profile {m.profile.path}: a streamed run cannot add the "
                          f"profile's API latency to its records; run it without streaming")
    predictor = predictors[0] if predictors else (
        m.predictor if m is not None else make_predictor(config, inst))
    if not predictors and m is not None and m.request_overhead_s:
        from sim.engine.measured import ChurnPriced

        predictor = ChurnPriced(predictor, m.request_overhead_s)
    wall = time.perf_counter()

    def run(arrival_at=None):
        return _run_aggregated(config, trace if arrival_at is None else dataclasses.replace(
            trace, arrival_at=arrival_at), until, stream, predictor, m)
    if m is not None and m.has_front_end:
        from sim.engine.frontend import through_front_end

        env, ledger, pool = through_front_end(run, trace, m, config.seed)
    else:
        env, ledger, pool = run()
        if m is not None and m.api_latency_s:
            pools.delay_outputs(ledger, m.api_latency_s)
    records, summary = pools.records_and_summary(config, ledger, until, stream is not None)
    summary["sim_wall_time_s"] = time.perf_counter() - wall
    summary["simulated_time_s"] = span = float(env.now)
    stats = pools.pool_stats(pool, span)
    summary.update(metrics.utilization(stats, span))
    summary.update(pools.pool_use(stats, records, config, span))
    if pool[0].prefix is not None:
        stats["prefix_cache"] = prefix_totals([a.prefix for a in pool])
        summary.update(prefix_summary(stats["prefix_cache"]))
    summary.update(_power_and_cost(stats, summary, config,
                                   m.tables if m is not None else None))
    if m is not None:
        summary["profile"] = {"path": m.profile.path, "complete": m.profile.complete,
                              "api_latency_s": m.api_latency_s,
                              "frontend_request_s": m.frontend_request_s,
                              "request_overhead_s": m.request_overhead_s,
                              "extrapolated": m.extrapolation()}
    summary["config"] = provenance(config)
    return RunResult(config, records, summary, stats,
                     aggregate=None if stream is None else ledger.aggregate)


def _power_and_cost(stats: dict, summary: dict, config: RunConfig,
                    tables: dict | None = None) -> dict:
    """Power and cost efficiency of the run under its profile (``sim.models.power``, ``sim.models.cost``),
    or under ``tables`` ([power], [price], [cost]) where given."""
    from sim.models.cost import run_cost
    from sim.models.power import run_energy

    energy = run_energy(stats, summary, config, tables)
    cost = run_cost(stats, summary, config, tables)
    out = {"energy_j": energy["energy_j"], "average_power_w": energy["average_power_w"],
           "tokens_per_joule": energy["tokens_per_joule"],
           "tokens_per_s_per_dollar": cost["tokens_per_s_per_dollar"],
           "usd_per_request": cost["usd_per_request"]}
    if "aggregated_energy_j" in energy:       # an aggregated pool's share of it
        out["aggregated_energy_j"] = energy["aggregated_energy_j"]
        out["aggregated_compute_bound_share"] = energy["aggregated_compute_bound_share"]
    return out


def _inject_faults(env, config: RunConfig, decodes: list, reroute) -> None:
    """Hand the decode instances the run's fault schedule (``sim.engine.faults``) and lose the
    instances ``[faults] instance_loss`` names at their instants."""
    from sim.engine.faults import Faults

    faults = Faults(config.faults, config.seed)
    for d in decodes:
        d.faults, d.reroute = faults, reroute
    for k, (index, at) in enumerate(config.faults.instance_loss):
        if index >= len(decodes):
            raise ConfigError(f"faults.instance_loss[{k}]: decode_index {index}, but the "
                              f"cluster has {len(decodes)} decode instance(s)")
        env.timeout(at).callbacks.append(lambda _ev, d=decodes[index]: d.lose())


def restore_time(config: RunConfig, predictor):
    """Seconds to give a preempted request its KV back on the decode instance
    (``policies.admission``): ``(tokens, "recompute")`` is a prefill-like pass of those tokens
    priced by the decode instance's predictor; ``(tokens, "swap")`` one copy of their KV
    between device and host memory, each device over its own PCIe link (the profile's
    ``[transfer]`` GPU or NPU PCIe bandwidth)."""
    from sim.models.transfer import transfer_params

    cl = config.cluster
    params = transfer_params(cl.profile)
    kind = catalog.device(cl.decode.device).kind
    pcie = (params.npu_pcie_gb_s if kind == "npu" else params.gpu_pcie_gb_s) * 1e9 * cl.decode.tp
    per_token = catalog.model(cl.model).kv_bytes_per_token(cl.decode.kv_dtype)

    def seconds(tokens: int, how: str) -> float:
        if how == "recompute":
            return predictor.prefill_time([tokens])
        return tokens * per_token / pcie

    return seconds


def _free_blocks(pool) -> int:
    """Free KV blocks of a decode pool for KV-aware routing; a bank grid without a count
    (``sim.engine.memory.SingleBufferPool``) offers its slot columns free in every bank."""
    free = getattr(pool, "free_blocks", None)
    return int(free) if free is not None else int((~pool.used.any(axis=0)).sum())


def _monitor(env, ledger, interval: float, samples: list):
    while ledger.num_ended < ledger.n:
        samples.append((env.now, ledger.num_in_system(env.now)))
        yield env.timeout(interval)
