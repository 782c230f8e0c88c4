"""What the ``hawk`` commands share on their command lines: the common flags (``--config``,
``--workload``, ``--policy KIND=NAME`` ...) and the run configuration they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from sim.config import RunConfig, load_config
from sim.models.transfer import MECHANISMS
from traces.workloads import WORKLOADS


def config_from_args(args) -> RunConfig:
    config = load_config(args.config) if args.config else RunConfig()
    changes = {}
    if args.workload is not None:
        changes["workload.name"] = args.workload
        if args.ttft_slo is None and args.tpot_slo is None:
            spec = WORKLOADS[args.workload]
            changes.update({"slo.ttft_s": spec.ttft_slo_s, "slo.tpot_s": spec.tpot_slo_s})
    for flag, key in (("rate", "workload.rate"), ("seed", "seed"), ("ttft_slo", "slo.ttft_s"),
                      ("tpot_slo", "slo.tpot_s")):
        if getattr(args, flag, None) is not None:
            changes[key] = getattr(args, flag)
    if getattr(args, "num_requests", None) is not None:
        changes["workload.num_requests"] = args.num_requests
    if getattr(args, "duration", None) is not None:
        changes["workload.duration_s"] = args.duration
        if getattr(args, "num_requests", None) is None:
            changes["workload.num_requests"] = None
    if getattr(args, "mechanism", None) is not None:
        changes["cluster.link.mechanism"] = args.mechanism
    if getattr(args, "oracle", False):
        changes["cluster.fast_forward"] = False
    if getattr(args, "profile", None) is not None:
        from sim.models.profile_dir import load_profile_dir

        load_profile_dir(args.profile)      # a missing or bad directory is named here
        changes["cluster.profile"] = str(args.profile)
    if getattr(args, "cells", None) is not None:
        changes["cells.count"] = args.cells
    if getattr(args, "cell_instances", None) is not None:
        changes["cells.instances"] = args.cell_instances
    changes.update(policy_changes(getattr(args, "policy", None) or []))
    return config.replace(**changes) if changes else config


#: ``--policy KIND=NAME`` -> the config key it sets (``policies`` lists the names)
POLICY_KEYS = {"routing": "cluster.routing", "decode_routing": "cluster.decode_routing",
               "prefill_batching": "cluster.policies.prefill_batching",
               "fairness": "cluster.policies.fairness",
               "admission": "cluster.decode.admission"}


def policy_changes(assignments: list[str]) -> dict:
    """Config changes of ``--policy`` flags, each name checked against its kind."""
    from policies import canonical, parse_assignment, resolve

    changes = {}
    for text in assignments:
        kind, name = parse_assignment(text)
        resolve(kind, name)
        changes[POLICY_KEYS[kind]] = canonical(kind, name)
    return changes


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML run configuration")
    p.add_argument("--workload", choices=sorted(WORKLOADS), help="paper workload (default chatbot)")
    p.add_argument("--num-requests", type=int, help="requests to simulate (default 2000)")
    p.add_argument("--duration", type=float, help="seconds of arrivals instead of a count")
    p.add_argument("--seed", type=int, help="random seed (default 0)")
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO in seconds")
    p.add_argument("--tpot-slo", type=float, help="TPOT SLO in seconds")
    p.add_argument("--mechanism", choices=sorted(MECHANISMS),
                   help="KV transfer mechanism (default GN-HAWK)")
    p.add_argument("--policy", action="append", metavar="KIND=NAME",
                   help="a serving policy by name or module:function, e.g. routing=least-work, "
                        "prefill_batching=chunked, fairness=weighted_fair (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def add_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="a measured profile directory (hawk real profile --out DIR): time the "
                        "run by its tables, on a cluster that mirrors the real mode's")
