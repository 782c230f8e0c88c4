"""Batches padded to their longest sequence ([serving] batch_padding = "longest"): the real
workers' batched model pads every prompt of a prefill batch to the longest and every block
table of a decode step to the longest, so the simulator prices a prefill batch at num_seqs x
its longest prompt and a decode step at (batch, batch x its longest context)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.engine.cluster import make_predictor, simulate
from sim.config import ConfigError, from_dict
from sim.models.table import TablePredictor
from sim.models.profile_dir import load_profile_dir
from tests.builders import make_config, random_trace
from traces.trace import Trace
from tests.test_profile_dir import PREFILL_TOKENS, TRUE_TRANSFER, make_profile_dir, \
    roofline
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


# -- the serving loop (loop.csv) -------------------------------------------------------------
LOOP_HEADER = "phase,batch,longest,total,seconds\n"


def test_loop_factors_are_median_ratios_and_scale_the_run(tmp_path):
    """loop.csv's steps over the tables' (padded) times: medians per phase scale every
    prefill batch and decode step of the run."""
    prof = make_profile_dir(tmp_path / "p", batch_padding="longest")
    table = load_profile_dir(prof).predictor()
    assert (table.prefill_factor, table.decode_factor) == (1.0, 1.0)   # no loop.csv
    rows = [("prefill", 1, 100, 100, 2.0), ("prefill", 2, 300, 310, 1.5),
            ("prefill", 1, 50, 50, 9.0), ("decode", 4, 200, 500, 3.0), ("decode", 1, 64, 64, 3.0)]
    lines = [f"{p},{b},{l},{t},{r * table.step_cost(p, b, l, t)!r}" for p, b, l, t, r in rows]
    fixed, gb_s = TRUE_TRANSFER["GN-HAWK"]          # linear in bytes: exact between points
    lines += [f"transfer,1,{n},{n},{r * (fixed + n * 2048 / (gb_s * 1e9))!r}"
              for n, r in ((100, 4.0), (300, 4.0), (50, 1.0))]
    (prof / "loop.csv").write_text(LOOP_HEADER + "\n".join(lines) + "\n")
    profile = load_profile_dir(prof)
    assert profile.loop["prefill"] == (pytest.approx(2.0, rel=1e-9), 3)
    assert profile.loop["decode"] == (pytest.approx(3.0, rel=1e-9), 2)
    assert profile.loop["transfer"] == (pytest.approx(4.0, rel=1e-9), 3)
    scaled, raw = profile.predictor(), profile.predictor(loop=False)
    assert scaled.prefill_time([40, 90]) == pytest.approx(2 * raw.prefill_time([40, 90]))
    assert scaled.decode_time(3, 300, 7) == pytest.approx(3 * raw.decode_time(3, 300, 7))
    rec = _run(prof, [100], [5]).iloc[0]
    assert rec.prefill_end_at - rec.prefill_start_at == pytest.approx(
        2 * raw.prefill_time([100]), rel=1e-12)
    steps = sum(raw.decode_step_time(1, 100 + k) for k in range(1, 5))
    assert rec.finished_at - rec.first_token_at == pytest.approx(3 * steps, rel=1e-9)
    assert rec.transfer_end_at - rec.transfer_start_at == pytest.approx(
        4 * (fixed + 100 * 2048 / (gb_s * 1e9)), rel=1e-9)
    other = from_dict({"cluster": {"profile": str(prof), "link": {"mechanism": "GG-Direct"}}})
    from sim.engine.measured import measured_parts
    assert measured_parts(other).pricing.factor == 1.0   # the session ran GN-HAWK only


@pytest.mark.parametrize("text, message", [
    ("phase,batch,seconds\n", "loop.csv:1: header"),
    (LOOP_HEADER + "verify,1,2,2,0.1\n", "loop.csv:2: expected"),
    (LOOP_HEADER + "decode,1,2,2,0.1\ndecode,1,2,2,-3\n", "loop.csv:3: seconds = '-3'"),
])
def test_bad_loop_file_is_named(tmp_path, text, message):
    prof = make_profile_dir(tmp_path / "p")
    (prof / "loop.csv").write_text(text)
    with pytest.raises(ConfigError, match=message):
        from_dict({"cluster": {"profile": str(prof)}})


def test_step_log_rows_and_periods(tmp_path):
    """A worker's step log: one row per model step; a period only between two steps with no
    wait and no model-less iteration between them."""
    import csv

    from hardware.serve.worker import StepLog

    log = StepLog(str(tmp_path), "decode", 0)
    log.step([10, 30], 0.01)          # first: no period
    log.step([11, 31], 0.01)          # period
    log.waited()
    log.step([5], 0.02)               # after a wait: none
    log.step([], 0.0)                 # no model call
    log.step([6], 0.02)               # none: the previous iteration made no step
    log.file.close()
    with open(tmp_path / "decode0.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["batch"], r["longest"], r["total"]) for r in rows] == [
        ("2", "30", "40"), ("2", "31", "42"), ("1", "5", "5"), ("1", "6", "6")]
    assert [bool(r["period_s"]) for r in rows] == [False, True, False, False]
    assert float(rows[1]["period_s"]) >= 0


def test_a_landed_request_wakes_the_idle_decode_loop():
    """The puller wakes the decode worker's main loop when a request's KV lands (an idle loop
    waits on the router's inbox; without the wake-up the request waited up to the 50 ms poll
    for its first token)."""
    import queue

    from hardware.serve.worker import Puller

    class Pool:
        num_blocks, num_free = 8, 8

    class Sink:
        pool = Pool()

        def blocks_needed(self, rid):
            return 1

    class Engine:
        sink = Sink()

    class Link:
        def __init__(self):
            self.inbox, self.sent = queue.Queue(), []

        def send(self, msg):
            self.sent.append(msg)

    class Client:
        def pull(self, rid):
            return type("Result", (), {"nbytes": 64})()

    link = Link()
    puller = Puller(Engine(), None, "token", link, 1.0)
    puller._client = lambda p: Client()
    puller.todo.put({"rid": "r1", "prefill": 0, "prompt_len": 5, "first_token": 3,
                     "max_tokens": 4})
    assert link.inbox.get(timeout=60) == {"op": "landed"}
    assert puller.landed.get_nowait().request_id == "r1"
    assert [m["ev"] for m in link.sent] == ["transferred"]
