"""Metric definitions on tiny hand-made record sets."""

import math

import pytest

from traces import metrics
from traces.schema import RequestRecord, Status, records_from_list


def rec(i, status=Status.OK, arrival=0.0, first=1.0, done=2.0, n=11, **kw):
    return RequestRecord(i, arrival, 100, n, status, first_token_at=first, finished_at=done,
                         num_generated_tokens=n if status is Status.OK else 0, **kw)


def test_ttft_tpot_definitions():
    frame = records_from_list([rec(0, arrival=1.0, first=1.5, done=3.5, n=21)])
    assert metrics.ttft(frame)[0] == pytest.approx(0.5)
    assert metrics.tpot(frame)[0] == pytest.approx(0.1)         # 2 s over 20 gaps


def test_single_token_requests_meet_any_tpot_slo():
    frame = records_from_list([rec(0, first=0.5, done=0.5, n=1)])
    assert math.isnan(metrics.tpot(frame)[0])
    assert metrics.slo_attainment(frame, ttft_slo_s=1.0, tpot_slo_s=1e-9) == 1.0


def test_failed_and_unfinished_requests_count_as_misses():
    frame = records_from_list([
        rec(0, first=0.1, done=1.1, n=11),                    # meets both
        rec(1, first=3.0, done=4.0, n=11),                    # TTFT miss
        rec(2, first=0.1, done=5.1, n=11),                    # TPOT miss (0.5 s)
        rec(3, status=Status.FAILED_OUT_OF_MEMORY, first=math.nan),
        rec(4, status=Status.UNFINISHED, first=0.2, done=math.nan),
    ])
    assert metrics.slo_attainment(frame, 2.0, 0.2) == pytest.approx(1 / 5)
    summary = metrics.summarize(frame, 2.0, 0.2)
    assert summary["num_finished"] == 3
    assert summary["num_failed"] == 1 and summary["num_unfinished"] == 1


def test_knee_is_the_highest_rate_meeting_the_target():
    assert metrics.knee([0.1, 0.2, 0.3, 0.4], [1.0, 0.95, 0.91, 0.5]) == 0.3
    assert metrics.knee([0.4, 0.1, 0.3, 0.2], [0.5, 1.0, 0.91, 0.95]) == 0.3   # any order
    assert metrics.knee([0.1, 0.2], [0.9, 0.89]) == 0.1                       # >= target
    assert metrics.knee([0.1, 0.2, 0.3], [0.95, 0.85, float("nan")]) == 0.1   # NaN: a miss


def test_knee_interpolates_where_attainment_crosses_the_target():
    # 0.95 at 0.2, 0.85 at 0.3: 0.9 is crossed half-way, at 0.25
    assert metrics.knee([0.1, 0.2, 0.3], [1.0, 0.95, 0.85], interpolate=True) == pytest.approx(0.25)
    # 0.92 at 1.0, 0.82 at 2.0: a fifth of the way, 1.2
    assert metrics.knee([1.0, 2.0], [0.92, 0.82], interpolate=True) == pytest.approx(1.2)
    assert metrics.knee([0.1, 0.2], [0.9, 0.5], interpolate=True) == 0.1      # on the target


def test_knee_when_no_rate_or_every_rate_passes():
    for interpolate in (False, True):
        assert math.isnan(metrics.knee([0.1, 0.2], [0.5, 0.4], interpolate=interpolate))
        assert math.isnan(metrics.knee([], [], interpolate=interpolate))
        # beyond the swept range: the highest rate, never an extrapolation
        assert metrics.knee([0.1, 0.2], [1.0, 0.99], interpolate=interpolate) == 0.2


def test_a_noisy_dip_keeps_the_higher_passing_rate():
    rates, att = [0.1, 0.2, 0.3, 0.4], [1.0, 0.89, 0.93, 0.7]
    assert metrics.knee(rates, att) == 0.3                 # not 0.1, the first crossing
    # interpolated after the highest passing rate: 0.93 at 0.3, 0.7 at 0.4 -> 0.3 + 0.03/0.23 * 0.1
    assert metrics.knee(rates, att, interpolate=True) == pytest.approx(0.3 + 0.1 * 3 / 23)
    assert metrics.knee([0.1, 0.2, 0.3], [0.5, 0.95, 0.6]) == 0.2     # the lowest rate misses


