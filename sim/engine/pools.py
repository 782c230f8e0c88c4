"""Aggregated pools: the aggregated instances of a ``[cluster]``, their arrivals, stats and
energy, for ``sim.engine.cluster.simulate`` (``kind = "aggregated"``: ``aggregated_pool`` and
``start_arrivals``; ``kind = "both"``: ``beside_pd``, the pool and a
``sim.engine.router.PoolRouter`` beside the P/D pool).

An aggregated instance takes its KV blocks from the device memory left after the weights
(``kv_capacity_blocks``, as a decode instance does) and its timing from the same predictors
(``make_predictor``): the roofline's or a table's ``mixed_step_time``. No KV moves, so the
records' transfer fields stay NaN and ``kv_bytes`` 0, and ``prefill_instance`` =
``decode_instance`` = the aggregated instance's index. The stats keep the P/D run's keys
(an aggregated instance counts as both a prefill and a decode one: ``prefill_busy_s`` and
``decode_busy_s`` both hold its busy time) plus ``aggregated_*`` ones.
"""

from __future__ import annotations

import math

import numpy as np

from policies import resolve
from sim.config import ConfigError, RunConfig
from sim.engine.aggregated import AggregatedInstance
from sim.engine.router import LazyArrivals, PoolRouter
from sim.models.power import StepMeter


