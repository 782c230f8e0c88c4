"""Configuration: bad values name the field and the allowed range; TOML loading."""

import pytest

from sim.engine.cluster import kv_capacity_blocks, simulate
from sim.config import ConfigError, RunConfig, from_dict, load_config


@pytest.mark.parametrize("changes,message", [
    ({"cluster.prefill.tp": 0}, r"cluster\.prefill\.tp must be an integer in \[1, 64\], got 0"),
    ({"cluster.decode.max_batch_size": -3}, r"cluster\.decode\.max_batch_size must be .*\[1, "),
    ({"cluster.decode.device": "a200"}, r"cluster\.decode\.device must be one of \[.*'p150a'"),
    ({"cluster.decode.kv_dtype": "int3"}, r"cluster\.decode\.kv_dtype must be one of"),
    ({"cluster.link.bandwidth_gb_s": 0.0}, r"link\.bandwidth_gb_s must be a number in \[0\.001"),
    ({"workload.rate": -1.0}, r"workload\.rate must be a number in"),
    ({"workload.name": "chat"}, r"workload\.name must be one of \['chatbot', 'code', 'summarization'\], got 'chat'"),
    ({"slo.ttft_s": float("nan")}, r"slo\.ttft_s must be a number"),
    ({"cluster.prefill.memory_utilization": 1.5}, r"memory_utilization must be a number in \[0\.05, 1\.0\]"),
    ({"cluster.routing": "random"}, r"cluster\.routing: routing policy 'random' is not one of \[.*'round_robin'\]"),
    ({"seed": -1}, r"run\.seed must be an integer in \[0, "),
    ({"cluster.prefill.tp": 2.5}, r"cluster\.prefill\.tp must be an integer"),
])
def test_bad_values_name_the_field_and_range(changes, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig().replace(**changes)


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match=r"cluster\.decode: unknown key\(s\) \['max_batch'\]"):
        from_dict({"cluster": {"decode": {"max_batch": 3}}})


def test_a_model_that_does_not_fit_the_device_is_refused():
    config = RunConfig().replace(**{"cluster.decode.weight_format": "bfloat16"})
    with pytest.raises(ConfigError, match=r"cluster\.decode: Llama 3\.1 70B weights in bfloat16 "
                                          r"take 141\.1 GB, but 4x .*p150a offer 115\.2 GB"):
        kv_capacity_blocks(config, config.cluster.decode)
    with pytest.raises(ConfigError, match="weights"):
        simulate(config.replace(**{"workload.num_requests": 5}))


def test_more_blocks_than_memory_holds_is_refused():
    config = RunConfig().replace(**{"cluster.decode.max_num_blocks": 10**7})
    with pytest.raises(ConfigError, match=r"cluster\.decode\.max_num_blocks = 10000000, but only "
                                          r"\d+ blocks"):
        kv_capacity_blocks(config, config.cluster.decode)
    assert kv_capacity_blocks(RunConfig(), RunConfig().cluster.decode) == 2048


def test_toml_file_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("""
seed = 4
[workload]
name = "summarization"
rate = 0.25
num_requests = 50
[slo]
ttft_s = 15.0
[cluster.decode]
device = "n300"
tp = 8
max_batch_size = 16
kv_dtype = "bfloat8_b"
weight_format = "tt-mixed"
""")
    config = load_config(path)
    assert config.seed == 4 and config.workload.rate == 0.25
    assert config.cluster.decode.device == "n300" and config.cluster.decode.tp == 8
    assert config.cluster.prefill.device == "a100-pcie"      # defaults fill the gaps
    result = simulate(config)
    assert result.summary["num_requests"] == 50


def test_toml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[cluster.prefill]\ntp = 0\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: cluster\.prefill\.tp must be"):
        load_config(path)


