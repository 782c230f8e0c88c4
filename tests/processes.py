"""Process helpers for tests that start real-mode commands: every process a test starts, and
every process those start in turn (routers, workers, benchmark peers, even in sessions of their
own), inherits a tag in its environment; ``tagged`` finds them by it and ``killed_after`` kills
whatever is left when the test ends, passing or failing, so none outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG_ENV = "HAWK_TEST_PROCESS_TAG"


def tagged(tag: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment holds ``tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_until(predicate, timeout_s: float = 120.0, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


@contextmanager
def killed_after():
    """Yield a fresh tag; on the way out SIGKILL every live process that carries it."""
    tag = uuid.uuid4().hex
    try:
        yield tag
    finally:
        for pid in tagged(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start_hawk(tag: str, *args: str, **popen) -> subprocess.Popen:
    """``hawk ARGS`` from this checkout, tagged, in a session of its own."""
    env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "sim.commands.main", *args], cwd=ROOT,
                            env=env, start_new_session=True, **popen)
