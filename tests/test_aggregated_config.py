"""Aggregated serving's step time (``mixed_step_time``), configuration and queueing theory."""

import numpy as np
import pytest

from hardware import catalog
from sim.config import ConfigError, RunConfig, from_dict, provenance
from sim.engine.cluster import simulate
from sim.models.predictor import RooflinePredictor, load_profile
from sim.models.table import TablePredictor
from tests.builders import make_trace
from tests.test_aggregated import StepClock


def _roofline(device="a100-pcie", tp=4, kv="fp8"):
    return RooflinePredictor(catalog.model("llama-3.1-70b"), catalog.device(device), tp,
                             load_profile()[device], "bfloat16", kv)


@pytest.mark.parametrize("device,tp", [("a100-pcie", 4), ("h100-sxm", 2), ("a100-pcie", 1)])
def test_pure_steps_equal_the_phases_exactly(device, tp):
    pred = _roofline(device, tp, "bfloat16")
    for n in (1, 17, 2048):
        assert pred.mixed_step_time([(n, 0)], []) == pred.prefill_time([n])
    for contexts in ([5], [100, 2000, 37], list(range(1, 65))):
        assert pred.mixed_step_time([], contexts) == pred.decode_step_time(len(contexts),
                                                                           sum(contexts))


def test_a_mixed_step_costs_less_than_its_phases_apart_and_more_than_either():
    pred = _roofline()
    decodes = [1500] * 32
    mixed = pred.mixed_step_time([(512, 0)], decodes)
    apart = pred.prefill_time([512]) + pred.decode_step_time(32, 1500 * 32)
    assert max(pred.prefill_time([512]), pred.decode_step_time(32, 48000)) < mixed < apart
    # a chunk attends to the context before it: later chunks of a prompt cost more
    assert pred.mixed_step_time([(512, 4096)], []) > pred.mixed_step_time([(512, 0)], [])


def test_table_predictor_mixed_step():
    table = TablePredictor.sample(_roofline(), [1, 512, 4096], [1, 8, 64], [0, 1000, 100000])
    assert table.mixed_step_time([(512, 0)], []) == table.prefill_time([512])
    assert table.mixed_step_time([], [600, 400]) == table.decode_step_time(2, 1000)
    both = table.mixed_step_time([(512, 0)], [600, 400])
    fixed = table.decode_step_time(1, 0)
    assert both == pytest.approx(table.prefill_time([512]) + table.decode_step_time(2, 1000)
                                 - fixed, rel=1e-12)


@pytest.mark.parametrize("rho", [0.5, 0.7])
def test_md1_mean_wait_of_an_aggregated_instance_with_one_token_outputs(rho):
    """One-token outputs and one sequence at a time: each request is one prefill step of a
    constant 1 s (the fake predictor), so the instance is an M/D/1 queue:
    Wq = rho / (2 mu (1 - rho))."""
    config = from_dict({"cluster": {"kind": "aggregated",
                                    "aggregated": {"max_batch_size": 1}}})
    waits = []
    for seed in (0, 1, 2, 3):
        rng = np.random.default_rng(seed)
        n = 40_000
        trace = make_trace(np.cumsum(rng.exponential(1 / rho, n)), [100] * n, [1] * n)
        rec = simulate(config, trace, predictors=(StepClock(1.0, 0.0),)).records
        assert (rec["status"] == "ok").all()
        waits.append(float((rec["prefill_start_at"] - rec["arrival_at"]).mean()))
    assert np.mean(waits) == pytest.approx(rho / (2 * (1 - rho)), rel=0.03)


def test_aggregated_defaults_come_from_the_device_serving_table():
    a100 = from_dict({"cluster": {"kind": "aggregated"}}).cluster.aggregated
    assert (a100.device, a100.max_batch_size, a100.max_batch_tokens) == ("a100-pcie", 256, 2048)
    h100 = from_dict({"cluster": {"kind": "aggregated",
                                  "aggregated": {"device": "h100-sxm"}}}).cluster.aggregated
    assert (h100.max_batch_size, h100.max_batch_tokens) == (1024, 8192)
    assert h100.sources["max_batch_tokens"] == "device"
    rows = provenance(from_dict({"cluster": {"kind": "aggregated"}}))
    assert "cluster.aggregated.max_batch_tokens" in rows
    assert not any(k.startswith(("cluster.prefill.", "cluster.link.")) for k in rows)


def test_the_default_cluster_stays_disaggregated_with_its_provenance_unchanged():
    rows = provenance(RunConfig())
    assert RunConfig().cluster.kind == "disaggregated"
    assert RunConfig().cluster.aggregated is None
    assert not any("aggregated" in k or k == "cluster.kind" for k in rows)


