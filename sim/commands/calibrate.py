"""``hawk calibrate``: fit a profile's free parameters, to the paper or to a measurement.

    hawk calibrate [--targets paper]      the paper profile's free parameters to the paper's
                                          targets (``sim.paper.calibrate``); writes
                                          sim/profiles/paper.toml and paper_fit.toml
    hawk calibrate --profile DIR          the roofline's efficiency factors and the transfer
                                          model to a measured profile directory
                                          (``sim.validation.fit_profile``); --out FILE writes
                                          the fitted profile

The flags and the dispatch live here; the two fit modules only fit (and give their reports as
text). Each fit's flags are refused with the other's, never ignored.
"""

from __future__ import annotations

from pathlib import Path

#: the targets fit's flags and their defaults (None in the parser: given or not is visible)
TARGETS_DEFAULTS = {"targets": "paper", "max_evaluations": 8, "loo_evaluations": None,
                    "workers": 2, "dry_run": False, "cache_dir": None}
PROFILE_FLAGS = ("device", "out")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="fit the profile's free parameters to the "
                              "paper's targets, or to a measured profile (--profile DIR)")
    p.add_argument("--targets", help="target set (paper; the default)")
    p.add_argument("--max-evaluations", type=int,
                   help="least-squares function evaluations of the fit, each with a Jacobian "
                        "(default 8)")
    p.add_argument("--loo-evaluations", type=int,
                   help="the same for each leave-one-out refit, from the fit's optimum "
                        "(default sim.paper.fit.LOO_NFEV)")
    p.add_argument("--workers", type=int,
                   help="parallel model evaluations: Jacobian columns, refits, seeds (default 2)")
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="fit and report; write nothing")
    p.add_argument("--cache-dir", help="keep the fit's simulations here, for a later run")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="fit the roofline's efficiency factors and the transfer parameters to "
                        "this measured profile directory instead of --targets")
    p.add_argument("--device", metavar="NAME",
                   help="with --profile: the device key the fitted [efficiency] table is "
                        "written under (default: the measuring machine, 'measured')")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="with --profile: write the fitted profile TOML here")
    p.set_defaults(func=run)


def run(args) -> int:
    """``--profile DIR``: the measured-profile fit; otherwise the targets fit."""
    from sim.config import ConfigError

    given = [f for f in TARGETS_DEFAULTS if getattr(args, f) is not None]
    if args.profile is not None:
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is a flag of the targets fit, "
                              f"not of --profile DIR")
        return run_profile_fit(args.profile, args.device, args.out)
    if any(getattr(args, f) is not None for f in PROFILE_FLAGS):
        raise ConfigError("--device and --out go with --profile DIR")
    settings = {f: default if getattr(args, f) is None else getattr(args, f)
                for f, default in TARGETS_DEFAULTS.items()}
    return run_targets_fit(**settings)


def run_targets_fit(targets: str, max_evaluations: int, loo_evaluations: int | None,
                    workers: int, dry_run: bool, cache_dir: str | None) -> int:
    from sim.config import ConfigError
    from sim.paper import calibrate as fit
    from sim.paper.fit_record import report_lines

    loo_evaluations = fit.LOO_NFEV if loo_evaluations is None else loo_evaluations
    for flag, value in (("--max-evaluations", max_evaluations),
                        ("--loo-evaluations", loo_evaluations), ("--workers", workers)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    record = fit.calibrate(targets, max_nfev=max_evaluations, workers=workers,
                           write=not dry_run, loo_nfev=loo_evaluations, cache_dir=cache_dir)
    print(report_lines(record))
    wall = record["wall_s"]
    print(f"\nwall time: fit {wall['fit']:.0f} s, leave-one-out refits {wall['loo']:.0f} s, "
          f"noise over seeds {wall['noise']:.0f} s")
    return 0


def run_profile_fit(profile: Path, device: str | None, out: Path | None) -> int:
    from sim.validation import fit_profile as fit
    from traces.jsonout import writable_file

    if out is not None:
        writable_file(out, "--out")
    record = fit.calibrate_profile(profile, device)
    print(fit.report(record))
    if out is not None:
        fit.write_toml(record, out)
        print(f"fitted profile written to {out}")
    return 0

