"""Tenants in traces and metrics: read from a trace's own column, made by the multi-customer
generator, carried into the records, and every summary broken down per tenant."""

import numpy as np
import pytest

from sim.engine.cluster import simulate
from sim.config import RunConfig
from traces.loaders import load_trace
from traces.schema import read_records, write_records
from traces.synthetic import (ArrivalSpec, Customer, WorkloadLengths, bursty_customers,
                              multi_tenant)
from traces.tenants import by_tenant

SPLITWISE = ("arrival_timestamp,prompt_size,token_size,application_id\n"
             "0.0,100,10,chat\n0.5,200,20,code\n0.7,50,5,chat\n")


def test_splitwise_application_id_becomes_the_tenant(tmp_path):
    path = tmp_path / "splitwise.csv"
    path.write_text(SPLITWISE)
    trace, report = load_trace(path)
    assert report.format == "splitwise"
    assert trace.tenant.tolist() == ["chat", "code", "chat"]
    assert trace.head(2).tenant.tolist() == ["chat", "code"]      # kept through selection


def test_a_trace_without_tenants_has_no_tenant_column(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text("arrival_timestamp,prompt_size,token_size\n0.0,100,10\n")
    trace, _ = load_trace(path)
    assert trace.tenant is None
    assert "tenant" not in simulate(RunConfig(), trace).records.columns


def test_multi_tenant_is_deterministic_and_customers_draw_independently():
    lengths = WorkloadLengths("chatbot")
    a = Customer("a", ArrivalSpec("poisson", 1.0), lengths)
    b = Customer("b", ArrivalSpec("onoff", 4.0, on_s=5.0, off_s=15.0), lengths)
    one = multi_tenant([a, b], 200.0, seed=7)
    assert np.array_equal(one.arrival_at, multi_tenant([a, b], 200.0, seed=7).arrival_at)
    assert np.all(np.diff(one.arrival_at) >= 0)
    assert one.request_id.tolist() == list(range(len(one)))
    alone = multi_tenant([a], 200.0, seed=7)
    assert np.array_equal(one.arrival_at[one.tenant == "a"], alone.arrival_at)
    # b is silent outside its on-periods: [0, 5), [20, 25), ...
    assert np.all(one.arrival_at[one.tenant == "b"] % 20.0 < 5.0)
    with pytest.raises(ValueError, match="unique"):
        multi_tenant([a, a], 10.0)


def test_bursty_customers_share_the_rate_evenly_over_the_long_run():
    trace = bursty_customers(rate=2.0, num_quiet=3, duration_s=2400, seed=1)
    counts = {t: int((trace.tenant == t).sum()) for t in np.unique(trace.tenant)}
    assert set(counts) == {"quiet-1", "quiet-2", "quiet-3", "bursty"}
    expected = 2.0 / 4 * 2400                       # 1,200 each
    for tenant, n in counts.items():
        assert abs(n - expected) < 5 * np.sqrt(expected), (tenant, n)


def test_records_and_summary_are_broken_down_per_tenant(tmp_path):
    trace = bursty_customers(rate=0.5, duration_s=300, seed=2)
    result = simulate(RunConfig(), trace)
    rec = result.records
    assert rec["tenant"].tolist() == trace.tenant.tolist()
    rows = result.summary["tenants"]
    assert list(rows) == ["bursty", "quiet-1", "quiet-2", "quiet-3"]
    assert sum(r["num_requests"] for r in rows.values()) == len(trace)
    assert sum(r["output_tokens_per_s"] for r in rows.values()) == pytest.approx(
        result.summary["output_tokens_per_s"])
    met = sum(r["slo_attainment"] * r["num_requests"] for r in rows.values())
    assert met / len(trace) == pytest.approx(result.summary["slo_attainment"])
    write_records(rec, tmp_path / "r.parquet")
    back = read_records(tmp_path / "r.parquet")
    assert back["tenant"].tolist() == rec["tenant"].tolist()
    assert by_tenant(back.drop(columns="tenant"), 2.0, 0.2) is None
