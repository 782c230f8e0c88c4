"""Instance settings come from the device: a config never carries one device's settings onto
another; impossible pairings are refused; every value says where it came from."""

import json

import pytest

from hardware import catalog
from sim.commands.main import main
from sim.engine.cluster import simulate
from sim.config import SCENARIO, ConfigError, RunConfig, from_dict, load_config, provenance

DEVICE_KEYS = ("weight_format", "kv_dtype", "block_size", "max_batch_size",
               "memory_utilization", "max_num_blocks")
SWITCHES = [(role, dev) for role in ("prefill", "decode") for dev in catalog.devices()
            if dev != SCENARIO[role]["device"]]
GPUS = [dev for dev in catalog.devices() if catalog.device(dev).kind == "gpu"]
GIB = 2 ** 30


def vllm_serve_max_num_seqs(device: str) -> int:
    """vLLM V1's default max_num_seqs for `vllm serve` (vllm/engine/arg_utils.py): a GPU of at
    least 70 GiB whose name does not contain "a100" gets 1024, any other GPU 256."""
    spec = catalog.device(device)
    large = spec.memory_bytes >= 70 * GIB and "a100" not in spec.name.lower()
    return 1024 if large else 256


@pytest.mark.parametrize("device", GPUS)
def test_a_gpu_takes_vllms_default_max_num_seqs(device):
    assert catalog.device(device).serving.max_batch_size == vllm_serve_max_num_seqs(device)


def test_the_vllm_rule_tells_the_a100s_from_the_larger_gpus():
    assert {d: vllm_serve_max_num_seqs(d) for d in GPUS} == {
        "a100-pcie": 256, "a100-sxm": 256, "h100-pcie": 1024, "h100-sxm": 1024, "h200": 1024}


@pytest.mark.parametrize("role,device", SWITCHES)
def test_naming_a_device_gives_its_native_settings(role, device):
    config = from_dict({"cluster": {role: {"device": device}}})
    inst = getattr(config.cluster, role)
    native = catalog.device(device).serving.defaults()
    assert {k: getattr(inst, k) for k in DEVICE_KEYS} == native
    assert {k: inst.sources[k] for k in DEVICE_KEYS} == dict.fromkeys(DEVICE_KEYS, "device")
    assert inst.sources["device"] == "user"


def test_the_issue_config_no_longer_keeps_the_npu_settings(tmp_path):
    path = tmp_path / "gpu_decode.toml"
    path.write_text('[cluster.decode]\ndevice = "a100-sxm"\nkv_dtype = "fp8"\n'
                    '[cluster.link]\nmechanism = "GG-Direct"\n')
    decode = load_config(path).cluster.decode
    assert (decode.weight_format, decode.kv_dtype, decode.block_size, decode.max_num_blocks,
            decode.max_batch_size) == ("bfloat16", "fp8", 16, None,
                                       vllm_serve_max_num_seqs("a100-sxm"))
    result = simulate(load_config(path).replace(**{"workload.num_requests": 40}))
    # all free memory of 4x 80 GB after bfloat16 weights: far more than the NPU's 2048 blocks
    assert result.stats["decode_capacity_blocks"] > 10 * 2048


def test_the_default_scenario_resolves_to_the_paper_settings():
    cl = RunConfig().cluster
    explicit = from_dict({"cluster": {
        "prefill": dict(device="a100-pcie", tp=4, max_batch_size=32, max_batch_tokens=2048,
                        block_size=16, kv_dtype="fp8", weight_format="bfloat16",
                        memory_utilization=0.9),
        "decode": dict(device="p150a", tp=4, max_batch_size=32, block_size=32,
                       kv_dtype="bfloat8_b", weight_format="tt-mixed", max_num_blocks=2048,
                       memory_utilization=0.9)}})
    assert cl == explicit.cluster
    from sim.paper.experiments import serving_config      # hawk paper's GN-HAWK Chatbot configuration

    assert cl == serving_config("GN-HAWK").cluster
    a = simulate(RunConfig().replace(**{"workload.num_requests": 150})).records
    b = simulate(explicit.replace(**{"workload.num_requests": 150})).records
    assert a.equals(b)


def test_the_scenario_assumptions_stay_on_the_scenario_device():
    prefill = RunConfig().cluster.prefill
    assert (prefill.kv_dtype, prefill.sources["kv_dtype"]) == ("fp8", "scenario")
    moved = RunConfig().replace(**{"cluster.prefill.device": "h100-pcie"}).cluster.prefill
    assert (moved.kv_dtype, moved.max_batch_size) == ("bfloat16",
                                                      vllm_serve_max_num_seqs("h100-pcie"))


