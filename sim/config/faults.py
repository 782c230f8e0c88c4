"""The run's fault injection (``[faults]``, ``sim.engine.faults``) and cell split (``[cells]``,
``sim.runs.cells.run``) tables: frozen dataclasses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from sim.config.checks import ConfigError, _check_choice, _check_range, _pairs


#: what a decode instance's requests do when it is lost (``FaultsConfig.on_instance_loss``)
ON_INSTANCE_LOSS = ("fail", "reroute")


@dataclass(frozen=True)
class FaultsConfig:
    """Faults injected into a simulated run (``sim.engine.faults``); none by default.

    ``transfer_failure_prob``: chance that one KV transfer attempt fails (drawn from a
    generator seeded by the run's seed). ``link_down``: ``[[start_s, end_s], ...]``, instants
    when the network between prefill and decode nodes is down; an attempt on the wire at any
    moment of one fails. A failed attempt is retried after ``retry_backoff_s``, at most
    ``max_retries`` times, then the request ends ``failed_transfer``. ``instance_loss``:
    ``[[decode_index, at_s], ...]``, decode instances lost at those instants; the requests
    whose KV cache it held end ``failed_instance_lost``, and those still waiting to be pulled
    fail too (``on_instance_loss = "fail"``) or go to another live decode instance
    (``"reroute"``)."""

    transfer_failure_prob: float = 0.0
    max_retries: int = 3
    retry_backoff_s: float = 0.01
    link_down: tuple = ()
    instance_loss: tuple = ()
    on_instance_loss: str = "fail"

    def __post_init__(self) -> None:
        _check_range("faults", "transfer_failure_prob", self.transfer_failure_prob, 0.0, 1.0)
        _check_range("faults", "max_retries", self.max_retries, 0, 1000, integer=True)
        _check_range("faults", "retry_backoff_s", self.retry_backoff_s, 0.0, 1e6)
        _check_choice("faults", "on_instance_loss", self.on_instance_loss, ON_INSTANCE_LOSS)
        object.__setattr__(self, "link_down", _pairs("link_down", self.link_down, "start_s",
                                                     "end_s", integer_first=False))
        for k, (start, end) in enumerate(self.link_down):
            if not start < end:
                raise ConfigError(f"faults.link_down[{k}]: start_s {start} must be before "
                                  f"end_s {end}")
        object.__setattr__(self, "instance_loss", _pairs("instance_loss", self.instance_loss,
                                                         "decode_index", "at_s",
                                                         integer_first=True))

    @property
    def active(self) -> bool:
        return bool(self.transfer_failure_prob or self.link_down or self.instance_loss)


#: how a cell's instances follow from [cluster] (``CellsConfig.instances``)
CELL_INSTANCES = ("split", "per-cell")


@dataclass(frozen=True)
class CellsConfig:
    """The cluster as ``count`` independent cells, router domains each with its own prefill
    and decode instances (``sim.runs.cells.run``); one cell by default. ``instances = "split"``:
    [cluster]'s instance counts are the whole cluster's, divided evenly among the cells (each
    must be a multiple of ``count``); ``"per-cell"``: every cell has [cluster]'s instances.
    The workload is always the whole service's, split across the cells by request id."""

    count: int = 1
    instances: str = "split"

    def __post_init__(self) -> None:
        _check_range("cells", "count", self.count, 1, 4096, integer=True)
        _check_choice("cells", "instances", self.instances, CELL_INSTANCES)
