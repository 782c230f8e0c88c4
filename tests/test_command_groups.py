"""The ``hawk`` command groups: each in its own module, imported only when its command runs;
``hawk --help`` imports none of them nor any heavy library; every command's ``--help`` works."""

import argparse
import subprocess
import sys

import pytest

from sim.commands.main import COMMANDS, build_parser, command_of, main

#: what ``hawk --help`` must not import: libraries and every command's implementation
HEAVY = ("pandas", "numpy", "scipy", "matplotlib", "simpy", "torch", "aiohttp", "pyarrow", "ray")
GROUP_MODULES = sorted({module for _, module, _ in COMMANDS})


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.splitlines()[-1].split())     # the last line: after any help text


def listed_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each command's one line in ``hawk --help``."""
    action = parser._subparsers._group_actions[0]
    return {a.dest: a.help for a in action._choices_actions}


def test_help_imports_no_heavy_library_and_no_command_group():
    loaded = loaded_after("from sim.commands.main import main\n"
                          "try:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY)
    assert not loaded & set(GROUP_MODULES)
    assert not {m for m in loaded if m.startswith(("traces", "hardware", "sim.config"))}


@pytest.mark.parametrize("name, module", [(n, m) for n, m, _ in COMMANDS])
def test_a_command_imports_its_own_group_and_no_other(name, module):
    loaded = loaded_after(f"from sim.commands.main import build_parser\n"
                          f"build_parser(load={{{name!r}}})")
    others = {m for m in GROUP_MODULES if m != module and not module.startswith(m + ".")}
    assert module in loaded
    assert not loaded & others, sorted(loaded & others)


def test_the_table_lists_each_command_with_the_help_its_module_gives_it():
    stubs = listed_help(build_parser(load=set()))
    assert list(stubs) == [name for name, _, _ in COMMANDS]
    assert listed_help(build_parser()) == stubs == {name: help for name, _, help in COMMANDS}


@pytest.mark.parametrize("argv", [[name, "--help"] for name, _, _ in COMMANDS]
                         + [["real", "profile", "--help"], ["--help"]])
def test_every_command_has_its_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hawk {' '.join(argv[:-1])}".rstrip())
    assert "--help" in out


def test_an_unknown_command_is_named_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulat", "--num-requests", "10"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'simulat'" in err and "'simulate'" in err and "'validate'" in err
    assert "Traceback" not in err


def test_no_command_is_an_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("argv, command", [(["simulate", "--json"], "simulate"),
                                           (["--help"], None), ([], None),
                                           (["real", "profile"], "real")])
def test_the_command_is_the_first_word(argv, command):
    assert command_of(argv) == command
