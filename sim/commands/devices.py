"""``hawk devices --check``: the roofline model beside published per-model figures
(``sim.paper.devices_check``), one row per figure with its source."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="devices under the profile's model")
    p.add_argument("--check", action="store_true",
                   help="the model beside published per-model figures, with sources")
    p.add_argument("--profile", default="paper", help="profile name or .toml path")
    p.set_defaults(func=run)


def run(args) -> int:
    from sim.paper.devices_check import check

    if not args.check:
        print("hawk devices: pass --check to compare the model with published figures")
        return 2
    rows = check(args.profile)
    print(f"{'device':10s} {'quantity':34s} {'setting':22s} {'model':>9s} {'published':>9s} "
          f"{'ratio':>6s}  source")
    for r in rows:
        print(f"{r['device']:10s} {r['what']:34s} {_setting(r['setting']):22s} "
              f"{1e3 * r['model']:7.1f}ms {1e3 * r['published']:7.1f}ms {r['ratio']:6.2f}  "
              f"{r['source']}")
    print(f"ratio = model / published (> 1: the model is slower); profile {args.profile!r}; "
          f"none of these figures is a fit target")
    return 0


def _setting(setting: dict) -> str:
    """``{"batch": 32, "context": 192}`` as ``batch 32, context 192``."""
    if "prefill" in setting:
        return f"prompt {setting['prefill']}, batch 1"
    return f"batch {setting['batch']}, context {setting['context']}"
