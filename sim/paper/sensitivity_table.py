"""The sensitivity table as text (``sim.paper.sensitivity`` computes it): its TOML
(``to_toml``, ``load``) and the section of ``hawk paper``'s report (``sensitivity_markdown``)."""

from __future__ import annotations

import math
from pathlib import Path

#: a parameter moving no target by this many tolerances across its range moves nothing
NEGLIGIBLE = 0.1
PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"


def to_toml(result: dict) -> str:
    """The table as TOML: one ``[[parameter]]`` per row, its moves by target."""
    lines = ["# One paper-profile parameter at a time at either bound (others at the profile's",
             "# values): each target's largest move in tolerances (sim/paper/sensitivity.py).",
             f'profile = "{result["profile"]}"', f"negligible = {result['negligible']}", ""]
    for r in result["rows"]:
        lines += ["[[parameter]]", f'name = "{r["parameter"]}"', f"value = {r['value']:.6g}",
                  f"low = {r['low']:.6g}", f"high = {r['high']:.6g}",
                  f"largest_move = {_num(r['largest_move'])}", f'moved_most = "{r["moved_most"]}"',
                  f"moves_nothing = {str(r['moves_nothing']).lower()}",
                  f"source = {_quoted(r.get('source', ''))}",
                  "[parameter.moves]"]
        lines += [f'"{k}" = {_num(v)}' for k, v in r["moves"].items()]
        lines.append("")
    return "\n".join(lines)


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _num(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else "nan"


def load(profile: str = "paper") -> dict | None:
    """The written table of ``profile``, or None."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = PROFILE_DIR / f"{profile}_sensitivity.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else None


def sensitivity_markdown(table: dict | None) -> list[str]:
    """The report's sensitivity section from ``load``'s table (nothing without one)."""
    if not table:
        return []
    lines = ["", "## Sensitivity of the figures to each fitted parameter", "",
             "Each parameter alone at either bound, the others at the profile's values, on the "
             "fit's reduced sweeps: the largest move of any target, in tolerances (1 = one "
             f"tolerance; under {table['negligible']}: moves nothing).", "",
             "| parameter | value | bounds | largest move | target moved most | source |",
             "|---|---|---|---|---|---|"]
    for p in table["parameter"]:
        note = " (moves nothing)" if p["moves_nothing"] else ""
        lines.append(f"| {p['name']} | {p['value']:.4g} | {p['low']:.4g}-{p['high']:.4g} | "
                     f"{p['largest_move']:.2f}{note} | {p['moved_most']} | "
                     f"{p.get('source', '')} |")
    return lines
