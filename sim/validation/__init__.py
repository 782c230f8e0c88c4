"""The simulator against measurements of the real mode: the roofline and transfer model
fitted to a measured profile directory (``fit_profile``), and the real mode and the
simulator run on the same requests, paired, with errors per metric and their blame
(``errors``, ``run``).

May import ``sim.runs``, ``sim.engine``, ``sim.models`` and ``sim.config``; never
``sim.paper``, a benchmark or a command."""
