"""``python -m hardware.layout_bench`` without torch: one line naming the extra, no traceback."""

import subprocess
import sys
from pathlib import Path

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
