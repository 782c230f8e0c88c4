"""The real mode's aggregated shape: the scheduler as a pure function against hand-computed
plans, the engine's greedy tokens against the reference through preemption and recompute,
``hawk real run --shape aggregated`` recording every request once, the aggregated profile read
and simulated as an aggregated instance, and flags of the other shape refused by name.
"""

import json
import subprocess

import pytest

from hardware.serve.aggregated_engine import SeqView, StepPlan, schedule


def plan(running, waiting, budget, max_seqs=8, free=100, block=4):
    return schedule([SeqView(*r) for r in running], [SeqView(*w) for w in waiting],
                    max_batch_tokens=budget, max_batch_size=max_seqs, free_blocks=free,
                    block_size=block)


# -- the scheduler -----------------------------------------------------------------------------
def test_running_decodes_come_first_then_the_chunked_prompt_then_waiting_within_the_budget():
    # (rid, num_tokens, num_computed, num_blocks); blocks of 4 tokens
    running = [("d0", 9, 8, 2), ("d1", 5, 4, 1), ("c", 20, 8, 2)]
    assert plan(running, [("w", 6, 0, 0)], budget=10) == StepPlan(
        (("d0", 1), ("d1", 1), ("c", 8)), (), ())          # 1 + 1 + 8 = the budget: w waits
    # room left: the waiting prompts in order, the last one cut to what the budget leaves
    assert plan([("d0", 9, 8, 2)], [("w0", 6, 0, 0), ("w1", 30, 0, 0), ("w2", 3, 0, 0)],
                budget=16) == StepPlan((("d0", 1), ("w0", 6), ("w1", 9)), (), ("w0", "w1"))


def test_max_batch_size_caps_admission():
    running = [("d0", 9, 8, 2), ("d1", 5, 4, 1)]
    assert plan(running, [("w0", 2, 0, 0), ("w1", 2, 0, 0)], budget=100, max_seqs=3) == \
        StepPlan((("d0", 1), ("d1", 1), ("w0", 2)), (), ("w0",))


def test_short_blocks_preempt_the_newest_and_admit_nobody_that_step():
    # d0 must open a block, none is free: the newest (d2) gives its block back; d1 needs none
    running = [("d0", 9, 8, 2), ("d1", 6, 5, 2), ("d2", 5, 4, 1)]
    assert plan(running, [("w", 1, 0, 0)], budget=100, free=0) == StepPlan(
        (("d0", 1), ("d1", 1)), ("d2",), ())
    # alone and short: it preempts itself
    assert plan([("d0", 9, 8, 2)], [], budget=100, free=0) == StepPlan((), ("d0",), ())


def test_a_waiting_head_without_blocks_holds_back_the_ones_behind():
    assert plan([], [("w0", 8, 0, 0), ("w1", 2, 0, 0)], budget=100, free=1) == \
        StepPlan((), (), ())


# -- the engine --------------------------------------------------------------------------------
def test_engine_serves_the_reference_tokens_through_preemption_within_every_step_limit():
    torch = pytest.importorskip("torch")
    import numpy as np

    from hardware.model.config import tiny_config
    from hardware.model.generate import greedy_generate
    from hardware.model.llama import LlamaModel
    from hardware.serve.aggregated_engine import AggregatedEngine

    torch.set_num_threads(1)
    model = LlamaModel.random(tiny_config(), seed=0, device="cpu")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (7, 50, 33, 120, 2, 300)]
    outputs = [5, 9, 3, 12, 6, 4]
    engine = AggregatedEngine(model, num_blocks=22, max_batch_tokens=64, max_batch_size=4)
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        assert engine.check(p, n) is None
        engine.add(f"r{i}", p, n)
    got = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(200):
        if not (engine.running or engine.waiting):
            break
        step = engine.step()
        assert len(step.decode_contexts) + sum(n for n, _ in step.chunks) <= 64
        assert len(engine.running) <= 4
        for rid, token in step.items:
            got[rid].append(token)
    assert engine.num_preemptions > 0                  # the cache of 22 blocks forces it
    assert [got[f"r{i}"] for i in range(len(prompts))] == greedy_generate(model, prompts,
                                                                          outputs)
    assert sorted(engine.free) == list(range(22)) and not engine.seqs      # nothing held
    assert "need 27 KV blocks" in engine.check([1] * 400, 20)