def test_replace_changes_what_was_set_not_what_was_resolved():
    gpu = RunConfig().replace(**{"cluster.decode.device": "a100-sxm",
                                 "cluster.decode.tp": 8, "cluster.link.mechanism": "GG-Host",
                                 "cluster.decode.kv_dtype": "fp8"})
    back = gpu.replace(**{"cluster.decode.device": "p150a", "cluster.decode.kv_dtype": None,
                          "cluster.link.mechanism": "GN-HAWK"})
    decode = back.cluster.decode
    assert (decode.weight_format, decode.kv_dtype, decode.block_size, decode.max_num_blocks,
            decode.tp) == ("tt-mixed", "bfloat8_b", 32, 2048, 8)
    assert decode.sources["tp"] == "user" and decode.sources["weight_format"] == "device"


@pytest.mark.parametrize("role,device,key,value,allowed", [
    ("decode", "a100-sxm", "weight_format", "tt-mixed", r"\['bfloat16', 'fp8'\]"),
    ("decode", "h100-pcie", "kv_dtype", "bfloat8_b", r"\['bfloat16', 'fp8'\]"),
    ("prefill", "a100-pcie", "kv_dtype", "bfloat4_b", r"\['bfloat16', 'fp8'\]"),
    ("decode", "p150a", "kv_dtype", "fp8", r"\['bfloat8_b', 'bfloat16', 'bfloat4_b'\]"),
    ("decode", "n300", "weight_format", "fp8", r"\['tt-mixed', 'bfloat16'\]"),
    ("prefill", "p150a", "kv_dtype", "fp8", r"\['bfloat8_b', 'bfloat16', 'bfloat4_b'\]"),
])
def test_a_format_the_device_cannot_run_is_refused(role, device, key, value, allowed):
    with pytest.raises(ConfigError, match=rf"cluster\.{role}\.{key} = '{value}' cannot run on "
                                          rf"{device}; {device} runs {allowed}"):
        from_dict({"cluster": {role: {"device": device, key: value}}})


@pytest.mark.parametrize("role,device,block_size,multiple", [
    ("decode", "p150a", 16, 32), ("decode", "n300", 48, 32), ("prefill", "a100-pcie", 24, 16),
    ("decode", "h200", 8, 16),
])
def test_a_block_size_the_layout_cannot_tile_is_refused(role, device, block_size, multiple):
    with pytest.raises(ConfigError, match=rf"cluster\.{role}\.block_size = {block_size} cannot "
                                          rf"be tiled on {device}: it must be a multiple of "
                                          rf"{multiple}"):
        from_dict({"cluster": {role: {"device": device, "block_size": block_size}}})


def test_a_gpu_to_gpu_copy_needs_one_kv_dtype():
    with pytest.raises(ConfigError, match=r"cluster\.decode\.kv_dtype = 'bfloat16' \(a100-sxm's "
                                          r"default\) differs from cluster\.prefill\.kv_dtype = "
                                          r"'fp8' \(the scenario's default\): GG-Direct"):
        from_dict({"cluster": {"decode": {"device": "a100-sxm"},
                               "link": {"mechanism": "GG-Direct"}}})


def test_provenance_names_user_device_and_scenario(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[cluster.decode]\ndevice = "n300"\ntp = 8\n[workload]\nrate = 0.5\n')
    rows = provenance(load_config(path))
    assert rows["cluster.decode.device"] == {"value": "n300", "source": "user"}
    assert rows["cluster.decode.tp"] == {"value": 8, "source": "user"}
    assert rows["cluster.decode.kv_dtype"] == {"value": "bfloat8_b", "source": "device"}
    assert rows["cluster.prefill.kv_dtype"] == {"value": "fp8", "source": "scenario"}
    assert rows["workload.rate"] == {"value": 0.5, "source": "user"}     # set, though default
    assert rows["workload.name"] == {"value": "chatbot", "source": "scenario"}
    assert {r["source"] for r in rows.values()} == {"user", "device", "scenario"}


def test_show_config_and_every_summary_carry_the_resolved_config(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[cluster.decode]\ndevice = "n300"\ntp = 8\n')
    assert main(["simulate", "--config", str(path), "--show-config"]) == 0
    text = capsys.readouterr().out
    assert 'cluster.decode.device = "n300"' in text and "# user" in text
    assert 'cluster.decode.weight_format = "tt-mixed"' in text
    assert main(["simulate", "--config", str(path), "--num-requests", "20", "--json",
                 "--out", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)["config"]
    written = json.loads((tmp_path / "out" / "summary.json").read_text())["config"]
    assert printed == written
    assert printed["cluster.decode.max_num_blocks"] == {"value": 2048, "source": "device"}
    assert main(["sweep", "--config", str(path), "--rates", "0.5", "--num-requests", "20",
                 "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == printed
