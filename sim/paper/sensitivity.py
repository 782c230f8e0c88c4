"""How far each paper figure moves when one fitted parameter moves across its bounds
(``sensitivity``; ``hawk calibrate --sensitivity``), and the table ``hawk paper``'s report
prints from it (``sensitivity_markdown``).

For every free parameter of ``sim.paper.calibrate.PARAMETERS``: its value in the profile, its
bounds, and every target's value with that parameter alone at its lower and at its upper
bound (the others at the profile's values), on the fit's reduced sweeps
(``sim.paper.calibrate.model``). A move is measured in tolerances (``sim.paper.checks.residual``:
1 = one tolerance), so knees, ratios and gaps compare. A parameter whose largest move is
under ``NEGLIGIBLE`` tolerances moves nothing and could be dropped. The table is written to
``sim/profiles/<profile>_sensitivity.toml`` and read back by the report
(``sim.paper.sensitivity_table``).
"""

from __future__ import annotations

from sim.paper.sensitivity_table import (  # noqa: F401  (the table's text lives there)
    NEGLIGIBLE, load, sensitivity_markdown, to_toml)


def profile_values(table: dict, params) -> dict[str, float]:
    """Each parameter's value in a profile's tables (``[efficiency.a100-pcie]`` is nested)."""
    out = {}
    for p in params:
        node = table
        for key in p.table.split("."):
            node = node[key]
        out[p.name] = float(node[p.key])
    return out


def source(template: str, param) -> str:
    """The comment beside a parameter's line in the profile's text (its stated source)."""
    section = None
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]")
        elif section == param.table and stripped.split("=")[0].strip() == param.key:
            return line.split("#", 1)[1].strip() if "#" in line else ""
    return ""


def table_from(base: dict, outputs: dict[tuple[str, str], dict], params, targets) -> list[dict]:
    """One row per parameter from the targets' values at the profile (``base``) and at each
    bound (``outputs[(name, "low" | "high")]``): each target's move in tolerances, the
    largest move and the target that makes it."""
    from sim.paper.checks import residual

    rows = []
    for p in params:
        moves = {}
        for t in targets:
            at = [residual(t, outputs[(p.name, side)].get(t.name)) for side in ("low", "high")]
            r0 = residual(t, base.get(t.name))
            moves[t.name] = max(abs(a - r0) for a in at)
        worst = max(moves, key=moves.get)
        rows.append({"parameter": p.name, "low": p.low, "high": p.high,
                     "largest_move": moves[worst], "moved_most": worst,
                     "moves_nothing": moves[worst] < NEGLIGIBLE, "moves": moves})
    return rows


def sensitivity(profile: str = "paper", workers: int = 2, cache_dir: str | None = None) -> dict:
    """Evaluate the reduced model at the profile and at each parameter's two bounds."""
    import functools
    import tempfile
    from pathlib import Path

    from sim.models.efficiency import load_profile_table
    from sim.paper.calibrate import PARAMETERS, PROFILE_DIR, model
    from sim.paper.checks import paper_targets
    from sim.paper.fit import _map

    template = (PROFILE_DIR / f"{profile}.toml").read_text()
    values = profile_values(load_profile_table(profile), PARAMETERS)
    vectors = [values] + [{**values, p.name: bound} for p in PARAMETERS
                          for bound in (p.low, p.high)]
    with tempfile.TemporaryDirectory(prefix="hawk-sens-") as scratch:
        workdir = cache_dir or scratch
        Path(workdir).mkdir(parents=True, exist_ok=True)
        outs = _map(functools.partial(model, template=template, workdir=workdir), vectors,
                    workers)
    base, rest = outs[0], iter(outs[1:])
    outputs = {(p.name, side): next(rest) for p in PARAMETERS for side in ("low", "high")}
    rows = table_from(base, outputs, PARAMETERS, paper_targets())
    for row, p in zip(rows, PARAMETERS):
        row["value"] = values[row["parameter"]]
        row["source"] = source(template, p)
    return {"profile": profile, "negligible": NEGLIGIBLE, "rows": rows}
