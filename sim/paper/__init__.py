"""The paper (HAWK, section 6): its experiments (``experiments``), each claim as a check
(``checks``), the report with plots (``report``), the fit of the paper profile's free
parameters to named targets (``calibrate``, ``fit``, ``fit_record``), and each device against
its published measurements (``device_points``, ``devices_check``, ``devices_fit``,
``devices_report``).

May import ``sim.runs``, ``sim.engine``, ``sim.models`` and ``sim.config``; never
``sim.validation``, a benchmark or a command."""
