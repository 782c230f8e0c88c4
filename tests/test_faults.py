"""Faults in the simulator: failed transfers retried up to a limit, decode instances lost."""

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import sim.engine.cluster
from sim.engine.cluster import simulate
from sim.config import ConfigError
from traces.schema import write_records
from tests.builders import checked_simulate, make_config, random_trace

INSTANTS = ["prefill_start_at", "prefill_end_at", "transfer_start_at", "transfer_end_at",
            "first_token_at", "finished_at"]


def run(num_requests=200, rate=1.5, trace_seed=1, **changes):
    trace = random_trace(np.random.default_rng(trace_seed), num_requests, rate, max_output=300)
    return checked_simulate(make_config(**changes), trace)   # invariants: every step


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), p=st.floats(0.0, 0.8), retries=st.integers(0, 3),
       decodes=st.integers(1, 3), loss_at=st.one_of(st.none(), st.floats(5.0, 150.0)),
       reroute=st.booleans(), down=st.booleans())
def test_every_request_ends_once_and_every_buffer_is_freed(seed, p, retries, decodes, loss_at,
                                                           reroute, down):
    made = []                                   # the prefill instances, to check their buffers
    base = sim.engine.cluster.PrefillInstance
    sim.engine.cluster.PrefillInstance = lambda *a, **k: made.append(base(*a, **k)) or made[-1]
    try:
        result = run(trace_seed=seed, **{
            "seed": seed, "cluster.decode.num_instances": decodes,
            "cluster.decode.max_num_blocks": 400,
            "faults.transfer_failure_prob": p, "faults.max_retries": retries,
            "faults.link_down": [[20.0, 25.0]] if down else [],
            "faults.instance_loss": [] if loss_at is None else [[decodes - 1, loss_at]],
            "faults.on_instance_loss": "reroute" if reroute else "fail"})
    finally:
        sim.engine.cluster.PrefillInstance = base
    records = result.records
    allowed = {"ok", "failed_transfer", "failed_instance_lost"}
    assert set(records["status"]) <= allowed                   # and frame() checked: one each
    ok = records["status"] == "ok"
    assert (records["num_generated_tokens"] == np.where(ok, records["num_output_tokens"], 0)).all()
    done = records[ok]
    assert (done["transfer_end_at"] >= done["transfer_start_at"]).all()
    assert (done["finished_at"] >= done["first_token_at"]).all()
    lost = records[records["status"] == "failed_instance_lost"]
    if loss_at is None:
        assert lost.empty
    else:
        assert (lost["finished_at"] >= loss_at - 1e-9).all()
    for memory in result.stats["decode_memory"]:
        assert memory["occupancy"] == 0 and memory["num_requests"] == 0
    for prefill in made:
        assert prefill.free_blocks == result.stats["prefill_buffer_blocks"]


def test_attainment_falls_as_transfer_failures_rise():
    def attainment(p):
        return np.mean([run(trace_seed=s, **{"seed": s, "faults.transfer_failure_prob": p,
                                             "faults.max_retries": 0}).summary["slo_attainment"]
                        for s in range(3)])

    values = [attainment(p) for p in (0.0, 0.3, 0.7)]
    assert values[0] > values[1] > values[2]


def test_longer_link_outages_fail_more_transfers():
    def failed(length):
        r = run(**{"faults.link_down": [[30.0, 30.0 + length]], "faults.max_retries": 2,
                   "faults.retry_backoff_s": 0.05})
        return int((r.records["status"] == "failed_transfer").sum())

    counts = [failed(length) for length in (2.0, 10.0, 40.0)]
    assert counts[0] <= counts[1] < counts[2]


def test_each_request_is_tried_once_plus_its_retries():
    result = run(num_requests=30, **{"faults.transfer_failure_prob": 1.0,
                                     "faults.max_retries": 2})
    assert (result.records["status"] == "failed_transfer").all()
    assert result.stats["failed_transfer_attempts"] == 3 * 30
    assert result.stats["link_bytes"] == pytest.approx(3 * result.records["kv_bytes"].sum())


