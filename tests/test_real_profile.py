"""``hawk real profile``: the directory contract, resuming, refusals.

One small profile is measured for the module, interrupted halfway through the decode table
and then resumed, so the resume path and the finished directory are checked on the same run
(one prefill-process start: the interrupted run stops before its transfers).
"""

import csv

import pytest

from tests import needs

torch = pytest.importorskip("torch")
needs.mooncake_engine()

from hardware.serve import profile  # noqa: E402
from hardware.serve.profile_files import ProfileError, Table, prepare  # noqa: E402
from sim.commands.main import main  # noqa: E402

SWEEP = profile.Sweep(prefill_num_seqs=(1, 2), prefill_tokens=(16, 256),
                      decode_batches=(1, 4), decode_contexts=(16, 512),
                      transfer_tokens=(16, 512), mechanisms=("GG-Host", "GN-HAWK"), repeats=3)
NUM_POINTS = 4 + 4 + 4
COLUMNS = {"prefill.csv": "batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats",
           "decode.csv": "batch,context_per_request,total_context,seconds_p50,seconds_p10,"
                         "seconds_p90,repeats",
           "transfer.csv": "mechanism,bytes,seconds_p50,seconds_p10,seconds_p90,repeats"}


class Stop(KeyboardInterrupt):
    """What a Ctrl-C does to the run, raised by the hook after a number of points."""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof")
    first, second = [], []

    def stop_after(n):
        def hook(table, row):
            first.append((table, row))
            if len(first) == n:
                raise Stop
        return hook

    with pytest.raises(Stop):
        profile.run(out, sweep=SWEEP, device="cpu", progress=False, on_point=stop_after(6))
    interrupted = read_toml(out)
    report = profile.run(out, sweep=SWEEP, device="cpu", progress=False,
                         on_point=lambda t, r: second.append((t, r)))
    return out, first, second, interrupted, report


def read_toml(out):
    from sim.config import tomllib
    return tomllib.loads((out / "profile.toml").read_text())


def rows(out, name):
    with open(out / name) as f:
        return list(csv.DictReader(f))


def test_files_and_columns_as_the_contract(measured):
    out, *_ = measured
    for name, header in COLUMNS.items():
        assert (out / name).read_text().splitlines()[0] == header
    assert {p.name for p in (out / "model").iterdir()} >= {"config.json", "model.safetensors"}
    doc = read_toml(out)
    assert doc["meta"]["format"] == 1 and doc["meta"]["complete"] is True
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["threads"] == 1
    assert doc["model"]["seed"] == 0 and doc["model"]["max_context"] == 512
    assert doc["serving"]["mechanisms"] == ["GG-Host", "GN-HAWK"]
    assert doc["serving"]["decode_max_batch"] == 32
    assert doc["serving"]["batch_padding"] == "longest"       # block_batch pads to the longest
    assert doc["sweep"]["decode_contexts"] == [16, 512] and doc["sweep"]["repeats"] == 3
    dec = rows(out, "decode.csv")
    assert {(int(r["batch"]), int(r["context_per_request"])) for r in dec} == {
        (1, 16), (1, 512), (4, 16), (4, 512)}
    assert all(int(r["total_context"]) == int(r["batch"]) * int(r["context_per_request"])
               for r in dec)
    per_token = doc["serving"]["kv_bytes_per_token"]
    assert per_token == 2 * 2 * 2 * 64 * 4            # layers x K/V x heads x dim x float32
    assert {(r["mechanism"], int(r["bytes"])) for r in rows(out, "transfer.csv")} == {
        (m, t * per_token) for m in ("GG-Host", "GN-HAWK") for t in (16, 512)}
    assert doc["ranges"]["decode_total_context_max"] == 2048
    assert doc["ranges"]["prefill_batch_tokens_max"] == 512
    assert doc["ranges"]["transfer_bytes_min"] == 16 * per_token


def test_statistics_are_ordered_and_loosely_physical(measured):
    out, *_ = measured
    tables = {n: rows(out, n) for n in COLUMNS}
    for table in tables.values():
        for r in table:
            assert 0 < float(r["seconds_p10"]) <= float(r["seconds_p50"]) \
                <= float(r["seconds_p90"])
            assert int(r["repeats"]) == 3
    stat = {n: {tuple(v for k, v in r.items() if not k.startswith(("seconds", "repeats"))):
                (float(r["seconds_p10"]), float(r["seconds_p90"])) for r in t}
            for n, t in tables.items()}

    def not_far_faster(table, big, small):      # loose: the machine is shared
        assert stat[table][big][1] > 0.5 * stat[table][small][0], (table, big, small)
    not_far_faster("prefill.csv", ("512", "2"), ("16", "1"))
    not_far_faster("decode.csv", ("4", "512", "2048"), ("1", "16", "16"))
    for m in ("GG-Host", "GN-HAWK"):
        not_far_faster("transfer.csv", (m, "1048576"), (m, "32768"))


def test_resume_measures_each_point_once(measured):
    out, first, second, interrupted, report = measured
    assert interrupted["meta"]["complete"] is False and "ranges" not in interrupted
    assert len(first) == 6 and len(second) == NUM_POINTS - 6
    assert report["num_measured"] == NUM_POINTS - 6
    seen = [(t, tuple(v for k, v in r.items() if not k.startswith(("seconds", "repeats"))))
            for t, r in first + second]
    assert len(set(seen)) == NUM_POINTS
    assert [t for t, _ in first].count("decode") == 2
    again = profile.run(out, sweep=SWEEP, device="cpu", progress=False)
    assert again["num_measured"] == 0
    assert sum(len(rows(out, n)) for n in COLUMNS) == NUM_POINTS


