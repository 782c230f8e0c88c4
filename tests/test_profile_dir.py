"""The simulator on a measured profile directory (sim/models/profile_dir.py): the run mirrors the
real mode's cluster, its instants are the tables' numbers, extrapolation is said, bad
directories are named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hardware.catalog import DeviceSpec, ServingRules
from sim.commands.main import main as hawk
from sim.engine.cluster import simulate
from sim.config import ConfigError, from_dict, provenance
from sim.models.predictor import Efficiency, RooflinePredictor
from sim.models.profile_dir import MEASURED_MODEL, load_profile_dir
from traces.trace import Trace

#: the real mode's tiny Llama (hardware.model.config.tiny_config)
TINY = {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
        "intermediate_size": 688, "vocab_size": 1024, "max_context": 512, "dtype": "float32",
        "seed": 0}
#: a made-up CPU: what the sampled tables are timed on
CPU = DeviceSpec("test-cpu", "test CPU", "gpu", 0.2, 16.0, 20.0, 65.0, 1.0, 0.0, "a test",
                 ServingRules(["bfloat16"], ["bfloat16"], 16, 16, 32, 0.9, "free-memory"))
TRUE_EFFICIENCY = Efficiency(prefill_compute_efficiency=0.3, prefill_memory_efficiency=0.5,
                             decode_compute_efficiency=0.2, decode_memory_efficiency=0.4,
                             step_overhead_s=0.002, allreduce_latency_s=0.0,
                             decode_attention_efficiency=0.25)
#: per mechanism: fixed seconds and GB/s of the sampled transfer table
TRUE_TRANSFER = {"GN-HAWK": (0.003, 0.8), "GG-Direct": (0.001, 2.0)}
PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (16, 64, 128, 256, 512)
#: [serving] as hawk real profile writes it (the workers' defaults; bytes per token of the
#: prefill worker's float32 paged cache: 2 x 2 layers x 2 KV heads x 64 x 4 B)
SERVING = {"prefill_max_batch_tokens": 2048, "prefill_max_batch_size": 32,
           "prefill_num_blocks": 256, "prefill_block_tokens": 16, "decode_max_batch": 32,
           "kv_block_tokens": 32, "kv_dtype": "bfloat8_b", "num_kv_tokens": 16384,
           "kv_bytes_per_token": 2048, "decode_mechanism": "GN-HAWK",
           "mechanisms": ["GN-HAWK", "GG-Direct"]}


def _model():
    from sim.models.profile_dir import _model_and_serving

    return _model_and_serving({"model": TINY, "serving": SERVING}, "test")[0]


def roofline(efficiency: Efficiency = TRUE_EFFICIENCY) -> RooflinePredictor:
    return RooflinePredictor(_model(), CPU, 1, efficiency)


def _toml(tables: dict) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v)

    return "".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in t.items()) + "\n"
                   for name, t in tables.items())


def make_profile_dir(root: Path, predictor=None, transfer=None, complete: bool = True,
                     **serving) -> Path:
    """A profile directory in the contract's format, its tables sampled from ``predictor``
    (default: the roofline of ``TRUE_EFFICIENCY`` on ``CPU``) and ``transfer`` (mechanism ->
    (fixed s, GB/s)), as ``hawk real profile`` would have measured them."""
    predictor, transfer = predictor or roofline(), transfer or TRUE_TRANSFER
    root.mkdir(parents=True, exist_ok=True)
    machine = {"description": "test", "cpu": "test", "cores": 2, "threads": 1, "torch": "2",
               "device": "cpu", "stands_for_prefill": "a100-pcie", "stands_for_decode": "p150a",
               "peak_tflops": CPU.peak_tflops, "memory_bandwidth_gb_s": CPU.memory_bandwidth_gb_s}
    (root / "profile.toml").write_text(_toml({
        "meta": {"format": 1, "created": "2026-01-01T00:00:00", "hawk_version": "0",
                 "complete": complete},
        "machine": machine, "model": TINY,
        "serving": {**SERVING, **serving, "mechanisms": sorted(transfer)}}))
    rows = ["batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats"]
    rows += [f"{t},1,{predictor.prefill_time([t])!r},0.1,0.2,3" for t in PREFILL_TOKENS]
    (root / "prefill.csv").write_text("\n".join(rows) + "\n")
    rows = ["batch,context_per_request,total_context,seconds_p50,seconds_p10,seconds_p90,repeats"]
    rows += [f"{b},{c},{b * c},{predictor.decode_step_time(b, b * c)!r},0.1,0.2,3"
             for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    (root / "decode.csv").write_text("\n".join(rows) + "\n")
    per_token = SERVING["kv_bytes_per_token"]
    rows = ["mechanism,bytes,seconds_p50,seconds_p10,seconds_p90,repeats"]
    rows += [f"{m},{n * per_token!r},{fixed + n * per_token / (gb_s * 1e9)!r},0.1,0.2,3"
             for m, (fixed, gb_s) in sorted(transfer.items()) for n in (16, 64, 128, 256, 512)]
    (root / "transfer.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture
def prof(tmp_path) -> Path:
    return make_profile_dir(tmp_path / "prof")


def _config(prof: Path, **extra):
    return from_dict({"cluster": {"profile": str(prof), **extra}, "seed": 0,
                      "workload": {"num_requests": 10}})


def _trace(prompts, outputs, arrivals=None) -> Trace:
    n = len(prompts)
    arrivals = np.zeros(n) if arrivals is None else np.asarray(arrivals, dtype=np.float64)
    return Trace(arrivals, np.asarray(prompts), np.asarray(outputs), np.arange(n))


def test_config_mirrors_the_real_workers(prof):
    config = _config(prof)
    cl = config.cluster
    assert cl.model == MEASURED_MODEL
    assert (cl.prefill.device, cl.decode.device) == ("a100-pcie", "p150a")
    assert (cl.prefill.tp, cl.decode.tp, cl.prefill.num_instances) == (1, 1, 1)
    assert cl.prefill.max_batch_tokens == 2048 and cl.decode.max_batch_size == 32
    assert cl.decode.block_size == 32 and cl.decode.admission == "oracle-reserve"
    assert (cl.routing, cl.decode_routing, cl.link.mechanism) == (
        "least_work", "least_work", "GN-HAWK")
    where = provenance(config)
    assert where["cluster.decode.max_batch_size"]["source"] == "profile"
    assert where["cluster.routing"]["source"] == "profile"
    # the user's keys win over the profile's, and say so
    config = _config(prof, decode={"max_batch_size": 8})
    assert config.cluster.decode.max_batch_size == 8
    assert provenance(config)["cluster.decode.max_batch_size"]["source"] == "user"
    # replace() re-applies the profile under the changed keys
    assert config.replace(**{"workload.rate": 2.0}).cluster.decode.max_batch_size == 8


def test_single_request_instants_are_the_tables(prof):
    """Alone in the cluster: TTFT = prefill + transfer of its bytes (the decode worker emits
    the prefill's first token when the KV has landed), then one decode step per further token
    at batch 1 and the request's growing context, all read off the tables."""
    prompt, output = 100, 5
    result = simulate(_config(prof), _trace([prompt], [output]))
    r = result.records.iloc[0]
    table = roofline()                   # on the sampled points the tables are exact
    profile = load_profile_dir(prof)
    prefill = np.interp(prompt, PREFILL_TOKENS, [table.prefill_time([t]) for t in PREFILL_TOKENS])
    nbytes = profile.kv_bytes(prompt)
    fixed, gb_s = TRUE_TRANSFER["GN-HAWK"]
    transfer = fixed + nbytes / (gb_s * 1e9)     # linear in bytes: exact between points
    assert r.prefill_end_at - r.prefill_start_at == pytest.approx(prefill, rel=1e-12)
    assert r.transfer_end_at - r.transfer_start_at == pytest.approx(transfer, rel=1e-9)
    assert r.first_token_at - r.arrival_at == pytest.approx(prefill + transfer, rel=1e-9)
    predictor = profile.predictor()
    steps = sum(predictor.decode_step_time(1, prompt + k) for k in range(1, output))
    assert r.finished_at - r.first_token_at == pytest.approx(steps, rel=1e-9)
    assert r.kv_bytes == int(nbytes) == prompt * 2048
    assert result.summary["profile"]["extrapolated"] == {}


def test_pulls_are_one_at_a_time(prof):
    """The decode worker's puller moves one request's KV at a time, in arrival order."""
    result = simulate(_config(prof), _trace([64, 64, 64, 64], [4, 4, 4, 4]))
    rec = result.records.sort_values("transfer_start_at")
    ends = rec.transfer_end_at.to_numpy()
    fixed, gb_s = TRUE_TRANSFER["GN-HAWK"]
    one = fixed + load_profile_dir(prof).kv_bytes(64) / (gb_s * 1e9)
    assert np.all(rec.transfer_start_at.to_numpy()[1:] >= ends[:-1] - 1e-12)
    assert np.diff(ends) == pytest.approx([one] * 3, rel=1e-9)


def test_extrapolation_is_flagged(tmp_path):
    small = make_profile_dir(tmp_path / "p", transfer={"GN-HAWK": (0.003, 0.8)})
    text = (small / "prefill.csv").read_text().splitlines()
    (small / "prefill.csv").write_text("\n".join(text[:4]) + "\n")    # tokens up to 128
    result = simulate(_config(small), _trace([300], [3]))
    flagged = result.summary["profile"]["extrapolated"]
    assert flagged["prefill_batch_tokens"] == {"measured": [16.0, 128.0], "used": [300.0, 300.0]}
    assert "decode_batch" not in flagged


def test_same_seed_same_records(prof):
    config = _config(prof).replace(**{"workload.rate": 20.0, "workload.num_requests": 60})
    a, b = simulate(config), simulate(config)
    assert a.records.equals(b.records)
    a, b = simulate(config, _busy_trace()), simulate(config, _busy_trace())
    assert a.records.equals(b.records)
    assert a.summary["ttft_p90_s"] == b.summary["ttft_p90_s"]


def _busy_trace(n: int = 80, rate: float = 50.0, seed: int = 0) -> Trace:
    """Requests the tiny model's context holds, arriving faster than the cluster serves."""
    rng = np.random.default_rng(seed)
    return _trace(rng.integers(10, 300, n), rng.integers(5, 60, n),
                  np.cumsum(rng.exponential(1 / rate, n)))


def test_a_busy_run_keeps_the_decode_cache(tmp_path):
    """[serving] num_kv_tokens in kv_block_tokens blocks bounds what the decode worker holds:
    each pull reserves prompt + output up front, as the worker does."""
    prof = make_profile_dir(tmp_path / "p", num_kv_tokens=1024)
    rec = simulate(_config(prof), _busy_trace()).records
    assert (rec.status == "ok").all()
    blocks = -(-(rec.num_prompt_tokens + rec.num_output_tokens) // 32)
    events = sorted([(t, int(b)) for t, b in zip(rec.transfer_start_at, blocks)]
                    + [(t, -int(b)) for t, b in zip(rec.finished_at, blocks)])
    held = np.cumsum([b for _, b in events])
    assert held.max() <= 1024 // 32
    assert held.max() > 1024 // 32 - 10          # the cache did fill: the bound was tested


def test_cli_simulate_and_show_config(prof, capsys):
    assert hawk(["simulate", "--profile", str(prof), "--num-requests", "20", "--rate", "5",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 20 and summary["profile"]["path"] == str(prof)
    assert hawk(["simulate", "--profile", str(prof), "--show-config"]) == 0
    out = capsys.readouterr().out
    assert "cluster.decode.max_batch_size = 32" in out and "# profile" in out
    assert "measured ranges" in out


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "decode.csv").unlink(), "decode.csv: missing"),
    (lambda d: (d / "profile.toml").write_text("[meta]\nformat = 1\n"), "missing table [machine]"),
    (lambda d: (d / "prefill.csv").write_text(
        "batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats\n16,1,abc,1,1,3\n"),
     "prefill.csv:2: seconds_p50 = 'abc'"),
    (lambda d: (d / "transfer.csv").write_text("mechanism,bytes\n"), "transfer.csv:1: header"),
    (lambda d: (d / "profile.toml").write_text(
        (d / "profile.toml").read_text().replace('"p150a"', '"p9000"')), "stands_for_decode"),
    (lambda d: (d / "profile.toml").write_text(
        (d / "profile.toml").read_text().replace("num_kv_tokens = 16384", "num_kv_tokens = -1")),
     "[serving] num_kv_tokens"),
])
def test_bad_directories_are_named(prof, damage, message):
    damage(prof)
    with pytest.raises(ConfigError) as err:
        _config(prof)
    assert message in str(err.value)


