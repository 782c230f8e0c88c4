"""The ``hawk`` command line.

    hawk simulate            the paper's Chatbot scenario (GPU prefill, NPU decode), a summary
    hawk sweep --rates A:B:S SLO attainment over rates, in parallel, and the knee
    hawk bench               simulator speed against bare SimPy, measured in the same run

``hawk --help`` lists all twelve commands (``COMMANDS``), ``hawk COMMAND --help`` a command's
flags. Flags are never abbreviated (``--num-req`` is refused, not read as ``--num-requests``).
Each command group lives in its own module (``COMMANDS``), imported only when its command
runs: ``hawk --help`` and a command's start-up pay for no other group's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: (command, the module that adds its parser, the one-line help ``hawk --help`` lists). A module
#: of ``sim.commands`` adds its group with ``add_parser(subparsers)``, a lower package's command
#: module (``traces.commands``, ``hardware.commands``) with ``register(subparsers)``.
COMMANDS = (
    ("simulate", "sim.commands.simulate",
     "simulate one run (default: the paper's Chatbot scenario)"),
    ("sweep", "sim.commands.sweep", "SLO attainment over a range of rates, and the knee"),
    ("compare", "sim.commands.compare", "paired comparison of two configurations (or two "
     "recorded runs) with bootstrap confidence intervals and a verdict"),
    ("plan", "sim.commands.plan", "the cheapest and the most power-efficient cluster that meet "
     "the SLOs at a rate, aggregated or disaggregated, with a verdict, and the cost/goodput "
     "Pareto frontier"),
    ("bench", "sim.commands.bench", "simulator speed vs bare SimPy, measured in the same run"),
    ("replay", "traces.commands",
     "replay a trace open-loop against a live OpenAI-compatible streaming endpoint"),
    ("compare-runs", "traces.commands", "two runs' (or traces') metrics side by side"),
    ("real", "hardware.commands", "real mode: KV transfer over real transports"),
    ("paper", "sim.commands.paper", "reproduce the paper's results (paper profile)"),
    ("calibrate", "sim.commands.calibrate", "fit the profile's free parameters to the paper's "
     "targets, or to a measured profile (--profile DIR)"),
    ("devices", "sim.commands.devices", "devices against their published measurements"),
    ("validate", "sim.commands.validate", "the real mode vs the simulator on a measured "
     "profile, on the same requests at a light load and near the knee"),
    ("profile", "sim.commands.profile", "measure a live OpenAI-compatible engine (vLLM) from "
     "outside into a profile directory (an aggregated instance)"),
)


class Parser(argparse.ArgumentParser):
    """An argument parser that never takes an abbreviated flag, and every parser added under
    it (``add_subparsers`` builds its children with the parent's class, so the lower
    packages' command modules get it too). The top parser's errors name every command."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        if self.prog == "hawk":
            self.print_usage(sys.stderr)
            self.exit(2, f"hawk: error: {message}\nthe commands: "
                         f"{', '.join(name for name, _, _ in COMMANDS)}; hawk --help "
                         f"lists them, hawk COMMAND --help a command's flags\n")
        super().error(message)


def build_parser(load=None) -> argparse.ArgumentParser:
    """The ``hawk`` parser. ``load``: the commands whose modules are imported and whose own
    parsers are built (None: all); every other command is listed by name and help only."""
    parser = Parser(prog="hawk", description=__doc__, usage="hawk COMMAND [flags]",
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="hawk")
    loaded = {module for name, module, _ in COMMANDS if load is None or name in load}
    for name, module, line in COMMANDS:
        if name in sub.choices:             # added with another command of its module
            continue
        if module in loaded:
            _register(name, module, sub)
        else:
            sub.add_parser(name, help=line, add_help=False)
    return parser


def _register(name: str, module: str, sub) -> None:
    """Import ``module`` and add its commands' parsers to ``sub``."""
    group = importlib.import_module(module)
    if module.startswith("sim.commands."):
        group.add_parser(sub)
    else:
        group.register(sub)


def command_of(argv: list[str]) -> str | None:
    """The command an argument list names (its first word), or None (``--help``, nothing)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(load={command_of(argv)})
    args = parser.parse_args(argv)
    from sim.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"hawk {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()     # the reader (``| head``) has what it wanted
        return 0


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout is not a real file (e.g. captured in tests)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
