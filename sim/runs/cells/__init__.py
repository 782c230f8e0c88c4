"""Cells: a large cluster simulated as independent router domains. ``run``: split the
requests, run the cells (serially, on processes or on Ray) and merge their records;
``stream``: cells that stream their records and return aggregates; ``summary``: the merged
summary computed from a merged records file.

The same imports as ``sim.runs``."""
