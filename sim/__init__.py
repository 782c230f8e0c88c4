"""The simulator, in layers; each may import the ones above it in this list, never one below:

    sim.models      what things cost: latency predictors, transfer pricing, power, prices,
                    measured profiles (imports only ``traces``, ``policies``, ``hardware``)
    sim.config      the run configuration: frozen dataclasses loaded from TOML
    sim.engine      how time passes: router, prefill, decode, link, faults, the ledger
    sim.runs        many runs: rate sweeps, cells, paired comparison, capacity planning
    sim.paper       the paper's experiments, its checks, its report and its fit
    sim.validation  the simulator against measurements of the real mode
    sim.bench       how fast the simulator itself runs
    sim.commands    the ``hawk`` command line, one module per command group

``sim.paper`` and ``sim.validation`` are peers and do not import each other.
``tests/test_structure.py`` holds these rules.
"""
