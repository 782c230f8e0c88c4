"""How time passes: the SimPy model of one cluster. ``cluster.simulate(config)`` wires the
router, prefill instances, the KV link and decode instances (with their memory, preemption
and faults), runs a trace through them and returns the ledger's records; ``stream`` does the
same in bounded memory; ``measured`` builds the parts from a measured profile instead of the
catalogs; ``timers`` holds the one place that touches SimPy's event queue.

May import ``sim.models`` and ``sim.config`` (and ``traces``, ``policies``, ``hardware``);
never a run, the paper, validation, a benchmark or a command."""
