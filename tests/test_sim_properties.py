"""Invariants of any run: conservation, timestamp order, capacity, determinism."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hardware import catalog
from sim.engine.cluster import simulate
from sim.models.table import TablePredictor
from tests.builders import checked_simulate, make_config, make_trace, random_trace
from traces.schema import Status, read_records, write_records

ORDER = ["arrival_at", "prefill_start_at", "prefill_end_at", "transfer_start_at",
         "transfer_end_at", "first_token_at", "finished_at"]


def check_invariants(trace, records):
    # conservation: one record per request, each in exactly one final state
    assert len(records) == len(trace)
    assert sorted(records["request_id"]) == sorted(trace.request_id.tolist())
    assert records["status"].isin([s.value for s in Status]).all()
    ok = records[records["status"] == "ok"]
    # order of instants for every request that completed
    times = ok[ORDER].to_numpy()
    assert not np.isnan(times).any()
    assert (np.diff(times, axis=1) >= -1e-12).all()
    assert (ok["num_generated_tokens"] == ok["num_output_tokens"]).all()
    assert (ok["transfer_end_at"] == ok["first_token_at"]).all()
    # a rejected request never ran anywhere
    rejected = records[records["status"].str.startswith("rejected")]
    assert rejected["prefill_start_at"].isna().all()
    assert (rejected["num_generated_tokens"] == 0).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rate=st.floats(0.2, 6.0), prefills=st.integers(1, 3),
       decodes=st.integers(1, 3), batch=st.integers(1, 64), buffer_gb=st.floats(0.0, 3.0))
def test_every_request_ends_once_in_order(seed, rate, prefills, decodes, batch, buffer_gb):
    trace = random_trace(np.random.default_rng(seed), 120, rate, max_prompt=9000)
    config = make_config(**{"cluster.prefill.num_instances": prefills,
                            "cluster.decode.num_instances": decodes,
                            "cluster.decode.max_batch_size": batch,
                            "cluster.prefill.kv_cache_gb": buffer_gb,
                            "cluster.prefill.max_batch_tokens": 8192,
                            "cluster.policies.prefill_batching": "fcfs"})   # whole prompts
    result = checked_simulate(config, trace)
    check_invariants(trace, result.records)
    too_long = trace.num_prompt_tokens > 8192
    statuses = result.records["status"].to_numpy()
    assert (statuses[too_long] == "rejected_prompt_too_long").all()


def test_decode_back_pressure_reaches_prefill():
    """A decode pool with room for two requests and a send buffer for three: prefill must
    wait until decode finishes a request, and nothing is lost."""
    n = 12
    trace = make_trace(np.zeros(n), [2000] * n, [50] * n)
    base = make_config(**{"cluster.prefill.max_batch_size": 1})
    model = catalog.model(base.cluster.model)
    per_prefill = 2000 * model.kv_bytes_per_token(base.cluster.prefill.kv_dtype) / 1e9
    per_decode = 2080 * model.kv_bytes_per_token(base.cluster.decode.kv_dtype) / 1e9
    config = base.replace(**{"cluster.prefill.kv_cache_gb": 3.5 * per_prefill,
                             "cluster.decode.kv_cache_gb": 2.5 * per_decode,
                             "cluster.decode.max_num_blocks": 0})
    # prefill 0.1 s per request, decode 50 ms per step: a request decodes for ~2.5 s
    table = TablePredictor([1, 10_000], [0.1, 0.1], [1, 64], [0, 1e7], [[0.05, 0.05]] * 2)
    result = checked_simulate(config, trace, predictors=(table, table))
    records = result.records.sort_values("request_id")
    check_invariants(trace, records)
    assert (records["status"] == "ok").all()
    first_finish = records["finished_at"].min()
    prefill_start = records["prefill_start_at"].to_numpy()
    # 2 pulled by decode + 3 held in the send buffer; the 6th waits for a decode finish
    assert (prefill_start[:5] < first_finish).all()
    assert prefill_start[5] >= first_finish
    # never more than two requests hold decode blocks at once
    pulled = records["transfer_start_at"].to_numpy()
    done = records["finished_at"].to_numpy()
    for t in pulled:
        assert ((pulled <= t) & (done > t)).sum() <= 2


def test_requests_that_can_never_fit_fail_with_named_statuses():
    config = make_config(**{"cluster.prefill.max_batch_tokens": 4096,
                            "cluster.policies.prefill_batching": "fcfs",   # whole prompts
                            "cluster.decode.kv_cache_gb": 0.0})
    trace = make_trace([0.0, 0.1, 0.2, 0.3], [100, 5000, 100, 120_000], [10, 10, 10, 12_000])
    records = simulate(config, trace).records
    assert records["status"].tolist() == ["ok", "rejected_prompt_too_long", "ok",
                                          "rejected_prompt_too_long"]
    # chunked prefill splits the 5,000-token prompt over iterations; the context limit stays
    chunked = config.replace(**{"cluster.policies.prefill_batching": "chunked"})
    result = simulate(chunked, trace)
    assert result.records["status"].tolist() == ["ok", "ok", "ok", "rejected_prompt_too_long"]
    alone = simulate(chunked, make_trace([0.0], [5000], [10]))
    assert sum(alone.stats["prefill_batches"]) == 2             # 4,096 + 904 tokens
    small_decode = make_config(**{"cluster.decode.memory_utilization": 0.4,
                                  "cluster.decode.max_num_blocks": 0})
    huge = make_trace([0.0, 1.0], [3000, 100], [120_000, 10])
    records = simulate(small_decode, huge).records
    assert records["status"].tolist() == ["rejected_decode_capacity", "ok"]


def test_cut_runs_record_unfinished_requests():
    trace = random_trace(np.random.default_rng(1), 50, 2.0)
    result = checked_simulate(make_config(), trace, until=10.0)
    records = result.records
    statuses = set(records["status"])
    assert "unfinished" in statuses and len(records) == 50
    instants = records[[c for c in records.columns if c.endswith("_at") and c != "arrival_at"]]
    assert not (instants > 10.0).any().any()          # nothing after the cut is shown
    ok = records["status"] == "ok"
    assert (records.loc[ok, "finished_at"] <= 10.0).all()
    assert (records.loc[~ok, "num_generated_tokens"] == 0).all()


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_same_seed_same_bytes(tmp_path, suffix):
    config = make_config(**{"workload.num_requests": 300, "seed": 11})
    paths = []
    for k in range(2):
        path = tmp_path / f"run{k}{suffix}"
        write_records(simulate(config).records, path)
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    other = tmp_path / f"other{suffix}"
    write_records(simulate(config.replace(seed=12)).records, other)
    assert other.read_bytes() != paths[0].read_bytes()
    back = read_records(paths[0])
    assert len(back) == 300 and set(back["status"]) == {"ok"}


@pytest.mark.parametrize("seed,rate", [(0, 0.3), (1, 0.65), (2, 2.0)])
def test_lazy_admission_equals_one_timer_per_arrival(seed, rate):
    trace = random_trace(np.random.default_rng(seed), 300, rate, max_prompt=9000)
    config = make_config(**{"cluster.prefill.max_batch_tokens": 8192})
    lazy = simulate(config, trace).records
    eager = simulate(config, trace, eager_arrivals=True).records
    instants = [c for c in lazy.columns if c.endswith("_at")]
    others = [c for c in lazy.columns if c not in instants]
    assert lazy[others].equals(eager[others])
    # Lazy admission times a batch from the arrival, eager from a timer that fired at it:
    # the same instants up to rounding.
    a, b = lazy[instants].to_numpy(), eager[instants].to_numpy()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.nanmax(np.abs(a - b)) <= 1e-9


def test_monitor_counts_match_the_records_with_rejections_admitted_ahead():
    """The sampled number in system equals, at every sample, arrivals minus ends by then from
    the records, also when the router records rejections before or after their instant (a
    rejected request arrives and ends at once)."""
    rng = np.random.default_rng(4)
    trace = random_trace(rng, 400, 0.8, max_prompt=12_000)
    config = make_config(**{"cluster.prefill.max_batch_tokens": 8192,
                            "cluster.policies.prefill_batching": "fcfs"})   # whole prompts
    result = simulate(config, trace, monitor_interval_s=0.5)
    records = result.records
    assert (records["status"] == "rejected_prompt_too_long").sum() > 10
    arrivals = np.sort(records["arrival_at"].to_numpy())
    ends = np.sort(records["finished_at"].to_numpy())
    for t, count in result.stats["in_system"]:
        expected = np.searchsorted(arrivals, t, "right") - np.searchsorted(ends, t, "right")
        assert count == expected, t
