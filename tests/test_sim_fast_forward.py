"""Decode fast-forward against the iteration-by-iteration oracle, and the closed forms."""

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from hardware import catalog
from sim.engine.cluster import make_predictor, simulate
from sim.paper.experiments import serving_config
from sim.models.predictor import Predictor
from sim.models.table import TablePredictor
from tests.builders import checked_simulate, make_config, make_trace, random_trace

INSTANTS = ["prefill_start_at", "prefill_end_at", "transfer_start_at", "transfer_end_at",
            "first_token_at", "finished_at"]


def run_both(config, trace, predictors=None):
    """Records of the fast path and the oracle, each decode instance checking its state's
    invariants after every timer firing and at the end (``tests.builders.checked_simulate``)."""
    fast = checked_simulate(config, trace, predictors=predictors).records
    slow = checked_simulate(config.replace(**{"cluster.fast_forward": False}), trace,
                            predictors=predictors).records
    return fast, slow


def assert_same_instants(fast, slow):
    assert (fast["status"] == slow["status"]).all()
    a, b = fast[INSTANTS].to_numpy(), slow[INSTANTS].to_numpy()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.nanmax(np.abs(a - b)) <= 1e-9
    assert (fast["decode_instance"] == slow["decode_instance"]).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(0.3, 4.0),
       max_batch=st.integers(1, 48), decodes=st.integers(1, 3))
def test_fast_forward_matches_oracle(seed, rate, max_batch, decodes):
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 150, rate, max_output=300)
    config = make_config(**{"cluster.decode.max_batch_size": max_batch,
                            "cluster.decode.num_instances": decodes})
    fast, slow = run_both(config, trace)
    assert (fast["status"] == "ok").all()
    assert_same_instants(fast, slow)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(1.0, 6.0),
       max_batch=st.integers(1, 48), decodes=st.integers(1, 3),
       blocks=st.integers(100, 400), swap=st.booleans())
def test_fast_forward_matches_oracle_through_preemption(seed, rate, max_batch, decodes, blocks,
                                                        swap):
    """Small pools under load: on-demand blocks run out mid-run and requests are preempted
    (recompute or swap) and restored; the runs agree instant for instant."""
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 150, rate, max_output=300)
    config = make_config(**{"cluster.decode.max_batch_size": max_batch,
                            "cluster.decode.num_instances": decodes,
                            "cluster.decode.max_num_blocks": blocks,
                            "cluster.decode.admission": "on-demand-swap" if swap
                            else "on-demand-recompute"})
    fast = checked_simulate(config, trace)
    slow = checked_simulate(config.replace(**{"cluster.fast_forward": False}), trace)
    assert fast.stats["decode_preemptions"] == slow.stats["decode_preemptions"]
    assert_same_instants(fast.records, slow.records)


def test_fast_forward_preempts_somewhere_in_the_property_above():
    """The property above is not vacuous: one of its cases preempts."""
    trace = random_trace(np.random.default_rng(3), 150, 3.0, max_output=300)
    config = make_config(**{"cluster.decode.max_batch_size": 32,
                            "cluster.decode.max_num_blocks": 200})
    assert simulate(config, trace).stats["decode_preemptions"][0] > 0


def test_restores_at_one_boundary_join_it_with_one_replan(monkeypatch):
    """Restores reserved at the boundary just reached join it with one plan for all of them
    (``sim.engine.preemption.plan_due``), each stalling the batch in turn: as the oracle has
    it."""
    from sim.engine import preemption

    restored_together = []
    plan_due = preemption.plan_due

    def spy(d, now):
        if d.room.rejoin:
            restored_together.append(len(d.room.restoring))
        plan_due(d, now)

    monkeypatch.setattr(preemption, "plan_due", spy)
    trace = random_trace(np.random.default_rng(4), 150, 4.0, max_output=300)
    config = make_config(**{"cluster.decode.max_batch_size": 32,
                            "cluster.decode.max_num_blocks": 200})
    fast, slow = run_both(config, trace)
    assert max(restored_together) >= 2
    assert_same_instants(fast, slow)