def test_serving_loop_session_writes_loop_csv(measured, tmp_path):
    """The session serves synthetic requests on a local cluster of the profile's model; its
    workers' step logs become loop.csv, which the simulator turns into per-phase factors."""
    import shutil

    from hardware.serve.profile_loop import COLUMNS as LOOP_COLUMNS, measure_loop
    from hardware.serve.profile_measure import Serving
    from hardware.serve.profile_files import Table, KEYS, STATS
    from sim.models.profile_dir import load_profile_dir

    out = tmp_path / "prof"
    shutil.copytree(measured[0], out)
    decode = Table(out / "decode.csv", KEYS["decode"] + STATS).rows
    n = measure_loop(out, decode, Serving.of_workers(), "GN-HAWK", "cpu", 128, 3)
    loop = rows(out, "loop.csv")
    assert (out / "loop.csv").read_text().splitlines()[0] == ",".join(LOOP_COLUMNS)
    assert len(loop) == n and {r["phase"] for r in loop} == {"prefill", "decode", "transfer"}
    assert sum(r["phase"] == "transfer" for r in loop) == 3
    for r in loop:
        assert int(r["batch"]) >= 1 and int(r["longest"]) <= 128
        assert int(r["longest"]) <= int(r["total"]) <= int(r["batch"]) * int(r["longest"])
        assert float(r["seconds"]) > 0
    factors = load_profile_dir(out).loop
    assert sum(steps for _, steps in factors.values()) == n
    assert all(f > 0 for f, _ in factors.values())


def test_model_is_the_seeded_tiny_model(measured):
    from hardware.model.config import tiny_config
    from hardware.model.llama import LlamaModel
    out, *_ = measured
    saved = LlamaModel.load(out / "model", device="cpu").state_dict()
    fresh = LlamaModel.random(tiny_config(), seed=0, device="cpu").state_dict()
    assert saved.keys() == fresh.keys()
    assert all(torch.equal(saved[k], fresh[k]) for k in saved)


def test_other_settings_are_refused(measured, capsys):
    out, *_ = measured
    before = (out / "decode.csv").read_text()
    assert main(["real", "profile", "--out", str(out), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "sweep.decode_batches" in err and "--force" in err
    assert (out / "decode.csv").read_text() == before


def test_bad_arguments(tmp_path, capsys):
    for argv, says in ((["--repeats", "0"], "--repeats 0"),
                       (["--mechanisms", "GN-Nope"], "GN-Nope")):
        with pytest.raises(SystemExit) as e:
            main(["real", "profile", "--out", str(tmp_path / "p"), *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert main(["real", "profile", "--out", str(tmp_path / "p"), "--model",
                 str(tmp_path / "none")]) == 2
    assert "--model" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["real", "profile", "--out", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["real", "profile", "--out", str(tmp_path / "busy")]) == 2
    assert "no profile.toml" in capsys.readouterr().err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_sweep_is_validated():
    with pytest.raises(ProfileError, match="decode_batches"):
        profile.Sweep((1,), (16,), (4, 2), (16,), (16,), ("GN-HAWK",), 3)
    with pytest.raises(ProfileError, match="mechanisms"):
        profile.Sweep((1,), (16,), (1,), (16,), (16,), ("GN-Nope",), 3)
    with pytest.raises(ProfileError, match="repeats"):
        profile.Sweep((1,), (16,), (1,), (16,), (16,), ("GN-HAWK",), 0)
    serving = profile.Serving.of_workers()
    full = profile.Sweep.for_limits(512, serving)
    assert full.prefill_tokens[0] == 1 and full.prefill_tokens[-1] == 512
    assert full.decode_batches[-1] == serving.decode_max_batch == 32
    assert max(n * t for n, t in full.prefill_points(serving)) == serving.prefill_max_batch_tokens
    quick = profile.Sweep.for_limits(512, serving, quick=True)
    assert quick.decode_contexts == (1, 128, 512) and quick.decode_batches == (1, 8, 32)
    assert quick.loop_requests == profile.QUICK_LOOP_REQUESTS > 0
    with pytest.raises(ProfileError, match="loop_requests -1"):
        profile.Sweep((1,), (1,), (1,), (1,), (1,), ("GN-HAWK",), 1, -1)


def test_half_written_row_is_dropped_and_force_clears(tmp_path):
    path = tmp_path / "decode.csv"
    t = Table(path, ("batch", "seconds_p50"))
    t.append({"batch": 1, "seconds_p50": 0.5})
    with open(path, "a") as f:
        f.write("2,0.2")                                # killed while writing this row
    again = Table(path, ("batch", "seconds_p50"))
    assert again.keys(("batch",)) == {(1.0,)}
    assert path.read_text() == "batch,seconds_p50\n1,0.5\n"
    with open(path, "a") as f:
        f.write("two,0.2\n")
    with pytest.raises(ProfileError, match="decode.csv: line 3"):
        Table(path, ("batch", "seconds_p50"))
    path.unlink()
    (tmp_path / "profile.toml").write_text("[sweep]\nrepeats = 3\n")
    header = {"sweep": {"repeats": 5}}
    with pytest.raises(ProfileError, match="sweep.repeats is 5 here, 3 in profile.toml"):
        prepare(tmp_path, header, force=False)
    prepare(tmp_path, header, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
