"""Faults in a simulated run: KV transfers that fail and are retried, decode instances lost.

Configured by ``[faults]`` (``sim.config.FaultsConfig``); nothing is injected by default. This
module decides, and its functions over a decode instance ``d`` (``sim.engine.decode``) act on
``d.pulls`` (``in_flight``, ``num_failed``, ``attempt_at``: ``sim.engine.decode_state``) and,
when the instance is lost, on all its state:

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


def transfer_failed(d, transfer: tuple) -> bool:
    """The attempt of ``transfer`` has completed at decode instance ``d``: True when it
    failed (it is retried after the backoff, or the request fails) or ``d`` was lost
    meanwhile."""
    i, source, cost = transfer
    if d.lost:
        return True
    now, faults, pulls = d.env.now, d.faults, d.pulls
    started = pulls.attempt_at.pop(i, d.ledger.transfer_start_at[i])
    if not faults.attempt_failed(started, now):
        pulls.in_flight[i] = None                  # the caller frees the sender
        pulls.num_failed.pop(i, None)
        return False
    failed = pulls.num_failed[i] = pulls.num_failed.get(i, 0) + 1
    if faults.may_retry(failed):
        timer = d.env.timeout(faults.backoff_s)
        timer.callbacks.append(lambda _ev: retry(d, transfer))
        return True
    del pulls.num_failed[i], pulls.in_flight[i]
    d.ledger.fail(i, Status.FAILED_TRANSFER, now)
    source.release(i)
    d.memory.release(i)
    if d.prefix is not None:
        d.prefix.release(i)
    pulls.num_assigned -= 1
    if pulls.pending:
        d._pull()
    return True


def retry(d, transfer: tuple) -> None:
    """Start the attempt of ``transfer`` again, unless ``d`` was lost meanwhile."""
    if d.lost:
        return
    i, source, cost = transfer
    d.pulls.attempt_at[i] = d.env.now
    d.link.start(cost.before_s, cost.wire_bytes, d._arrived, transfer,
                 getattr(source, "host", None), getattr(cost, "source_host_s", 0.0))


def lose_instance(d) -> None:
    """Decode instance ``d`` is lost now: every request it holds fails, and those still
    waiting for their pull fail too or go elsewhere (``[faults] on_instance_loss``)."""
    now, ledger, lost = d.env.now, d.ledger, Status.FAILED_INSTANCE_LOST
    batch, pulls, room = d.batch, d.pulls, d.room
    d.lost = True
    if batch.plan is not None:
        batch.busy_time += min(now, batch.end_at) - batch.plan[0]
    batch.plan = None
    d.timer.cancel()
    reroute = d.reroute if d.faults.config.on_instance_loss == "reroute" else None
    for i, source in pulls.pending:
        if source is not None and reroute is not None:
            reroute(i, source)
            continue
        ledger.fail(i, lost, now)
        if source is not None:
            source.release(i)
    for i, source in pulls.in_flight.items():
        ledger.fail(i, lost, now)
        if source is not None:                   # its bytes had not all landed
            source.release(i)
    for i in [i for i, _ in room.restoring] + list(batch.waiting) + [
            i for _, i in batch.running]:
        ledger.fail(i, lost, now)
    memory = d.memory
    for i in list(memory.held if hasattr(memory, "held") else memory.blocks):
        memory.release(i)
    for i in list(d.prefix.held) if d.prefix is not None else ():
        d.prefix.release(i)
    pulls.pending.clear(), pulls.in_flight.clear(), room.restoring.clear()
    batch.waiting.clear(), batch.running.clear()
    pulls.num_assigned = 0