def test_changes_before_a_boundary_are_planned_there_while_requests_wait(monkeypatch):
    """With requests waiting for memory, a change mid-run (a landing, a reservation) ends the
    live run at the next boundary and plans nothing now: the changes made before that
    boundary are planned once, when it is reached; as the oracle has it."""
    from sim.engine.decode import DecodeInstance

    plans, planned = [0], []           # per change while requests wait: did it plan now?
    change, plan_from = DecodeInstance._change_at_next_boundary, DecodeInstance._plan_from

    def spy_plan(self, at):
        plans[0] += 1
        plan_from(self, at)

    def spy_change(self, now):
        before, waiting = plans[0], self.fast_forward and bool(self.pulls.pending)
        change(self, now)
        if waiting:
            planned.append(plans[0] > before)

    monkeypatch.setattr(DecodeInstance, "_plan_from", spy_plan)
    monkeypatch.setattr(DecodeInstance, "_change_at_next_boundary", spy_change)
    trace = random_trace(np.random.default_rng(4), 150, 4.0, max_output=300)
    config = make_config(**{"cluster.decode.max_batch_size": 32,
                            "cluster.decode.max_num_blocks": 200})
    fast, slow = run_both(config, trace)
    assert len(planned) >= 10 and not any(planned)
    assert_same_instants(fast, slow)


def test_fast_forward_matches_oracle_with_a_table_predictor():
    config = make_config(**{"cluster.decode.max_batch_size": 16})
    roofline = make_predictor(config, config.cluster.decode)
    table = TablePredictor.sample(roofline, [1, 512, 2048, 8192], [1, 4, 16, 64],
                                  [0, 10_000, 100_000, 1_000_000])
    trace = random_trace(np.random.default_rng(7), 200, 2.0)
    fast, slow = run_both(config, trace, predictors=(table, table))
    assert_same_instants(fast, slow)


def test_fast_forward_schedules_far_fewer_decode_timers():
    config = make_config()
    trace = random_trace(np.random.default_rng(3), 200, 1.0)
    fast = simulate(config, trace).stats["decode_iterations"]
    slow = simulate(config.replace(**{"cluster.fast_forward": False}), trace)
    assert fast == slow.stats["decode_iterations"]     # same work, counted the same


@pytest.mark.parametrize("batch,context,steps", [(1, 10, 1), (8, 7000, 500), (32, 100, 1000),
                                                 (64, 5_000_000, 300)])
def test_roofline_closed_form_sums_equal_stepwise_sums(batch, context, steps):
    config = make_config()
    for inst in (config.cluster.prefill, config.cluster.decode):
        p = make_predictor(config, inst)
        stepwise = np.cumsum([p.decode_step_time(batch, context + i * batch)
                              for i in range(steps)])
        assert p.decode_time(batch, context, steps) == pytest.approx(stepwise[-1], rel=1e-12)
        mid = steps // 2          # between boundaries: exact boundaries tie within rounding
        middle = (stepwise[mid - 1] + stepwise[mid]) / 2 if steps > 1 else stepwise[0] / 3
        for elapsed in (0.0, stepwise[0] / 2, middle, stepwise[-1] * 2):
            assert p.decode_steps_within(batch, context, steps, elapsed) == \
                Predictor.decode_steps_within(p, batch, context, steps, elapsed)


def test_roofline_decode_floor_matches_the_weight_streaming_bound():
    """At batch 1 and no context, a step is at least the weights / bandwidth floor."""
    config = make_config()
    m = catalog.model("llama-3.1-70b")
    for inst, floor_ms in ((config.cluster.prefill, 18.0), (config.cluster.decode, 22.8)):
        p = make_predictor(config, inst)
        dev = catalog.device(inst.device)
        floor = m.weight_bytes_read_per_step(inst.weight_format) / (4 * dev.memory_bandwidth_gb_s * 1e9)
        assert floor * 1e3 == pytest.approx(floor_ms, rel=0.02)
        assert p.decode_step_time(1, 0) > floor