def test_same_seed_same_bytes_with_faults(tmp_path):
    changes = {"seed": 7, "faults.transfer_failure_prob": 0.3, "cluster.decode.num_instances": 2,
               "faults.instance_loss": [[1, 60.0]]}
    a = write_records(run(**changes).records, tmp_path / "a.csv")
    b = write_records(run(**changes).records, tmp_path / "b.csv")
    assert a.read_bytes() == b.read_bytes()
    other = write_records(run(**{**changes, "seed": 8}).records, tmp_path / "c.csv")
    assert other.read_bytes() != a.read_bytes()


def test_a_lost_instance_fails_its_requests_then_and_the_others_take_new_ones():
    at = 60.0
    records = run(**{"cluster.decode.num_instances": 2,
                     "faults.instance_loss": [[1, at]]}).records
    lost = records[records["status"] == "failed_instance_lost"]
    assert len(lost) > 0
    assert (lost["decode_instance"] == 1).all() and (lost["finished_at"] == at).all()
    later = records[records["prefill_end_at"] > at]
    assert (later["decode_instance"] == 0).all() and (later["status"] == "ok").all()


def test_rerouting_saves_the_requests_still_waiting_for_their_pull():
    changes = {"cluster.decode.num_instances": 2, "cluster.decode.max_num_blocks": 150,
               "faults.instance_loss": [[1, 60.0]]}
    failed = run(rate=3.0, **changes).records
    rerouted = run(rate=3.0, **{**changes, "faults.on_instance_loss": "reroute"}).records
    num_lost = (failed["status"] == "failed_instance_lost").sum()
    assert (rerouted["status"] == "failed_instance_lost").sum() < num_lost
    moved = (failed["status"] == "failed_instance_lost") & (rerouted["status"] == "ok")
    assert moved.any() and (rerouted.loc[moved, "decode_instance"] == 0).all()


def test_with_every_decode_instance_lost_new_requests_fail_by_name():
    records = run(**{"faults.instance_loss": [[0, 30.0]]}).records
    after = records[records["prefill_end_at"] > 30.0]
    assert len(after) > 0 and (after["status"] == "failed_instance_lost").all()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), p=st.floats(0.0, 0.6), blocks=st.integers(150, 400))
# A restore joined a boundary planned ahead; a pull before that boundary then redid it and
# preempted the restored request there, where the oracle makes room among the requests
# running before the boundary (preempting another) and lets nobody join.
@example(seed=224, p=0.5078125, blocks=320)
def test_fast_forward_stays_exact_through_faults_and_preemption(seed, p, blocks):
    changes = {"seed": seed, "cluster.decode.num_instances": 2,
               "cluster.decode.max_num_blocks": blocks, "faults.transfer_failure_prob": p,
               "faults.link_down": [[15.0, 18.0]], "faults.instance_loss": [[1, 40.0]]}
    fast = run(rate=3.0, trace_seed=seed, **changes).records
    slow = run(rate=3.0, trace_seed=seed, **{**changes, "cluster.fast_forward": False}).records
    assert (fast["status"] == slow["status"]).all()
    a, b = fast[INSTANTS].to_numpy(), slow[INSTANTS].to_numpy()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.nanmax(np.abs(a - b)) <= 1e-9


@pytest.mark.parametrize("faults,message", [
    ({"faults.link_down": [[5.0, 2.0]]}, r"faults.link_down\[0\]: start_s 5.0 must be before"),
    ({"faults.transfer_failure_prob": 1.5}, r"faults.transfer_failure_prob must be a number"),
    ({"faults.on_instance_loss": "retry"}, r"faults.on_instance_loss must be one of"),
    ({"faults.instance_loss": [[0]]}, r"faults.instance_loss\[0\] must be \[decode_index"),
    ({"faults.max_retries": -1}, r"faults.max_retries must be an integer"),
])
def test_bad_fault_settings_are_named(faults, message):
    with pytest.raises(ConfigError, match=message):
        make_config(**faults)


def test_losing_an_instance_the_cluster_lacks_is_named():
    with pytest.raises(ConfigError, match=r"faults.instance_loss\[0\]: decode_index 3, but the "
                                          r"cluster has 1 decode instance"):
        run(num_requests=5, **{"faults.instance_loss": [[3, 1.0]]})
