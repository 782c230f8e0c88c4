"""``hawk devices``: ``--check`` puts the roofline beside every published measurement of each
device (``sim.paper.devices_check``); ``--fit`` fits each device's efficiencies to its
measurements from a neutral start, with leave-one-out refits (``sim.paper.devices_fit``)."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="devices against their published measurements")
    p.add_argument("--check", action="store_true",
                   help="the model beside every published measurement, with sources")
    p.add_argument("--fit", action="store_true",
                   help="fit each device's efficiencies to its measurements (with LOO)")
    p.add_argument("--profile", default="grounded",
                   help="--check: profile name or .toml path (default: grounded)")
    p.add_argument("--device", action="append", default=None,
                   help="--fit: a device to fit (repeatable; default: every planned device)")
    p.add_argument("--no-loo", action="store_true", help="--fit: skip the leave-one-out refits")
    p.add_argument("--write", default=None, metavar="FILE",
                   help="--fit: write the fitted efficiencies as a profile TOML")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.check == args.fit:
        print("hawk devices: pass one of --check or --fit")
        return 2
    return _fit(args) if args.fit else _check(args)


def _check(args) -> int:
    from sim.paper.devices_check import check, check_serving, summary
    from sim.paper.devices_report import check_lines

    try:
        rows, serving = check(args.profile), check_serving(args.profile)
    except ValueError as exc:
        print(f"hawk devices: {exc}")
        return 2
    if args.json:
        print(json.dumps({"profile": args.profile, "points": rows, "serving": serving,
                          "summary": summary(rows)}, indent=1))
        return 0
    print("\n".join(check_lines(rows, serving, args.profile)))
    return 0


def _fit(args) -> int:
    from sim.paper.devices_fit import PLANS, fit_device
    from sim.paper.devices_report import fit_lines, profile_toml

    devices = args.device or list(PLANS)
    unknown = [d for d in devices if d not in PLANS]
    if unknown:
        print(f"hawk devices: --device {unknown[0]!r} has no fit plan; choose from "
              f"{sorted(PLANS)}")
        return 2
    results = [fit_device(d, loo=not args.no_loo) for d in devices]
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    else:
        for r in results:
            print("\n".join(fit_lines(r)))
    if args.write:
        Path(args.write).write_text(profile_toml(results))
        print(f"wrote {args.write}")
    return 0