@pytest.mark.parametrize("batch", [1, 64, 256, 1024])
def test_steps_within_where_the_winning_line_changes(batch):
    """Large batches start compute-bound and turn memory-bound as context grows."""
    config = make_config()
    p = make_predictor(config, config.cluster.prefill)
    steps, context = 3000, 1000
    cum = np.cumsum([p.decode_step_time(batch, context + i * batch) for i in range(steps)])
    for k in (0, 1, 17, 1500, 2998):
        elapsed = (cum[k] + cum[k + 1]) / 2
        assert p.decode_steps_within(batch, context, steps, elapsed) == k + 1


@pytest.mark.parametrize("batch", [1, 8, 256])
def test_next_boundary_closed_form_equals_the_stepwise_sum(batch):
    config = make_config()
    p = make_predictor(config, config.cluster.decode)
    steps, context = 400, 5000
    cum = np.cumsum([p.decode_step_time(batch, context + i * batch) for i in range(steps)])
    for elapsed in (0.0, 1e-6, cum[0], (cum[0] + cum[1]) / 2, (cum[200] + cum[201]) / 2,
                    cum[-1] * 0.9999, cum[-1] * 2):
        j, t = p.decode_next_boundary(batch, context, steps, elapsed)
        jj, tt = Predictor.decode_next_boundary(p, batch, context, steps, elapsed)
        assert j == jj and t == pytest.approx(tt, rel=1e-12)
        assert j == min(steps, int(np.searchsorted(cum, elapsed, side="left")) + 1) >= 1


def test_requests_landing_together_on_an_idle_instance_join_alike():
    """Two KV caches landing at the same instant on an idle instance: the first starts a run,
    the second joins at the first boundary, in both modes."""
    from tests.builders import make_trace

    trace = make_trace([0.0, 0.0, 0.0], [500, 500, 500], [40, 30, 20])
    fast, slow = run_both(make_config(), trace)
    assert_same_instants(fast, slow)
    assert fast["transfer_end_at"].duplicated().any()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(0.3, 4.0), max_batch=st.integers(1, 48),
       name=st.sampled_from(["GG-Host", "GN-Host", "GN-Direct"]))
def test_fast_forward_matches_oracle_under_host_slowdown_and_oom(seed, rate, max_batch, name):
    """Host-staged after phases change the step time mid-run; the single buffer fails some
    requests out of memory. Both must give the oracle's instants and statuses."""
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, 150, rate, max_output=300)
    config = serving_config(name).replace(**{"cluster.decode.max_batch_size": max_batch})
    fast, slow = run_both(config, trace)
    assert_same_instants(fast, slow)


@pytest.mark.parametrize("mechanism", ["GN-HAWK", "GN-Host"])
def test_busy_time_of_a_cut_run_matches_the_oracle(mechanism):
    """Cut anywhere, the fast-forward and the oracle spend the same seconds of [0, cut] busy
    (runs committed ahead of the cut count only up to it, live ones up to it too), the busy
    time grows with the cut, and an uncut run's totals come out the same either way."""
    config = make_config(**{"cluster.decode.max_batch_size": 8,
                            "cluster.link.mechanism": mechanism})
    trace = random_trace(np.random.default_rng(11), 120, 1.5, max_output=200)
    keys = ("prefill_busy_s", "decode_busy_s", "link_busy_s")
    last = None
    for cut in (7.3, 19.05, 33.3, 61.7, None):
        fast = checked_simulate(config, trace, until=cut).stats
        slow = checked_simulate(config.replace(**{"cluster.fast_forward": False}), trace,
                                until=cut).stats
        values = [np.ravel(fast[k]).sum() for k in keys]
        assert values == pytest.approx([np.ravel(slow[k]).sum() for k in keys], abs=1e-9)
        if cut is not None:
            assert all(v <= cut + 1e-12 for v in values)
            assert last is None or all(v >= w for v, w in zip(values, last))
            last = values
        assert min(values) > 0