# -- hawk real run --shape aggregated -------------------------------------------------------
def test_aggregated_real_run_records_each_request_once_in_the_records_schema(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    pytest.importorskip("mooncake.engine")
    from tests.processes import killed_after, start_hawk, tagged, wait_until
    from traces.schema import RECORD_COLUMNS, read_records

    out = tmp_path / "run"
    with killed_after() as tag:              # a small cache: some requests are preempted
        proc = start_hawk(tag, "real", "run", "--shape", "aggregated", "--workload", "chatbot",
                          "--num-requests", "8", "--rate", "4", "--decode-tokens", "600",
                          "--out", str(out), "--json", stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
        stdout, stderr = proc.communicate(timeout=300)
        assert wait_until(lambda: not tagged(tag), timeout_s=60), f"left: {tagged(tag)}"
    assert proc.returncode == 0, stderr.decode()[-2000:]
    summary = json.loads(stdout)
    assert summary["shape"] == "aggregated" and summary["statuses"] == {"ok": 8}
    (worker,) = summary["workers"]
    assert worker["role"] == "aggregated" and worker["held_blocks"] == [] \
        and worker["running"] == worker["queued"] == 0
    frame = read_records(out / "records.parquet")
    assert list(frame.columns) == list(RECORD_COLUMNS)
    assert sorted(frame["request_id"]) == list(range(8))
    assert (frame["num_generated_tokens"] == frame["num_output_tokens"]).all()
    assert (frame["prefill_end_at"] == frame["first_token_at"]).all()
    assert frame["transfer_start_at"].isna().all() and (frame["kv_bytes"] == 0).all()
    assert ((frame["prefill_instance"] == 0) & (frame["decode_instance"] == 0)).all()
    assert (frame["arrival_at"] <= frame["prefill_start_at"]).all()
    assert (frame["first_token_at"] <= frame["finished_at"]).all()


@pytest.mark.parametrize("argv, flag", [
    (["real", "run", "--shape", "aggregated", "--mechanism", "GG-Direct"], "--mechanism"),
    (["real", "serve", "--shape", "aggregated", "--send-buffer-mb", "8"], "--send-buffer-mb"),
    (["real", "run", "--shape", "aggregated", "--num-decode", "2"], "--num-decode"),
    (["real", "run", "--num-aggregated", "2"], "--num-aggregated"),
    (["real", "profile", "--shape", "aggregated", "--mechanisms", "GN-HAWK"], "--mechanisms"),
])
def test_flags_of_the_other_shape_are_refused_by_name(argv, flag, capsys, tmp_path):
    from sim.commands.main import main

    extra = ["--out", str(tmp_path / "p")] if argv[1] == "profile" else (
        ["--workload", "chatbot"] if argv[1] == "run" else [])
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "p").exists()


# -- the aggregated profile ----------------------------------------------------------------
@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    pytest.importorskip("torch")
    from hardware.serve import profile_aggregated as pa

    out = tmp_path_factory.mktemp("aggprof")
    sweep = pa.AggSweep(prefill_num_seqs=(1, 2), prefill_tokens=(16, 128),
                        decode_batches=(1, 4), decode_contexts=(16, 128), mixed_batches=(2,),
                        mixed_chunks=(32,), repeats=1, loop_requests=6)
    report = pa.run(out, sweep=sweep, device="cpu", progress=False)
    return out, report


def test_aggregated_profile_is_read_and_simulated_as_an_aggregated_instance(profile_dir, capsys):
    from sim.commands.main import main
    from sim.models.profile_dir import load_profile_dir, mirror_settings

    out, report = profile_dir
    assert report["num_measured"] == 4 + 4 + 1 and "mixed step, 2 decodes" in report["summary"]
    profile = load_profile_dir(out)
    assert profile.complete and profile.serving["engine"] == "aggregated"
    assert (profile.serving["prefill_max_batch_tokens"], profile.serving["decode_max_batch"],
            profile.serving["kv_block_tokens"]) == (2048, 32, 16)
    assert mirror_settings(profile)["cluster.kind"] == "aggregated"
    assert len(profile.prefill) == 4 and len(profile.decode) == 4 and not profile.transfer
    assert (out / "mixed.csv").read_text().startswith("batch,context_per_request,chunk_tokens,")
    # the serving-loop session: prefill and decode steps of the worker's loop, as factors
    phases = [line.split(",")[0] for line in (out / "loop.csv").read_text().splitlines()[1:]]
    assert set(phases) == {"prefill", "decode"}
    # (a step the tables price at <= 0, extrapolating a noisy 1-repeat table, is left out)
    assert 0 < profile.loop["decode"][1] <= phases.count("decode")
    assert profile.loop["transfer"][1] == 0
    assert profile.predictor().decode_factor == profile.loop["decode"][0] > 0
    assert main(["simulate", "--profile", str(out), "--workload", "chatbot", "--num-requests",
                 "20", "--rate", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 20 and summary["statuses"].get("ok", 0) > 0
    assert summary["aggregated_utilization"] > 0 and summary["kv_bytes_total"] == 0
    # a rerun resumes: nothing left to measure
    from hardware.serve import profile_aggregated as pa
    again = pa.run(out, sweep=pa.AggSweep((1, 2), (16, 128), (1, 4), (16, 128), (2,), (32,), 1,
                                          6), device="cpu", progress=False)
    assert again["num_measured"] == 0


def test_validate_starts_aggregated_workers_for_an_aggregated_real_profile(profile_dir):
    pytest.importorskip("aiohttp")
    pytest.importorskip("mooncake.engine")
    from sim.validation.run import cluster_config, load_requests, read_profile, validate

    out, _ = profile_dir
    doc = read_profile(out)
    assert cluster_config(out, doc, None).shape == "aggregated"
    requests = load_requests(None, "chatbot", 6, 512)
    result, frames = validate(out, requests, "2", slos=(5.0, 1.0))
    (load,) = result["loads"]
    real, sim = frames["rate-2"]
    assert result["mechanism"] == "aggregated" and len(real) == len(sim) == 6
    (point,) = result["mixed_step_vs_table"]["points"]        # mixed.csv's one point, priced
    assert (point["batch"], point["chunk_tokens"]) == (2, 32) and point["table_s"] > 0
    assert (real["status"] == "ok").all() and real["transfer_start_at"].isna().all()
    assert {row["metric"] for row in load["errors"]} >= {"ttft_p50_s", "tpot_p50_s"}
