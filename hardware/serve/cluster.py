"""A local cluster: the router and its workers as child processes of this one.

``LocalCluster(...).start()`` starts the router, reads its endpoint, starts the prefill and
decode workers pointed at its control port (all on loopback unless ``host`` says otherwise),
waits until every worker has joined, sends one warm-up request through every (prefill,
decode) pair (``/hawk/warmup``: the first request served afterwards pays no first-use costs),
and returns. Children run in their own sessions, so a Ctrl-C at the terminal reaches only this
process, which then stops them. ``stop()`` ends every child it started (SIGINT, then SIGKILL
after a grace period) and waits for it, so nothing outlives a run or a test; a child whose
parent dies without calling it (SIGKILL) ends itself (``hardware.lifecycle``).
``reap()`` collects children that exited on their own, so none stays a zombie.
With ``shape = "aggregated"`` the router is ``aggregated_router`` and ``num_aggregated``
aggregated workers serve both phases each (no KV moves; the warm-up goes through each one).
``kill_worker`` / ``start_worker`` are for fault drills. All share one fresh run token, passed in
the environment (never on a command line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from hardware.lifecycle import child_env
from hardware.wire import TOKEN_ENV, new_token

#: what the workers import, the extra that installs it and what for
WORKER_DEPENDENCIES = (("torch", "torch", "the model"), ("aiohttp", "replay", "the router's HTTP"),
                       ("mooncake.engine", "transfer", "the KV transfer (Mooncake over TCP)"))


def check_worker_dependencies() -> None:
    """``ClusterError`` naming the first missing dependency, its extra and what needs it
    (torch and aiohttp are looked up, not imported; Mooncake is imported, since its engine
    fails to load without the system's libibverbs)."""
    import importlib
    import importlib.util

    for module, extra, role in WORKER_DEPENDENCIES:
        try:
            if "." in module:
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                raise ImportError(f"No module named {module!r}")
        except ImportError as exc:
            if "libibverbs" in str(exc):
                raise ClusterError(f"{role} needs the system library libibverbs (Mooncake loads "
                                   f"it even for TCP): bash scripts/install-rdma-packages.sh, "
                                   f"or install libibverbs1") from None
            raise ClusterError(f"{role} needs {module.split('.')[0]} "
                               f"(pip install -e '.[{extra}]')") from None


#: flags of one shape only, with their defaults (None in the parser, so a given one is seen)
DISAGGREGATED_ONLY = {"--num-prefill": ("num_prefill", 1), "--num-decode": ("num_decode", 1),
                      "--mechanism": ("mechanism", "GN-HAWK"),
                      "--kv-dtype": ("kv_dtype", "bfloat8_b"),
                      "--send-buffer-mb": ("send_buffer_mb", 16.0)}
AGGREGATED_ONLY = {"--num-aggregated": ("num_aggregated", 1)}


def shape_conflict(args) -> str | None:
    """For ``hawk real serve`` / ``run``: the first flag given that the chosen ``--shape`` has no use for (a link mechanism, a
    P/D pool size with ``aggregated``; ``--num-aggregated`` with ``disaggregated``), as a
    one-line reason; the others' defaults filled in."""
    aggregated = getattr(args, "shape", "disaggregated") == "aggregated"
    foreign, own = ((DISAGGREGATED_ONLY, AGGREGATED_ONLY) if aggregated
                    else (AGGREGATED_ONLY, DISAGGREGATED_ONLY))
    for flag, (name, _) in foreign.items():
        if getattr(args, name, None) is not None:
            why = ("moves no KV: there is no link, send buffer or decode tile format"
                   if flag in ("--mechanism", "--kv-dtype", "--send-buffer-mb")
                   else "has no separate prefill and decode pools")
            return (f"{flag} is for --shape disaggregated; --shape aggregated {why}"
                    if aggregated else f"{flag} is for --shape aggregated")
    for name, default in list(own.values()) + list(foreign.values()):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    return None


class ClusterError(RuntimeError):
    """A child process did not start, or the cluster did not come up in time."""


SHAPES = ("disaggregated", "aggregated")


@dataclass
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    mechanism: str = "GN-HAWK"
    kv_dtype: str = "bfloat8_b"
    host: str = "127.0.0.1"
    model: str | None = None
    seed: int = 0
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)     # e.g. --request-timeout-s 60
    start_timeout_s: float = 180.0
    shape: str = "disaggregated"
    num_aggregated: int = 1

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape {self.shape!r}: one of {', '.join(SHAPES)}")

    @property
    def roles(self) -> dict[str, int]:
        """Workers to start, by role."""
        if self.shape == "aggregated":
            return {"aggregated": self.num_aggregated}
        return {"prefill": self.num_prefill, "decode": self.num_decode}


