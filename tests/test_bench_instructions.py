"""sim.bench.instructions: callgrind instruction counts of the simulator and of bare SimPy."""

import shutil

import pytest

from sim.bench import instructions as bi


def test_without_valgrind_one_line_names_it(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bi.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "valgrind is not on the PATH" in err


@pytest.mark.parametrize("kwargs,message", [({"kind": "2x"}, "kind must be 1x or 10x"),
                                            ({"small": 10, "large": 10}, "need 0 < small")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bi.measure(**kwargs)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_counts_grow_with_the_events_run():
    few, more = bi.instructions("bare", "1000"), bi.instructions("bare", "3000")
    assert more > few > 0
    per_event = (more - few) / 2000
    assert 1_000 < per_event < 100_000        # a SimPy timeout: thousands of instructions
