"""What things cost, as pure functions of a workload and a device: the latency predictors
(``predictor``: the roofline; ``table``: measured points), KV transfer pricing
(``transfer``), power and energy (``power``), prices and cost per request (``cost``), and the
measured profile directory's reader (``profile_dir``).

May import ``traces``, ``policies`` and ``hardware``; nothing else of ``sim``. Nothing here
touches a clock."""