def test_cli_names_a_missing_directory(tmp_path, capsys):
    assert hawk(["simulate", "--profile", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no such profile directory" in err and "Traceback" not in err


def test_unmeasured_mechanism_is_refused(tmp_path):
    only = make_profile_dir(tmp_path / "p", transfer={"GN-HAWK": (0.003, 0.8)})
    with pytest.raises(ConfigError, match="no points for mechanism GN-Host"):
        simulate(_config(only, link={"mechanism": "GN-Host"}), _trace([10], [2]))


def test_catalog_model_beside_a_profile_dir_is_refused(prof):
    with pytest.raises(ConfigError, match="times its own model"):
        _config(prof, model="llama-3.1-8b")


def test_config_file_names_the_directory(prof, tmp_path, capsys):
    """cluster.profile = "DIR" in a config file is the same run as --profile DIR."""
    config = tmp_path / "run.toml"
    config.write_text(f'seed = 3\n[cluster]\nprofile = "{prof}"\n[workload]\nnum_requests = 15\n'
                      f'rate = 4.0\n')
    assert hawk(["simulate", "--config", str(config), "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert hawk(["simulate", "--profile", str(prof), "--seed", "3", "--num-requests", "15",
                 "--rate", "4", "--json"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    for key in ("num_finished", "ttft_p50_s", "e2e_p90_s", "output_tokens_per_s"):
        assert by_file[key] == by_flag[key]


def test_cli_sweep_on_a_profile(prof, capsys):
    assert hawk(["sweep", "--profile", str(prof), "--rates", "2,8", "--num-requests", "15",
                 "--workers", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["rate"] for r in rows] == [2.0, 8.0]


def test_table_lines_match_the_grid_and_interpolate_scattered_points():
    """From rows, a regular grid times as the grid constructor does; between two batch sizes
    measured at different contexts a step is linear in the batch at the same total context."""
    from sim.models.table import TablePredictor

    grid = TablePredictor([16, 2048], [0.01, 0.5], [1, 8], [16, 4096],
                          [[0.01, 0.02], [0.03, 0.08]])
    rows = TablePredictor.from_points(
        np.array([[1, 16, 0.01], [1, 2048, 0.5]]),
        np.array([[1, 16, 0.01], [1, 4096, 0.02], [8, 16, 0.03], [8, 4096, 0.08]]))
    contexts = np.array([0.0, 16, 1000, 4096, 9000])
    for batch in (1, 4, 8, 12):
        assert rows.decode_step_times(batch, contexts) == pytest.approx(
            grid.decode_step_times(batch, contexts), rel=1e-12)
    scattered = TablePredictor.from_points(
        np.array([[1, 16, 0.01], [4, 64, 0.04], [1, 64, 0.02], [4, 256, 0.1]]),
        np.array([[1, 10, 1.0], [1, 20, 2.0], [3, 30, 6.0], [3, 90, 9.0]]))
    at_1 = float(np.interp(60, [10, 20], [1.0, 2.0]) + (60 - 20) * 0.1)   # extrapolated
    at_3 = float(np.interp(60, [30, 90], [6.0, 9.0]))
    assert scattered.decode_step_time(2, 60) == pytest.approx((at_1 + at_3) / 2, rel=1e-12)
    one_seq = 0.01 + (32 - 16) * (0.02 - 0.01) / (64 - 16)         # two prompts, 32 tokens
    four_seqs = 0.04 + (32 - 64) * (0.1 - 0.04) / (256 - 64)        # extrapolated below 64
    assert scattered.prefill_time([16, 16]) == pytest.approx(
        one_seq + (2 - 1) / (4 - 1) * (four_seqs - one_seq), rel=1e-12)


def test_a_noisy_table_never_prices_a_step_below_zero_or_cheaper_for_more_work():
    """Two noisy points whose end segment slopes down (seen in a 1-repeat profile on a loaded
    machine) extrapolate flat above the range and never below the fastest measured step."""
    import numpy as np

    from sim.models.table import TablePredictor

    table = TablePredictor.from_points(
        np.array([[1, 16, 0.010], [1, 128, 0.008]]),               # prefill falls with tokens
        np.array([[1, 16, 0.004], [1, 128, 0.003], [4, 16, 0.002], [4, 128, 0.002]]))
    assert table.prefill_time([4096]) == pytest.approx(0.008)
    assert table.prefill_time([1]) >= 0.010
    steps = [table.decode_step_time(b, c) for b in (1, 4, 16, 64) for c in (0, 16, 4096)]
    assert min(steps) >= 0.0
    assert table.decode_step_time(64, 4096) >= table.decode_step_time(4, 4096)
    steep = TablePredictor.from_points(np.array([[1, 100, 0.001], [1, 200, 0.101]]),
                                       np.array([[1, 100, 0.001], [1, 200, 0.101]]))
    # below the points: never under the fastest step measured
    assert steep.prefill_time([10]) == 0.001 and steep.decode_step_time(1, 10) == 0.001
