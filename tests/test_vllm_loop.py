"""The whole loop against a real vLLM (scripts/validate-vllm.sh, briefly): serve the tiny model
on loopback, profile it from outside, validate the simulator on both traces at both loads.

It runs only where a python that imports vLLM is named by ``HAWK_VLLM_PYTHON`` (CI installs
no vLLM: docs/vllm.md); it asserts that the loop completes and prints its tables, never a
timing (the engine's speed depends on the machine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.needs import vllm_python

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_loop_profiles_and_validates_a_real_vllm(tmp_path):
    python = vllm_python()
    env = {**os.environ, "HAWK_VLLM_PYTHON": python, "PORT": str(free_port()),
           "NUM_REQUESTS": "8", "QUICK": "1",
           "HAWK": f"{sys.executable} -m sim.commands.main",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "validate-vllm.sh"), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "profile" / "profile.toml").is_file()
    for name in ("chatbot", "azure-llm-2023-conv"):
        table = (tmp_path / f"validate-{name}.txt").read_text()
        assert "light load" in table and "knee load" in table and "ttft_p50_s" in table
        assert (tmp_path / f"validate-{name}" / "validate.json").is_file()
    leftover = subprocess.run(["pgrep", "-f", "--", f"--port {env['PORT']}"],
                              capture_output=True)
    assert leftover.returncode == 1                  # the server is gone