def aggregated_pool(env, config: RunConfig, ledger, predictor, blocks: int, trace=None,
                    index_offset: int = 0) -> list[AggregatedInstance]:
    """The ``[cluster.aggregated]`` instances of ``config``, each of ``blocks`` KV blocks
    timed by ``predictor`` (``sim.engine.cluster`` prices both); ``trace`` (when given) is
    checked to fit one instance's KV cache."""
    cl = config.cluster
    inst = cl.aggregated
    if trace is not None and len(trace):
        longest = int((trace.num_prompt_tokens + trace.num_output_tokens).max())
        if -(-longest // inst.block_size) > blocks:
            raise ConfigError(
                f"cluster.aggregated: {blocks} KV blocks of {inst.block_size} tokens hold "
                f"{blocks * inst.block_size} tokens, but the workload's longest request "
                f"(prompt + output) has {longest}; raise kv_cache_gb or max_num_blocks, tp, "
                f"or choose a smaller kv_dtype")
    pol = cl.policies
    fair = None if pol.fairness == "fcfs" else resolve("fairness", pol.fairness)
    return [AggregatedInstance(env, k, ledger, StepMeter(predictor),
                               max_batch_size=inst.max_batch_size,
                               max_batch_tokens=inst.max_batch_tokens, num_blocks=blocks,
                               block_size=inst.block_size, fast_forward=cl.fast_forward,
                               fairness=fair(pol.tenant_weights, pol.priority_tenants)
                               if fair else None, record_index=index_offset + k)
            for k in range(inst.num_instances)]


def start_arrivals(env, config: RunConfig, ledger, pool: list, max_context: int) -> None:
    """Arrivals of a ``kind = "aggregated"`` run: lazily for a lone instance, else routed
    at each instant; and the instance losses of ``[faults]``."""
    check_faults(config, len(pool))
    if len(pool) == 1:
        LazyArrivals(ledger, pool[0], max_context)
    else:
        PoolRouter(env, ledger, pool, resolve("routing", config.cluster.routing), max_context)
    for index, at in config.faults.instance_loss:
        pool[index].ahead = False             # nothing committed past a loss
        env.timeout(at).callbacks.append(lambda _ev, a=pool[index]: a.lose())


def check_faults(config: RunConfig, num_instances: int) -> None:
    """Only instance loss applies to an aggregated cluster: it moves no KV cache."""
    f = config.faults
    if f.transfer_failure_prob or f.link_down:
        raise ConfigError("faults.transfer_failure_prob / faults.link_down: an aggregated "
                          "cluster moves no KV cache; only faults.instance_loss applies")
    for k, (index, _at) in enumerate(f.instance_loss):
        if index >= num_instances:
            raise ConfigError(f"faults.instance_loss[{k}]: index {index}, but the cluster "
                              f"has {num_instances} aggregated instance(s)")


def records_and_summary(config: RunConfig, ledger, until, streamed: bool) -> tuple:
    """(records or None when streamed, ``metrics.summarize``'s summary with its tenants)."""
    from traces import metrics
    from traces.tenants import by_tenant

    if streamed:
        ledger.close()
        summary, tenants = ledger.summary()
        records = None
    else:
        records = ledger.frame(cut_at=until)
        summary = metrics.summarize(records, config.slo.ttft_s, config.slo.tpot_s)
        tenants = by_tenant(records, config.slo.ttft_s, config.slo.tpot_s)
    if tenants is not None:
        summary["tenants"] = tenants
    return records, summary


def pool_stats(pool: list, now: float) -> dict:
    """The run's stats in the P/D run's keys (no link), plus the aggregated ones."""
    busy = [a.busy_within(now) for a in pool]
    return {"prefill_busy_s": busy, "decode_busy_s": busy,
            "prefill_batches": [a.num_steps for a in pool],
            "decode_iterations": [a.num_steps for a in pool],
            "decode_wakeups": [a.num_wakeups for a in pool],
            "link_busy_s": 0.0, "link_bytes": 0,
            "decode_capacity_blocks": pool[0].num_blocks if pool else 0,
            "decode_preemptions": [a.num_preemptions for a in pool],
            "failed_transfer_attempts": 0, "in_system": [],
            **aggregated_stats(pool, now)}


def aggregated_stats(pool: list, now: float) -> dict:
    busy = [a.busy_within(now) for a in pool]
    return {"aggregated_busy_s": busy,
            "aggregated_compute_bound_s": [min(a.predictor.compute_bound_s, b)
                                           for a, b in zip(pool, busy)],
            "aggregated_steps": [a.num_steps for a in pool],
            "aggregated_wakeups": [a.num_wakeups for a in pool],
            "aggregated_preemptions": [a.num_preemptions for a in pool],
            "aggregated_capacity_blocks": pool[0].num_blocks if pool else 0,
            "aggregated_blocks_in_use": [a.num_blocks - a.free_blocks for a in pool]}


def delay_outputs(ledger, delay_s: float) -> None:
    """Every instant after a request's arrival ``delay_s`` later: a constant delay before
    the engine (the API server's, a measured profile's ``api_latency_s``) shifts every step
    the engine runs by as much, arrivals being all that drives it."""
    for name in ("prefill_start_at", "prefill_end_at", "first_token_at", "finished_at"):
        column = getattr(ledger, name)
        for i, value in enumerate(column):
            column[i] = value + delay_s          # NaN (never reached) stays NaN


def beside_pd(env, config: RunConfig, ledger, prefills: list, decodes: list,
              max_context: int, predictor, blocks: int) -> list[AggregatedInstance]:
    """``kind = "both"``: the aggregated pool and the router over it and the P/D pool.
    Its instances' record index follows the P/D instances' (from max(prefill, decode
    instances)), so the records tell the pools apart."""
    from policies.routing import POOL_ROUTING

    cl = config.cluster
    offset = max(len(prefills), len(decodes))
    pool = aggregated_pool(env, config, ledger, predictor, blocks, index_offset=offset)
    choose = POOL_ROUTING[cl.pool_routing]
    if cl.pool_routing == "share":
        choose = choose(cl.aggregated_share)
    devices = (cl.aggregated.tp * cl.aggregated.num_instances,
               cl.prefill.tp * cl.prefill.num_instances + cl.decode.tp * cl.decode.num_instances)
    PoolRouter(env, ledger, pool, resolve("routing", cl.routing), max_context,
               prefills=prefills, decodes=decodes, pool_route=choose, devices=devices)
    return pool


def add_pool(summary: dict, stats: dict, pool: list, config: RunConfig, now: float,
             records=None) -> None:
    """A ``kind = "both"`` run's stats and summary with its aggregated pool (its energy and
    cost are the cost model's, over every pool: ``sim.models.power``, ``sim.models.cost``)."""
    stats.update(aggregated_stats(pool, now))
    offset = pool[0].record_index if pool else 0
    summary.update(pool_use(stats, records, config, now, offset))


def pool_use(stats: dict, records, config: RunConfig, span: float, offset: int = 0) -> dict:
    """How full the aggregated pool ran: its busy share (``aggregated_utilization``), the
    mean share of its KV blocks and of its batch slots in use (``aggregated_kv_use``,
    ``aggregated_slot_use``), and which of the three is highest (``aggregated_bottleneck``).

    The last two come from the records (Little's law; NaN for a streamed run): a request
    holds a batch slot from its first step to its end, its prompt's KV from its first step
    and its outputs' as they are generated (half of them on average over its decode).
    Preemptions and block rounding are left out, so it is an estimate."""
    inst = config.cluster.aggregated
    n = max(len(stats["aggregated_busy_s"]), 1)
    busy = sum(stats["aggregated_busy_s"]) / n / span if span > 0 else math.nan
    kv = slots = math.nan
    if records is not None and span > 0:
        mine = records[records["prefill_instance"].to_numpy() >= offset]
        start = mine["prefill_start_at"].to_numpy(dtype=float)
        first = mine["first_token_at"].to_numpy(dtype=float)
        end = np.where(np.isnan(mine["finished_at"].to_numpy(dtype=float)), first,
                       mine["finished_at"].to_numpy(dtype=float))
        prompt = mine["num_prompt_tokens"].to_numpy(dtype=float)
        output = mine["num_output_tokens"].to_numpy(dtype=float)
        held = np.nansum((first - start) * prompt + (end - first) * (prompt + output / 2))
        kv = float(held) / (span * n * stats["aggregated_capacity_blocks"] * inst.block_size)
        slots = float(np.nansum(end - start)) / (span * n * inst.max_batch_size)
    shares = {"steps": busy, "kv_blocks": kv, "batch_slots": slots}
    known = {k: v for k, v in shares.items() if not math.isnan(v)}
    return {"aggregated_utilization": busy, "aggregated_kv_use": kv,
            "aggregated_slot_use": slots,
            "aggregated_bottleneck": max(known, key=known.get) if known else None}


def describe_pools(cluster) -> str:
    """One line naming a cluster's pools, for a run's summary."""
    a = cluster.aggregated
    text = (f"aggregated {a.num_instances}x({a.tp}x {a.device}; {a.max_batch_size} seqs, "
            f"{a.max_batch_tokens} tokens a step)")
    if cluster.kind == "both":
        p, d = cluster.prefill, cluster.decode
        text += (f" beside prefill {p.num_instances}x({p.tp}x {p.device}) -> decode "
                 f"{d.num_instances}x({d.tp}x {d.device}) via {cluster.link.mechanism}, "
                 f"pools by {cluster.pool_routing}")
    return text
