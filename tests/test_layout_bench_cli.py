"""``python -m hardware.layout_bench``: without torch, one line naming the extra, no traceback;
with it, each kernel path at each thread count, and bad flags refused by name."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs the module as `python -m` would, in an interpreter where `import torch` fails.
WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['layout_bench']; "
                 "runpy.run_module('hardware.layout_bench', run_name='__main__')")


def test_layout_bench_without_torch_names_the_extra():
    out = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "pip install -e '.[torch]'" in lines[0]


def test_layout_bench_refuses_a_bad_path_or_thread_list(capsys):
    pytest.importorskip("torch")
    from hardware import layout_bench
    for argv, named in ((["--path", "avx3"], "'avx3': allowed: auto, all, portable"),
                        (["--threads", "1,two"], "'1,two': give whole numbers")):
        with pytest.raises(SystemExit) as exit_:
            layout_bench.main(argv)
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert layout_bench.main(["--threads", "0", "--tokens", "64", "--layers", "1"]) == 2
    assert "threads [0]: each must be at least 1" in capsys.readouterr().err


def test_layout_bench_times_each_path_at_each_thread_count():
    torch = pytest.importorskip("torch")
    from hardware import layout_bench, layout_kernel
    paths = list(reversed(layout_kernel.supported_paths())) or [None]
    threads = torch.get_num_threads()
    result = layout_bench.run(tokens=128, repeats=1, bench_layers=1, tp=8, dram="wormhole",
                              threads=[1, 2], paths=paths)
    assert torch.get_num_threads() == threads                  # put back as it was
    rows = result["throughput"]
    per_count = 1 + 2 * len(paths) if layout_kernel.available() else 3
    assert [r["threads"] for r in rows] == [1] * per_count + [2] * per_count
    if layout_kernel.available():
        assert [r["kernel_path"] for r in rows[:per_count]] == ["copy"] + paths + paths
    one = {(r["dtype"], r["kernel_path"]): r for r in rows if r["threads"] == 1}
    assert len(result["scaling"]) == per_count
    for s in result["scaling"]:
        two = next(r for r in rows if r["threads"] == 2 and r["dtype"] == s["dtype"]
                   and r["kernel_path"] == s["kernel_path"])
        base = one[s["dtype"], s["kernel_path"]]
        assert s["speedup"] == pytest.approx(base["transform_s"] / two["transform_s"])
        assert s["copy_speedup"] == pytest.approx(base["copy_s"] / two["copy_s"])
    text = layout_bench.format_table(result)
    assert " 1 thread:" in text and " 2 threads:" in text and "1 -> 2 threads" in text


def test_layout_bench_refuses_a_path_by_name():
    pytest.importorskip("torch")
    from hardware import layout_bench, layout_kernel
    with pytest.raises(ValueError, match="kernel path 'avx3' unknown"):
        layout_bench.run(tokens=64, repeats=1, bench_layers=1, paths=["avx3"])
    for path in (p for p in layout_kernel.PATHS if p not in layout_kernel.supported_paths()):
        with pytest.raises(ValueError, match=f"'{path}': this CPU lacks its instructions"):
            layout_bench.run(tokens=64, repeats=1, bench_layers=1, paths=[path])


def test_layout_bench_takes_the_path_the_environment_forces(monkeypatch):
    pytest.importorskip("torch")
    from hardware import layout_bench, layout_kernel
    if not layout_kernel.available():
        pytest.skip("no kernel here")
    monkeypatch.setenv(layout_kernel.PATH_VAR, "portable")
    result = layout_bench.run(tokens=64, repeats=1, bench_layers=1, tp=8, dram="wormhole",
                              dtypes=("bfloat8_b",))
    assert [r["kernel_path"] for r in result["throughput"]] == ["portable"]
    monkeypatch.setenv(layout_kernel.PATH_VAR, "avx3")
    with pytest.raises(ValueError, match="HAWK_TRANSFORM_PATH='avx3'"):
        layout_bench.run(tokens=64, repeats=1, bench_layers=1, dtypes=("bfloat8_b",))
