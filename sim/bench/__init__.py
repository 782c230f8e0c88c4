"""How fast the simulator runs, each against a baseline measured in the same run: ``speed``
(``hawk bench``: requests per bare SimPy event, output scaling, start-up, memory),
``instructions`` (the same counted by callgrind), ``cells`` (cells on 1 vs 2 workers),
``sweep`` (the paper's sweep in parallel) and ``startup`` (``hawk --help`` and the first
event beside a bare interpreter). Each is ``python -m sim.bench.<name>``.

May import every layer but ``sim.commands``."""