def test_sweep_summary_knee_of_means_and_of_each_seed():
    from sim.runs.sweep import SweepPoint, summarize_sweep

    summary = {0: [1.0, 0.95, 0.91, 0.5], 1: [1.0, 0.89, 0.93, 0.7]}
    points = [SweepPoint(rate, seed, {"slo_attainment": att[k], "ttft_p90_s": 1.0,
                                      "tpot_p90_s": 0.1, "output_tokens_per_s": rate,
                                      "num_failed": 0})
              for seed, att in summary.items() for k, rate in enumerate([0.1, 0.2, 0.3, 0.4])]
    out = summarize_sweep(points)
    assert out["knee_by_seed"] == {0: 0.3, 1: 0.3}
    assert out["knee_rate"] == 0.3                    # means 1.0, 0.92, 0.92, 0.6
    assert [r["slo_attainment"] for r in out["rows"]] == pytest.approx([1.0, 0.92, 0.92, 0.6])
    summary[1][2] = 0.85
    points = [SweepPoint(p.rate, p.seed, {**p.summary, "slo_attainment": summary[p.seed][
        [0.1, 0.2, 0.3, 0.4].index(p.rate)]}) for p in points]
    out = summarize_sweep(points)
    assert out["knee_by_seed"] == {0: 0.3, 1: 0.1} and out["knee_rate"] == 0.2


def staged(i, arrival, *instants, status=Status.OK):
    """A record with prefill start/end, transfer start/end and first token at ``instants``."""
    ps, pe, ts, te, f = instants
    return RequestRecord(i, arrival, 100, 3, status, prefill_start_at=ps, prefill_end_at=pe,
                         transfer_start_at=ts, transfer_end_at=te, first_token_at=f,
                         finished_at=f + 1.0, num_generated_tokens=3)


def test_ttft_stages_add_up_to_ttft():
    frame = records_from_list([staged(0, 0.0, 1.0, 3.0, 3.5, 4.0, 4.25),
                               staged(1, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0)])
    out = metrics.ttft_breakdown(frame)
    assert out["ttft_queue_mean_s"] == pytest.approx(0.5)           # 1.0 and 0.0
    assert out["ttft_prefill_mean_s"] == pytest.approx(1.5)         # 2.0 and 1.0
    assert out["ttft_transfer_wait_mean_s"] == pytest.approx(0.25)  # 0.5 and 0.0
    assert out["ttft_transfer_mean_s"] == pytest.approx(0.75)       # 0.5 and 1.0
    assert out["ttft_first_decode_mean_s"] == pytest.approx(0.125)  # 0.25 and 0.0
    assert out["ttft_prefill_p90_s"] == pytest.approx(1.9)
    total = sum(out[f"ttft_{s}_mean_s"] for s, _, _ in metrics.TTFT_STAGES)
    assert total == pytest.approx(metrics.ttft(frame).mean())


def test_ttft_stages_are_nan_where_no_instants_were_recorded():
    out = metrics.ttft_breakdown(records_from_list([rec(0)]))       # replay: first token only
    assert all(math.isnan(v) for v in out.values())


def test_utilization_and_the_busiest_resource():
    stats = {"prefill_busy_s": [2.0, 4.0], "decode_busy_s": [5.0], "link_busy_s": 1.0}
    out = metrics.utilization(stats, 10.0)
    assert out == {"prefill_utilization": 0.3, "link_utilization": 0.1,
                   "decode_utilization": 0.5, "bottleneck": "decode"}


def test_decode_load_is_its_batch_slots_in_use_not_its_busy_time():
    # two requests decode for 5 s each over a 10 s run: one in decode on average
    frame = records_from_list([rec(0, first=1.0, done=6.0), rec(1, first=2.0, done=7.0),
                               rec(2, Status.FAILED_TIMEOUT, first=None, done=3.0)])
    assert metrics.mean_in_decode(frame, 10.0) == pytest.approx(1.0)
    stats = {"prefill_busy_s": [4.0], "decode_busy_s": [10.0], "link_busy_s": 1.0}
    out = metrics.utilization(stats, 10.0, decode_occupancy=1.0 / 4)   # 1 of 4 slots
    assert out["decode_utilization"] == 1.0 and out["decode_occupancy"] == 0.25
    assert out["bottleneck"] == "prefill"             # iterating all the time is not "full"


def test_every_failure_status_has_a_reason():
    statuses = {s.value: 1 for s in Status}
    reasons = metrics.failure_reasons(statuses)
    assert len(reasons) == len(Status) - 1
    assert not any("see traces.schema" in r for r in reasons)
    assert "rejected_prompt_too_long: 1 (prompt over the batch token budget" in reasons[2]
