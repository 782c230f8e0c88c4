"""What the ``hawk`` commands share on their command lines: the common flags (``--config``,
``--workload``, ``--policy KIND=NAME`` ...), the run configuration they make, and the size of
the work they start: ``--workers`` (at least 1), ``--max-wall-s`` and ``announce``, which
prints a long run's estimate on stderr and refuses one past the limit."""

from __future__ import annotations

import argparse
import sys
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
    if getattr(args, "model", None) is not None:
        changes["cluster.model"] = args.model
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
    if getattr(args, "prefix_caching", False):   # every pool
        kind = changes.get("cluster.kind", config.cluster.kind)
        roles = (("prefill", "decode") if kind != "aggregated" else ()) + (
            ("aggregated",) if kind != "disaggregated" else ())
        changes.update({f"cluster.{role}.prefix_caching": True for role in roles})
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
    p.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="workload (default chatbot; chatbot and summarization are the paper's, "
                        "code the Azure 2023 code trace's lengths)")
    p.add_argument("--model", metavar="NAME|CONFIG.json",
                   help="a catalog model (hardware/catalog/models.toml) or a Hugging Face "
                   "config.json (default: the config's, llama-3.1-70b)")
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


def whole_number(flag: str, least: int = 1):
    """An argparse type for ``flag``: a whole number >= ``least``, refused by the flag's name."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a whole number >= {least}") \
                from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{flag} {n}: must be >= {least}")
        return n
    return parse


def fraction(flag: str):
    """An argparse type for ``flag``: a number in (0, 1] (an attainment target)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a number in (0, 1]") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{flag} {value:g}: must be in (0, 1] (0.9 = "
                                             f"90% of requests within the SLOs)")
        return value
    return parse


def add_workers(p: argparse.ArgumentParser, what: str = "processes") -> None:
    p.add_argument("--workers", type=whole_number("--workers"),
                   help=f"{what} (default: one per core)")


def add_ray(p: argparse.ArgumentParser, what: str = "") -> None:
    """``--ray [ADDRESS]``: run ``what`` (the points, the cells, ...) on Ray."""
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help=f"run {what + ' ' if what else ''}on Ray: a local cluster, or the one "
                        f"at ADDRESS")


def _limit(flag: str, unit: str, scale: float = 1.0):
    """The type of a limit flag: a number > 0 (inf: no limit), times ``scale``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: {unit} > 0 (inf: no "
                                             f"limit)") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{flag} {value:g}: must be > 0")
        return value * scale
    return parse


def add_max_wall(p: argparse.ArgumentParser) -> None:
    from sim.config.run_size import DEFAULT_MAX_WALL_S

    p.add_argument("--max-wall-s", type=_limit("--max-wall-s", "seconds"),
                   default=DEFAULT_MAX_WALL_S, metavar="SECONDS",
                   help="refuse work estimated to take longer on this machine (default "
                        f"{DEFAULT_MAX_WALL_S:g}, inf: no limit)")


def add_max_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-memory-gb", dest="max_memory_bytes",
                   type=_limit("--max-memory-gb", "GB", 1e9), metavar="GB",
                   help="refuse a trace file loaded whole whose estimate needs more memory "
                        "(default: this machine's available memory; inf: no limit)")


def announce(command: str, num_requests: float, max_wall_s: float | None,
             copies_in_turn: float = 1.0, in_parallel: int = 1,
             peak_bytes: float | None = None, quiet: bool = False,
             what: str = "the run", extra_s: float = 0.0) -> float:
    """The work's estimated wall seconds (``sim.config.run_size``): ``copies_in_turn`` runs
    of ``num_requests``, ``in_parallel`` at a time, after ``extra_s`` of other work. Refused past ``max_wall_s``
    (``ConfigError`` naming the estimate and ``--max-wall-s``); printed as one line on stderr
    past ``ANNOUNCE_AFTER_S`` unless ``quiet``."""
    from sim.config.run_size import ANNOUNCE_AFTER_S, check_run_time, describe_estimate

    wall = check_run_time(num_requests, max_wall_s, what, copies_in_turn,
                          in_parallel=in_parallel, extra_s=extra_s)
    if wall > ANNOUNCE_AFTER_S and not quiet:
        print(describe_estimate(command, num_requests * copies_in_turn, wall, peak_bytes),
              file=sys.stderr, flush=True)
    return wall