@pytest.mark.parametrize("mechanism,decodes", [("GN-HAWK", 1), ("GN-Host", 2)])
def test_every_decode_wakeup_is_a_finish(mechanism, decodes):
    """Joins and step-time changes move the one timer of an instance (sim.engine.timers): it fires
    only where a run ends, at a finish, never stale or to re-arm (memory is ample here, so no
    run is cut short for blocks)."""
    config = make_config(**{"cluster.link.mechanism": mechanism,
                            "cluster.decode.num_instances": decodes})
    result = simulate(config, random_trace(np.random.default_rng(3), 300, 1.5))
    assert result.stats["decode_preemptions"] == [0] * decodes
    records = result.records[result.records["num_output_tokens"] > 1]   # 1: done on landing
    finishes = records.groupby("decode_instance")["finished_at"].nunique()
    assert result.stats["decode_wakeups"] == [finishes[k] for k in range(decodes)]


@pytest.mark.parametrize("seed,p,blocks", [(32652, 0.5884423198807431, 271),
                                           (140, 0.296875, 228)])
def test_a_request_landing_in_a_restore_stall_joins_after_the_stalled_step(seed, p, blocks):
    """A restore stalls the step that begins at a boundary; a second reservation before that
    boundary replans the run not yet begun, and must keep the boundary's instant: a request
    landing in the stall then joins a boundary later, as the oracle has it (the fast path
    once took the end of the stall for the boundary, and joined it a step early)."""
    trace = random_trace(np.random.default_rng(seed), 200, 3.0, max_output=300)
    config = make_config(**{"seed": seed, "cluster.decode.num_instances": 2,
                            "cluster.decode.max_num_blocks": blocks,
                            "faults.transfer_failure_prob": p,
                            "faults.link_down": [[15.0, 18.0]],
                            "faults.instance_loss": [[1, 40.0]]})
    fast, slow = run_both(config, trace)
    assert_same_instants(fast, slow)


def one_token_heavy_trace(seed: int, n: int = 200, rate: float = 3.0):
    """Poisson arrivals, a third of the requests asking for one token (they end as their KV
    lands, freeing its blocks between iteration boundaries)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(1, 3000, n)
    outputs = np.where(rng.random(n) < 0.3, 1, rng.integers(2, 300, n))
    return make_trace(arrivals, prompts, outputs)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), blocks=st.integers(150, 400),
       admission=st.sampled_from(["on-demand-recompute", "on-demand-swap"]))
@example(seed=19, blocks=380, admission="on-demand-recompute")
def test_preemption_waits_for_its_boundary_when_memory_is_freed_between_boundaries(
        seed, blocks, admission):
    """A change mid-run (a request landing) is planned from the next iteration boundary, ahead
    of the clock. If room must be made there, whom to preempt is decided when the boundary is
    reached: a one-token request ending as it lands (or a failed transfer) frees blocks before
    then, and the oracle, deciding at the boundary, preempts fewer (the fast path once decided
    at planning time and was off by minutes)."""
    config = make_config(**{"seed": seed, "cluster.decode.max_num_blocks": blocks,
                            "cluster.decode.admission": admission})
    fast, slow = run_both(config, one_token_heavy_trace(seed))
    assert_same_instants(fast, slow)


def test_preemption_waits_for_its_boundary_under_transfer_failures():
    """The same with faults: a transfer failing before a boundary planned ahead frees its
    reservation, which spares a request there."""
    trace = random_trace(np.random.default_rng(64910), 200, 3.0, max_output=300)
    config = make_config(**{"seed": 64910, "cluster.decode.num_instances": 2,
                            "cluster.decode.max_num_blocks": 261,
                            "faults.transfer_failure_prob": 0.30272895537477196,
                            "faults.link_down": [[15.0, 18.0]],
                            "faults.instance_loss": [[1, 40.0]]})
    fast, slow = run_both(config, trace)
    assert_same_instants(fast, slow)
