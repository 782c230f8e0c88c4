"""A trace file loaded whole (``hawk simulate --no-stream``, ``hawk compare --trace``) is
estimated in memory before it is read: its rows by its size (``traces.trace_stream
.estimate_rows``) at ``TRACE_LOAD_BYTES_PER_ROW`` plus its runs, refused past
``--max-memory-gb`` (default: this machine's available memory) naming the estimate and the
flag; ``hawk compare`` refuses one too long to run (``--max-wall-s``) before reading it too."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.commands.main import main


def run(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def trace(path: Path, rows: int, good_rows: int) -> Path:
    """A CSV of ``rows`` rows, bad past ``good_rows``: a run that reads past them fails
    naming a line, so a refusal that names no line read none of them."""
    body = "".join(f"{0.01 * k:.2f},200,20\n" for k in range(good_rows))
    path.write_text("arrival_at,num_prompt_tokens,num_output_tokens\n" + body
                    + "x,y,z\n" * (rows - good_rows))
    return path


@pytest.fixture
def commands(tmp_path):
    """``hawk simulate --no-stream`` and ``hawk compare`` of two policies, on a trace."""
    for name, fairness in (("a", "fcfs"), ("b", "weighted_fair")):
        (tmp_path / f"{name}.toml").write_text(f'[cluster.policies]\nfairness = "{fairness}"\n')

    def argv(command: str, path: Path) -> list[str]:
        if command == "simulate":
            return ["simulate", "--trace", str(path), "--no-stream"]
        return ["compare", "--baseline", str(tmp_path / "a.toml"), "--candidate",
                str(tmp_path / "b.toml"), "--trace", str(path), "--workers", "1"]
    return argv


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_trace_too_large_for_the_limit_is_refused_before_it_is_read(tmp_path, capsys,
                                                                      commands, command):
    small = trace(tmp_path / "small.csv", 20, 20)
    big = trace(tmp_path / "big.csv", 1_000_000, 100)      # about 1 GB loaded whole
    code, err = run(capsys, *commands(command, small), "--max-memory-gb", "1")
    assert code == 0, err
    code, err = run(capsys, *commands(command, big), "--max-memory-gb", "1")
    assert code == 2
    assert f"hawk {command} --trace big.csv (about " in err
    assert "rows loaded whole at 1024 B a row" in err and "past the --max-memory-gb limit of " \
        "1.0 GB" in err and "allow it with --max-memory-gb" in err
    assert "line" not in err                                # no row was checked


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_the_default_limit_is_the_available_memory_and_the_flag_raises_it(
        tmp_path, capsys, monkeypatch, commands, command):
    from sim.config import run_size

    monkeypatch.setattr(run_size, "available_memory_bytes", lambda: 0.5e9)
    big = trace(tmp_path / "big.csv", 300_000, 100)
    code, err = run(capsys, *commands(command, big))
    assert code == 2 and "past this machine's available memory of 0.5 GB" in err
    assert "--max-memory-gb" in err and "line" not in err
    code, err = run(capsys, *commands(command, big), "--max-memory-gb", "inf")
    assert code != 0 and "line 102" in err                 # read: the first bad row is named


def test_max_memory_gb_names_a_bad_value(capsys):
    code, err = run(capsys, "simulate", "--max-memory-gb", "0")
    assert code == 2 and "--max-memory-gb 0: must be > 0" in err


def test_compare_refuses_a_trace_too_long_to_run_before_it_is_read(tmp_path, capsys, commands):
    big = trace(tmp_path / "big.csv", 1_000_000, 100)
    code, err = run(capsys, *commands("compare", big), "--max-wall-s", "5")
    assert code == 2 and "hawk compare --trace big.csv (about " in err
    assert "simulated requests would take about" in err and "--max-wall-s" in err
    assert "line" not in err
