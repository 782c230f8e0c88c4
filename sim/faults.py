"""Faults in a simulated run: KV transfers that fail and are retried, decode instances lost.

Configured by ``[faults]`` (``sim.config.FaultsConfig``); nothing is injected by default. This
module decides, the decode instance acts (``sim.decode``):

- A KV transfer attempt fails with probability ``transfer_failure_prob``, or when any moment
  of it on the wire (from its start to its last byte) falls in a ``link_down`` interval. The
  failure shows when the attempt completes (the bytes crossed the link, or the sender timed
  out): the decode side keeps its reserved blocks, the prefill side keeps its copy, and the
  pull starts again after ``retry_backoff_s``. After ``max_retries`` failed retries the
  request ends ``failed_transfer`` and both sides free their memory.
- A decode instance lost at ``at_s`` takes the requests whose KV it held with it (in flight,
  waiting, running, preempted): they end ``failed_instance_lost`` at that instant. Requests
  still waiting for their pull have their KV on the prefill side: they fail too, or go to a
  live decode instance (``on_instance_loss = "reroute"``). New requests go to live instances
  only; with none left they end ``failed_instance_lost`` when their prefill is done.

Randomness: one ``numpy.random.Generator`` seeded by the run's seed and this module's stream
tag, drawn once per attempt in event order, so the same seed gives the same records.
"""

from __future__ import annotations

import numpy as np

#: keeps the fault draws apart from any other stream derived from the run's seed
FAULT_STREAM = 0xFA017


class Faults:
    """The fault schedule of one run, shared by its decode instances."""

    def __init__(self, config, seed: int):
        self.config = config
        self.rng = np.random.default_rng([seed, FAULT_STREAM])
        self.down = sorted(config.link_down)
        self.num_failed_attempts = 0
        self.num_failed_transfers = 0

    def attempt_failed(self, started_at: float, now: float) -> bool:
        """Whether the attempt on the wire from ``started_at`` to ``now`` failed."""
        failed = any(start < now and end > started_at for start, end in self.down)
        p = self.config.transfer_failure_prob
        if p > 0 and self.rng.random() < p:
            failed = True
        if failed:
            self.num_failed_attempts += 1
        return failed

    def may_retry(self, num_failed: int) -> bool:
        """Whether a request whose attempts failed ``num_failed`` times is tried again."""
        if num_failed > self.config.max_retries:
            self.num_failed_transfers += 1
            return False
        return True

    @property
    def backoff_s(self) -> float:
        return self.config.retry_backoff_s
