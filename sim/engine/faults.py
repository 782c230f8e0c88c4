"""Faults in a simulated run: KV transfers that fail and are retried, decode instances lost.

Configured by ``[faults]`` (``sim.config.FaultsConfig``); nothing is injected by default. This
module decides, the decode instance acts (``sim.engine.decode``):

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

from traces.schema import Status

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


class DecodeFaults:
    """The decode instance's side of faults (``sim.engine.decode.DecodeInstance`` mixes it in): what
    a failed attempt and a lost instance do to its requests and memory."""

    def _transfer_fault(self, transfer: tuple) -> bool:
        """The attempt of ``transfer`` has completed: True when it failed (it is retried after
        the backoff, or the request fails) or the instance was lost meanwhile."""
        i, source, cost = transfer
        if self.lost:
            return True
        now, faults = self.env.now, self.faults
        started = self._attempt_at.pop(i, self.ledger.transfer_start_at[i])
        if not faults.attempt_failed(started, now):
            self._in_flight[i] = None                  # the caller frees the sender
            self._num_failed.pop(i, None)
            return False
        failed = self._num_failed[i] = self._num_failed.get(i, 0) + 1
        if faults.may_retry(failed):
            timer = self.env.timeout(faults.backoff_s)
            timer.callbacks.append(lambda _ev: self._retry(transfer))
            return True
        del self._num_failed[i], self._in_flight[i]
        self.ledger.fail(i, Status.FAILED_TRANSFER, now)
        source.release(i)
        self.memory.release(i)
        self.num_assigned -= 1
        if self.pending:
            self._pull()
        return True

    def _retry(self, transfer: tuple) -> None:
        if self.lost:
            return
        i, source, cost = transfer
        self._attempt_at[i] = self.env.now
        self.link.start(cost.before_s, cost.wire_bytes, self._arrived, transfer,
                        getattr(source, "host", None), getattr(cost, "source_host_s", 0.0))

    def lose(self) -> None:
        """The instance is lost now: every request it holds fails, and those still waiting
        for their pull fail too or go elsewhere (``[faults] on_instance_loss``)."""
        now, ledger, lost = self.env.now, self.ledger, Status.FAILED_INSTANCE_LOST
        self.lost = True
        if self._plan is not None:
            self.busy_time += min(now, self._end) - self._plan[0]
        self._plan = None
        self._timer.cancel()
        reroute = self.reroute if self.faults.config.on_instance_loss == "reroute" else None
        for i, source in self.pending:
            if source is not None and reroute is not None:
                reroute(i, source)
                continue
            ledger.fail(i, lost, now)
            if source is not None:
                source.release(i)
        for i, source in self._in_flight.items():
            ledger.fail(i, lost, now)
            if source is not None:                   # its bytes had not all landed
                source.release(i)
        for i in [i for i, _ in self._restoring] + list(self.waiting) + [
                i for _, i in self.running]:
            ledger.fail(i, lost, now)
        memory = self.memory
        for i in list(memory.held if hasattr(memory, "held") else memory.blocks):
            memory.release(i)
        self.pending.clear(), self._in_flight.clear(), self._restoring.clear()
        self.waiting.clear(), self.running.clear()
        self.num_assigned = 0