@pytest.mark.parametrize("cluster,field", [
    ({"kind": "aggregated", "link": {"mechanism": "GN-Direct"}}, "cluster.link"),
    ({"kind": "aggregated", "decode": {"tp": 2}}, "cluster.decode"),
    ({"aggregated": {"tp": 2}}, "cluster.aggregated"),
    ({"kind": "mixed"}, "cluster.kind"),
    ({"kind": "aggregated", "aggregated": {"max_batch_size": 4096}}, "max_batch_size"),
    ({"kind": "aggregated", "aggregated": {"admission": "oracle-reserve"}}, "admission"),
    ({"kind": "both", "pool_routing": "random"}, "cluster.pool_routing"),
])
def test_meaningless_settings_are_refused_by_name(cluster, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_dict({"cluster": cluster})


def test_a_kv_budget_that_cannot_hold_the_longest_request_is_refused():
    config = from_dict({"workload": {"num_requests": 50},
                        "cluster": {"kind": "aggregated", "aggregated": {"max_num_blocks": 8}}})
    with pytest.raises(ConfigError, match="cluster.aggregated: 8 KV blocks"):
        simulate(config)


def test_weights_that_do_not_fit_are_refused():
    config = from_dict({"workload": {"num_requests": 5},
                        "cluster": {"kind": "aggregated", "aggregated": {"tp": 1}}})
    with pytest.raises(ConfigError, match="cluster.aggregated: "):
        simulate(config)


def test_the_readme_example_config_runs():
    from pathlib import Path
    from sim.config import load_config

    path = Path(__file__).resolve().parents[1] / "examples" / "aggregated.toml"
    config = load_config(path).replace(**{"workload.num_requests": 50})
    result = simulate(config)
    assert result.summary["num_finished"] == 50


def test_cells_of_both_pools_are_refused_by_name():
    with pytest.raises(ConfigError, match="cells.count = 2"):
        from_dict({"cells": {"count": 2}, "cluster": {"kind": "both"}})


@pytest.mark.parametrize("instances,indices", [("split", [0, 1]), ("per-cell", [0, 1, 2, 3])])
def test_an_aggregated_cluster_runs_as_cells(tmp_path, instances, indices):
    import pandas as pd
    from sim.runs.cells.run import simulate_cells

    config = from_dict({"seed": 1, "workload": {"num_requests": 400, "rate": 1.0},
                        "cells": {"count": 2, "instances": instances},
                        "cluster": {"kind": "aggregated", "aggregated": {"num_instances": 2}}})
    result = simulate_cells(config, records_path=tmp_path / "r.parquet", workers=1)
    rec = pd.read_parquet(tmp_path / "r.parquet")
    assert (rec["status"] == "ok").all() and len(rec) == 400
    assert sorted(rec["decode_instance"].unique()) == indices
    assert (rec["prefill_instance"] == rec["decode_instance"]).all()
    assert result.summary["energy_j"] > 0


def test_bench_aggregated_case_reports_its_figures():
    from sim.bench import speed

    report = speed.aggregated_case(0.5, 300, seed=0, repeats=2, num_instances=2)
    assert report["requests_per_bare_event"] > 0 and report["long_output_wall_ratio"] > 0
    assert report["wakeups_per_request"] > 0
    # the P/D run of the same trace is the baseline, timed in the same repeats
    assert report["per_request_vs_disaggregated"] == pytest.approx(
        report["wall_s"] / report["disaggregated_wall_s"])
    assert all(len(v) == 2 and min(v) > 0 for v in report["per_repeat"].values())
    # every request served, each with 10x the output: 10x the tokens, a tenth per token
    assert report["long_output_output_tokens"] == 10 * report["output_tokens"] > 0
    assert report["long_output_per_token_ratio"] == pytest.approx(
        report["long_output_wall_ratio"] / 10)
    text = speed.format_report({**_bench_stub(), "aggregated": [report]})
    assert "aggregated 2x A100 TP4" in text and "per request vs P/D" in text
    assert "per output token" in text and "each repeat" in text


def _bench_stub() -> dict:
    return dict(num_requests=10, rate=0.5, slo_attainment=1.0, repeats=1, wall_s=1.0,
                simulated_requests_per_s=10.0, bare_simpy_events_per_s=100.0,
                requests_per_bare_event=0.1, decode_wakeups_per_request=0.9,
                long_output_rate=0.05, long_output_wall_ratio=1.1, long_output_wall_s=1.1,
                long_output_same_rate_wall_ratio=3.0, long_output_same_rate_wall_s=3.0,
                long_output_same_rate_preemptions_per_request=1.4, startup_s=0.3,
                startup_wall_s=0.4)


def test_an_aggregated_cluster_checks_its_own_tp_against_the_model_not_the_pd_defaults(tmp_path):
    """A model with 2 KV heads on one aggregated device: the P/D pools' default tp (4) does not
    apply to a cluster that has no P/D pools; the aggregated pool's own tp still does."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
        "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    cluster = {"kind": "aggregated", "model": str(config),
               "aggregated": {"device": "h100-sxm", "tp": 1, "num_instances": 1}}
    run = from_dict({"cluster": cluster, "workload": {"rate": 0.5, "num_requests": 10}})
    assert run.cluster.aggregated.tp == 1
    cluster["aggregated"]["tp"] = 4
    with pytest.raises(ConfigError, match=r"cluster\.aggregated\.tp = 4 does not divide"):
        from_dict({"cluster": cluster, "workload": {"rate": 0.5, "num_requests": 10}})
