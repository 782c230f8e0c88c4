"""Batches padded to their longest sequence ([serving] batch_padding = "longest"): the real
workers' batched model pads every prompt of a prefill batch to the longest and every block
table of a decode step to the longest, so the simulator prices a prefill batch at num_seqs x
its longest prompt and a decode step at (batch, batch x its longest context)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.cluster import make_predictor, simulate
from sim.config import ConfigError, from_dict
from sim.predictor import TablePredictor
from sim.profile_dir import load_profile_dir
from tests.builders import make_config, random_trace
from traces.trace import Trace
from tests.test_profile_dir import PREFILL_TOKENS, make_profile_dir, roofline
from tests.test_sim_fast_forward import assert_same_instants, run_both

#: transfers of (almost) no time: the second request lands just after the first
INSTANT_TRANSFER = {"GN-HAWK": (1e-9, 1e6)}


def _run(prof, prompts, outputs):
    config = from_dict({"cluster": {"profile": str(prof)}, "seed": 0,
                        "workload": {"num_requests": len(prompts)}})
    n = len(prompts)
    return simulate(config, Trace(np.zeros(n), np.asarray(prompts), np.asarray(outputs),
                                  np.arange(n))).records


def test_padded_prefill_is_num_seqs_times_the_longest_prompt():
    grid = [roofline().prefill_time([t]) for t in PREFILL_TOKENS]
    rows = np.array([[1, t, s] for t, s in zip(PREFILL_TOKENS, grid)])
    decode = np.array([[1, 16, 0.01], [1, 64, 0.02]])
    padded = TablePredictor.from_points(rows, decode, batch_padding="longest")
    summed = TablePredictor.from_points(rows, decode)
    assert padded.prefill_time([10, 300, 40]) == pytest.approx(
        np.interp(900, PREFILL_TOKENS, grid), rel=1e-12)
    assert summed.prefill_time([10, 300, 40]) == pytest.approx(
        np.interp(350, PREFILL_TOKENS, grid), rel=1e-12)
    assert padded.prefill_time([128]) == summed.prefill_time([128])   # one prompt: no padding
    with pytest.raises(ValueError, match="batch_padding 'widest'"):
        TablePredictor.from_points(rows, decode, batch_padding="widest")


@pytest.mark.parametrize("padding", ["longest", "none"])
def test_decode_step_is_priced_at_batch_times_the_longest_context(tmp_path, padding):
    """A (prompt 200) lands first and runs one step alone; B (prompt 40) lands a nanosecond
    later and joins at that step's end, at iteration 1: A's context is 202, B's 41. Each of
    B's 5 steps is then the table's (2, 2 x A's context) padded, (2, A's + B's) summed."""
    prof = make_profile_dir(tmp_path / "p", transfer=INSTANT_TRANSFER, batch_padding=padding)
    rec = _run(prof, [200, 40], [30, 6])
    table = load_profile_dir(prof).predictor()
    assert table.batch_padding == padding
    a, b = rec.iloc[0], rec.iloc[1]
    prefill = np.interp(400 if padding == "longest" else 240, PREFILL_TOKENS,
                        [roofline().prefill_time([t]) for t in PREFILL_TOKENS])
    assert a.prefill_end_at - a.prefill_start_at == pytest.approx(prefill, rel=1e-12)
    joined = a.first_token_at + table.decode_step_time(1, 201)
    assert joined > b.first_token_at                     # B landed during A's first step
    totals = [2 * (202 + k) if padding == "longest" else 202 + 41 + 2 * k for k in range(5)]
    steps = sum(table.decode_step_time(2, t) for t in totals)
    assert b.finished_at - joined == pytest.approx(steps, rel=1e-9)


def test_profile_without_the_key_does_not_pad_and_a_bad_value_is_named(tmp_path):
    assert load_profile_dir(make_profile_dir(tmp_path / "a")).serving["batch_padding"] == "none"
    bad = make_profile_dir(tmp_path / "b", batch_padding="widest")
    with pytest.raises(ConfigError, match=r"\[serving\] batch_padding = 'widest'"):
        from_dict({"cluster": {"profile": str(bad)}})


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(0.5, 4.0), max_batch=st.integers(1, 24))
def test_fast_forward_matches_oracle_with_padding(seed, rate, max_batch):
    """The padded total grows by ``batch`` per step too: the closed-form runs stay exact."""
    config = make_config(**{"cluster.decode.max_batch_size": max_batch})
    roof = make_predictor(config, config.cluster.decode)
    table = TablePredictor.sample(roof, [1, 512, 2048, 8192], [1, 4, 16, 64],
                                  [0, 10_000, 100_000, 1_000_000])
    padded = TablePredictor.from_points(
        np.array([[1, t, s] for t, s in zip(*table._prefill.lines[0])]),
        np.array([[b, x, y] for b, (xs, ys) in zip(table._decode.keys, table._decode.lines)
                  for x, y in zip(xs, ys)]), batch_padding="longest")
    trace = random_trace(np.random.default_rng(seed), 120, rate, max_output=200)
    fast, slow = run_both(config, trace, predictors=(padded, padded))
    assert (fast["status"] == "ok").all()
    assert_same_instants(fast, slow)
