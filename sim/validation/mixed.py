"""The mixed steps a profile of ``hawk real profile --shape aggregated`` measured (``mixed.csv``:
decodes and a prompt chunk in one step) beside what the table predictor makes of them
(``TablePredictor.mixed_step_time``, the prefill and decode tables combined): how far the
simulator's step time for a mixed step is from the aggregated worker's, on the profile alone.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

MIXED_FILE = "mixed.csv"


def mixed_vs_table(profile) -> dict | None:
    """``{"median_ratio", "points": [{batch, context_per_request, chunk_tokens, measured_s,
    table_s}]}`` (ratio: measured / table), or None when the profile has no mixed.csv."""
    from sim.models.profile_dir import load_profile_dir

    path = Path(profile) / MIXED_FILE
    if not path.is_file():
        return None
    table = load_profile_dir(profile).predictor()
    points = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            b, c, t = (int(float(row[k])) for k in ("batch", "context_per_request",
                                                    "chunk_tokens"))
            points.append({"batch": b, "context_per_request": c, "chunk_tokens": t,
                           "measured_s": float(row["seconds_p50"]),
                           "table_s": table.mixed_step_time([(t, 0)], [c] * b)})
    if not points:
        return None
    ratio = float(np.median([p["measured_s"] / p["table_s"] for p in points]))
    return {"median_ratio": ratio, "points": points}


def describe(check: dict | None) -> list[str]:
    if check is None:
        return []
    lines = [f"mixed steps / the table predictor's mixed_step_time: median "
             f"{check['median_ratio']:.3g} over {len(check['points'])} points ({MIXED_FILE})"]
    lines += [f"  {p['batch']} decodes at {p['context_per_request']} + a chunk of "
              f"{p['chunk_tokens']}: measured {1e3 * p['measured_s']:.2f} ms, tables "
              f"{1e3 * p['table_s']:.2f} ms" for p in check["points"]]
    return lines
