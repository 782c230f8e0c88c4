"""Building the fused kernel never blocks a run: a killed build's lock, another process's live
build and a second environment each cost seconds, never a hang (``hardware.kernel_build``).

Every test points torch's extension cache at a temporary directory; none compiles (the
compiler is ``false`` where a build would start)."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hardware import kernel_build, layout_kernel

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 300            # only a hang reaches it: each case takes seconds
PROBE = "from hardware import layout_kernel as k; print(k.available())"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private extension cache and a compiler that fails at once, in this process and in
    the children its tests start; the serial build's directory there."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.delenv(layout_kernel.ENV_VAR, raising=False)
    monkeypatch.delenv(kernel_build.WAIT_VAR, raising=False)
    return kernel_build.build_directory(layout_kernel._spec(False))


def probe(**env) -> subprocess.CompletedProcess:
    """Ask a fresh process whether the kernel is available (it fails the test on a hang)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=HANG_S, cwd=ROOT)


def our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hardware.layout_kernel:")]


def test_a_killed_builds_lock_is_removed_not_waited_on(cache):
    cache.mkdir(parents=True)
    lock = cache / "lock"                           # what torch leaves when a build is killed
    lock.touch()
    os.utime(lock, (0, 0))
    done = probe()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]         # the eager path: the compiler is `false`
    lines = our_lines(done.stderr)
    assert len(lines) == 1 and "removed the stale build lock" in lines[0], done.stderr
    assert str(lock) in lines[0] and "building the fused kernel in" in lines[0]
    assert not lock.exists()


def test_a_live_build_elsewhere_is_waited_on_for_a_bound_then_eager(cache):
    cache.mkdir(parents=True)
    with open(cache / kernel_build.LOCK, "a") as held:      # another process building
        fcntl.flock(held, fcntl.LOCK_EX)
        done = probe(**{kernel_build.WAIT_VAR: "0.5"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    lines = our_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "another process is building" in lines[0] and "eager torch path" in lines[0]
    assert str(cache) in lines[0] and "waited 0.5 s" in lines[0]
    assert not (cache / "lock").exists()            # it never started a build of its own


def test_the_bound_is_said_once_per_process(cache, monkeypatch, capsys):
    cache.mkdir(parents=True)
    monkeypatch.setattr(layout_kernel, "_BUILDS", {})
    monkeypatch.setattr(kernel_build, "_said", set())
    with open(cache / kernel_build.LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert layout_kernel._build(False, wait_s=0) is None
        assert not layout_kernel.available() and layout_kernel.build_seconds() is None
    assert len(our_lines(capsys.readouterr().err)) == 1


def test_two_environments_build_in_two_directories(cache, monkeypatch):
    spec = layout_kernel._spec(False)
    here = kernel_build.build_directory(spec)
    assert kernel_build.build_directory(layout_kernel._spec(False)) == here      # stable
    assert here == cache and here.name.startswith("hawk_layout_")
    others = set()
    with monkeypatch.context() as m:
        m.setenv("CPLUS_INCLUDE_PATH", "/opt/other/include")
        others.add(kernel_build.build_directory(spec))
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", "/opt/other-venv/bin/python")
        others.add(kernel_build.build_directory(spec))
    with monkeypatch.context() as m:
        m.setenv("CXX", "clang++")
        others.add(kernel_build.build_directory(spec))
    others.add(kernel_build.build_directory(
        kernel_build.Spec(spec.name, spec.sources, spec.cflags + ("-O2",), spec.ldflags)))
    others.add(kernel_build.build_directory(layout_kernel._spec(True)))
    assert len(others) == 5 and here not in others


def test_a_bad_wait_is_refused_by_name(monkeypatch):
    for text in ("soon", "-1", "nan"):
        monkeypatch.setenv(kernel_build.WAIT_VAR, text)
        with pytest.raises(ValueError, match=f"{kernel_build.WAIT_VAR}='{text}'.*>= 0"):
            kernel_build.wait_seconds()
    monkeypatch.setenv(kernel_build.WAIT_VAR, "2.5")
    assert kernel_build.wait_seconds() == 2.5


def test_warm_up_and_build_do_nothing_when_the_kernel_is_off(monkeypatch, capsys):
    monkeypatch.setenv(layout_kernel.ENV_VAR, "0")
    assert layout_kernel.warm_up() == []
    assert layout_kernel.main(["--build"]) == 0
    assert "nothing built" in capsys.readouterr().out


class _Reached(Exception):
    pass


def test_a_prefill_worker_builds_the_kernel_before_anything_can_reach_it(monkeypatch):
    """Its transport (and after it the pull server and the join) come only once the kernel is
    built, so no request of a joined worker waits on a compile."""
    import argparse

    torch = pytest.importorskip("torch")
    from hardware import transport
    from hardware.serve import worker

    calls = []
    monkeypatch.setattr(layout_kernel, "warm_up", lambda *a, **k: calls.append("kernel") or [])

    def reached(*a, **k):
        calls.append("transport")
        raise _Reached

    monkeypatch.setattr(transport, "make_transport", reached)
    p = argparse.ArgumentParser()
    worker.add_arguments(p)
    args = p.parse_args(["--role", "prefill", "--router", "127.0.0.1:1", "--device", "cpu"])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(_Reached):
            worker.run_prefill(args, "token")
    finally:
        torch.set_num_threads(threads)
    assert calls == ["kernel", "transport"]