@pytest.mark.parametrize("text,field", [
    ('[cluster.decode]\ndevice = ["p150a"]\n', r"cluster\.decode\.device must be one of"),
    ("cluster = 5\n", r"cluster must be a table, got 5"),
    ("[cluster]\nprefill = 4\n", r"cluster\.prefill must be a table, got 4"),
    ('workload = "chatbot"\n', r"workload must be a table"),
    ('[cluster]\nfast_forward = "no"\n', r"cluster\.fast_forward must be true or false, got 'no'"),
    ('[workload]\nrate = "fast"\n', r"workload\.rate must be a number"),
    ("[workload]\nnum_requests = true\n", r"workload\.num_requests must be an integer"),
    ("[workload]\ntrace = [1, 2]\n", r"workload\.trace must be a string, got \[1, 2\]"),
    ("[cluster.link]\nmechanism = 3\n", r"cluster\.link\.mechanism must be one of"),
    ('[cluster.link]\nbandwidth_gb_s = "fast"\n', r"cluster\.link\.bandwidth_gb_s must be a"),
    ("[slo]\nttft_s = true\n", r"slo\.ttft_s must be a number"),
    ("seed = 1.5\n", r"run\.seed must be an integer"),
    ("[cluster]\nprofile = 7\n", r"cluster\.profile must be a string, got 7"),
    ('[cluster]\nmodel = {name = "x"}\n', r"cluster\.model must be one of"),
    ('[cluster.prefill]\nmemory_utilization = "0.9"\n', r"cluster\.prefill\.memory_utilization"),
    ("[cluster.decode]\nkv_dtype = 8\n", r"cluster\.decode\.kv_dtype must be one of"),
    ("[cluster.decode]\nmax_num_blocks = 2048.0\n", r"cluster\.decode\.max_num_blocks must be an"),
    ("[cluster]\nrouting = [\"a\"]\n", r"cluster\.routing: routing policy must be a name"),
    ("[bogus]\nx = 1\n", r"the configuration: unknown key\(s\) \['bogus'\]"),
])
def test_a_wrong_toml_type_is_refused_naming_file_and_field(tmp_path, text, field):
    path = tmp_path / "typed.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"typed\.toml: " + field):
        load_config(path)


@pytest.mark.parametrize("role,tp,heads", [
    ("prefill", 3, "64 attention heads"), ("prefill", 16, "8 KV heads"),
    ("decode", 6, "64 attention heads"), ("decode", 32, "8 KV heads"),
])
def test_tp_must_divide_the_heads_on_every_instance(role, tp, heads):
    with pytest.raises(ConfigError, match=rf"cluster\.{role}\.tp = {tp} does not divide Llama "
                                          rf"3\.1 70B's {heads}"):
        RunConfig().replace(**{f"cluster.{role}.tp": tp})


@pytest.fixture
def small_machine(monkeypatch):
    """A machine with 8 GB available, whatever this one has."""
    import sim.config.run_size

    monkeypatch.setattr(sim.config.run_size, "available_memory_bytes", lambda: 8e9)


@pytest.mark.parametrize("changes,message", [
    ({"workload.num_requests": 100_000_000}, r"workload: 100,000,000 requests need about "
                                             r"102\.7 GB .* this machine has 8\.0 GB available"),
    ({"workload.num_requests": None, "workload.duration_s": 1e6, "workload.rate": 50.0},
     r"workload: 50,000,000 requests need about"),
])
def test_a_run_too_big_for_memory_is_refused_up_front(small_machine, changes, message):
    with pytest.raises(ConfigError, match=message):
        simulate(RunConfig().replace(**changes))
    assert simulate(RunConfig().replace(**{"workload.num_requests": 20})).summary[
        "num_finished"] == 20


def test_a_sweep_too_big_for_memory_is_refused_up_front(small_machine, capsys):
    from sim.commands.main import main

    assert main(["sweep", "--num-requests", "3000000", "--rates", "0.1,0.2,0.3,0.4",
                 "--workers", "4"]) == 2
    assert ("the sweep of 4 points: 3,000,000 requests x 4 runs side by side need about 13.5 GB"
            in capsys.readouterr().err)
    assert main(["sweep", "--num-requests", "10", "--rates", "1:5000:1", "--seeds", "200",
                 "--workers", "1"]) == 2
    assert "sweep fewer points (--rates, --seeds)" in capsys.readouterr().err
