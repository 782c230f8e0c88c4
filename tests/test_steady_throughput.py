"""Steady-state output throughput: in a stable system it equals the offered token rate of its
window (conservation), where the whole-run figure falls short by the ramp and the drain."""

import numpy as np
import pandas as pd
import pytest

from builders import make_config
from sim.engine.cluster import simulate
from traces import metrics


def test_steady_throughput_is_the_offered_rate_in_a_stable_run():
    steady, whole = [], []
    for seed in (0, 1, 2, 3):
        frame = simulate(make_config(**{"workload.num_requests": 300, "workload.rate": 1.0,
                                        "seed": seed})).records
        arrivals = frame["arrival_at"].to_numpy()
        lo, hi = np.quantile(arrivals, [0.1, 0.9])
        offered = ((arrivals >= lo) & (arrivals <= hi)).sum() / (hi - lo) * \
            frame["num_generated_tokens"].mean()
        steady.append(metrics.steady_output_tokens_per_s(frame) / offered)
        whole.append(metrics.output_tokens_per_s(frame) / offered)
    assert np.mean(steady) == pytest.approx(1.0, abs=0.05)
    assert np.mean(whole) < 0.92                     # the ramp and the drain dilute it


def test_tokens_are_spread_over_each_requests_decode_span():
    """One request: first token at 2, nine more evenly to 11; the window [1, 9] of the
    arrivals' quantiles (trim 0 over arrivals at 1 and 9) holds 1 + 9 x 7/9 = 8 tokens."""
    frame = pd.DataFrame({"arrival_at": [1.0, 9.0], "first_token_at": [2.0, 20.0],
                          "finished_at": [11.0, 21.0], "num_generated_tokens": [10, 1],
                          "status": ["ok", "ok"]})
    assert metrics.steady_output_tokens_per_s(frame, trim=0.0) == pytest.approx(8.0 / 8.0)
    with pytest.raises(ValueError, match="trim = 0.5 must be in"):
        metrics.steady_output_tokens_per_s(frame, trim=0.5)
