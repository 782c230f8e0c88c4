"""How a real-mode child process ends with the process that started it.

A parent that starts routers, workers or benchmark peers (``LocalCluster``,
``hawk real transfer-bench``) puts its pid in ``PARENT_ENV`` (``child_env``). The child calls
``watch_parent()`` first thing: a daemon thread polls ``os.getppid()`` every
``POLL_S`` and, once the parent is gone (the child was re-parented: the parent exited or was
SIGKILLed, which no handler of its own can catch), sends the child SIGTERM, its clean stop, and
exits it outright ``GRACE_S`` later if that did not end it. Polling the parent id needs no
inherited descriptor and, unlike ``PR_SET_PDEATHSIG``, does not fire when merely the parent's
thread that started the child ends.

``terminate_as_interrupt()`` makes SIGTERM raise ``KeyboardInterrupt`` in the main thread, so
``kill``, ``timeout`` and Ctrl-C all take the same ``finally`` paths.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_ENV = "HAWK_PARENT_PID"
POLL_S = 0.5
GRACE_S = 10.0


def child_env(env: dict) -> dict:
    """``env`` for a child that should end with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def watch_parent(env=os.environ) -> bool:
    """Start the watchdog when ``PARENT_ENV`` names a parent; False when it names none. A
    parent already gone ends this process at once."""
    try:
        parent = int(env.get(PARENT_ENV, ""))
    except ValueError:
        return False
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)


def terminate_as_interrupt() -> None:
    """SIGTERM (and SIGINT, even where the shell ignored it) raise ``KeyboardInterrupt``."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
