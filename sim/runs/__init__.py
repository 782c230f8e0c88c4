"""Many simulations and what they answer: rate sweeps and the knee (``sweep``), independent
cells of a large cluster (``cells``), the paired comparison of two configurations
(``compare``), and capacity planning (``capacity``: the cheapest and the most power-efficient
clusters that meet the SLOs).

May import ``sim.engine``, ``sim.models`` and ``sim.config``; never the paper, validation, a
benchmark or a command."""
