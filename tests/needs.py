"""Skips that say how to get what a test needs: the transports' system packages and extras."""

from __future__ import annotations

import importlib
import os
import subprocess

import pytest

RDMA_STEP = "bash scripts/install-rdma-packages.sh"


def mooncake_engine():
    """``mooncake.engine``, or a skip naming the extra (the package is missing) or the system
    step (the package is there but its engine cannot load Debian's libibverbs)."""
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        if "libibverbs" in str(exc):
            pytest.skip(f"Mooncake's engine needs the system library libibverbs1: {RDMA_STEP}",
                        allow_module_level=True)
        pytest.skip("mooncake-transfer-engine-non-cuda not installed (pip install -e "
                    "'.[transfer]')", allow_module_level=True)


def pyverbs(module: str = "pyverbs"):
    """``module`` of Debian's pyverbs, or a skip naming the package and the step that makes
    it visible to this interpreter."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"Debian python3-pyverbs not installed or not visible to this interpreter: "
                    f"{RDMA_STEP}", allow_module_level=True)


def vllm_python() -> str:
    """The python ``HAWK_VLLM_PYTHON`` names, once it imports vllm; else a skip saying why."""
    python = os.environ.get("HAWK_VLLM_PYTHON")
    if not python:
        pytest.skip("HAWK_VLLM_PYTHON names no python with vLLM (scripts/validate-vllm.sh "
                    "installs one; CI does not)")
    found = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"HAWK_VLLM_PYTHON={python} cannot import vllm: "
                    f"{found.stderr.strip().splitlines()[-1:]}")
    return python