class LocalCluster:
    def __init__(self, config: ClusterConfig, log_dir=None):
        self.config = config
        self.token = new_token()
        self.log_dir = log_dir
        self.router: subprocess.Popen | None = None
        self.workers: dict[tuple[str, int], subprocess.Popen] = {}
        self.endpoint = ""
        self.control: tuple[str, int] | None = None
        self._started = {"prefill": 0, "decode": 0, "aggregated": 0}

    def _env(self) -> dict:
        return child_env({**os.environ, TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1",
                          "OMP_NUM_THREADS": "1"})

    def _stderr(self, name: str):
        if self.log_dir is None:
            return subprocess.DEVNULL
        os.makedirs(self.log_dir, exist_ok=True)
        return open(os.path.join(self.log_dir, f"{name}.log"), "w")

    def start(self) -> "LocalCluster":
        c = self.config
        check_worker_dependencies()
        module = "aggregated_router" if c.shape == "aggregated" else "router"
        cmd = [sys.executable, "-m", f"hardware.serve.{module}", "--host", c.host,
               *c.router_args]
        if c.model:
            cmd += ["--model", c.model]
        self.router = subprocess.Popen(cmd, env=self._env(), stdout=subprocess.PIPE,
                                       stderr=self._stderr("router"), text=True,
                                       start_new_session=True)
        line = self.router.stdout.readline()
        if not line:
            self.stop()
            raise ClusterError(f"router exited with {self.router.wait()} before it was ready")
        ready = json.loads(line)
        self.endpoint, self.control = ready["http"], tuple(ready["control"])
        try:
            for role, n in c.roles.items():
                for _ in range(n):
                    self.start_worker(role)
            self._wait_roles(c.roles)
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, role: str) -> tuple[str, int]:
        c = self.config
        module = "aggregated_worker" if role == "aggregated" else "worker"
        cmd = [sys.executable, "-m", f"hardware.serve.{module}", "--role", role,
               "--router", f"{self.control[0]}:{self.control[1]}", "--host", c.host,
               "--seed", str(c.seed), *c.worker_args]
        if role != "aggregated":
            cmd += ["--mechanism", c.mechanism, "--kv-dtype", c.kv_dtype]
        if c.model:
            cmd += ["--model", c.model]
        key = (role, self._started[role])
        self._started[role] += 1
        self.workers[key] = subprocess.Popen(cmd, env=self._env(), stdout=subprocess.DEVNULL,
                                             stderr=self._stderr(f"{role}-{key[1]}"),
                                             start_new_session=True)
        return key

    def warm_up(self) -> list[dict]:
        """One short request through every live (prefill, decode) pair, or every aggregated
        worker; ``ClusterError`` naming those that failed."""
        req = urllib.request.Request(self.endpoint + "/hawk/warmup", b"", method="POST")
        with urllib.request.urlopen(req, timeout=self.config.start_timeout_s) as r:
            pairs = json.loads(r.read())
        bad = [p for p in pairs if p["status"] != "ok"]
        if bad:
            raise ClusterError("warm-up failed on " + "; ".join(
                " -> ".join(f"{k} {p[k]}" for k in ("prefill", "decode", "aggregated") if k in p)
                + f": {p['error']}" for p in bad)
                + (f"; logs in {self.log_dir}" if self.log_dir else ""))
        return pairs

    def reap(self) -> list[str]:
        """Collect every child that has exited (no zombies); names those that did."""
        named = [("router", self.router)] if self.router else []
        named += [(f"{r}-{i}", p) for (r, i), p in self.workers.items()]
        return [f"{name} (exit {p.returncode})" for name, p in named if p.poll() is not None]

    def health(self) -> dict:
        with urllib.request.urlopen(self.endpoint + "/health", timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str):
        with urllib.request.urlopen(self.endpoint + path, timeout=120) as r:
            return json.loads(r.read())

    def wait_for(self, num_prefill: int, num_decode: int, exact: bool = False) -> None:
        """Wait until at least (``exact``: exactly) that many workers of each role are live."""
        self._wait_roles({"prefill": num_prefill, "decode": num_decode}, exact)

    def _wait_roles(self, wanted: dict[str, int], exact: bool = False) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            h = self.health()
            if all(h.get(r, 0) == n or (not exact and h.get(r, 0) >= n)
                   for r, n in wanted.items()):
                return
            dead = [f"{r}-{i} (exit {p.returncode})" for (r, i), p in self.workers.items()
                    if p.poll() is not None and p.returncode != -signal.SIGKILL]
            if dead:
                raise ClusterError(f"worker(s) {', '.join(dead)} exited while starting"
                                   + (f"; logs in {self.log_dir}" if self.log_dir else ""))
            time.sleep(0.2)
        raise ClusterError(f"workers did not join within {self.config.start_timeout_s:g} s: "
                           f"{self.health()}")

    def kill_worker(self, role: str, index: int) -> None:
        """SIGKILL the worker the router knows as ``role`` ``index`` (its join order, which
        need not be the order this cluster started the processes in)."""
        pids = {w["pid"]: w for w in self.get("/hawk/workers")
                if w["role"] == role and w["index"] == index}
        procs = [p for p in self.workers.values() if p.pid in pids]
        if not procs:
            raise ClusterError(f"no live {role} worker {index} started by this cluster")
        procs[0].kill()
        procs[0].wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        procs = [p for p in self.workers.values()] + ([self.router] if self.router else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        if self.router is not None and self.router.stdout:
            self.router.stdout.close()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
