"""``hawk real run``'s record building (pure) and its Ctrl-C or SIGTERM: what finished is written,
marked incomplete, and no process is left."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hardware.serve.router import prompt_key
from hardware.serve.run import build_records, fit_to_context
from traces.trace import Trace
from tests import needs


def test_records_take_worker_instants_and_name_what_never_finished():
    trace = Trace.from_columns([0.0, 1.0, 2.0], [4, 5, 6], [3, 2, 1], request_id=[10, 11, 12])
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 1, 1, 1, 1, 1]]
    t0 = 1000.0
    log = [{"prompt_key": prompt_key(prompts[1]), "arrival_at": 1001.1, "status": "failed_error",
            "prefill_instance": 0, "decode_instance": 1, "prefill_start_at": 1001.2,
            "prefill_end_at": 1001.3, "num_generated_tokens": 0, "kv_bytes": 0,
            "finished_at": 1001.5},
           {"prompt_key": prompt_key(prompts[0]), "arrival_at": 1000.1, "status": "ok",
            "prefill_instance": 1, "decode_instance": 0, "prefill_start_at": 1000.2,
            "prefill_end_at": 1000.3, "transfer_start_at": 1000.4, "transfer_end_at": 1000.5,
            "first_token_at": 1000.6, "finished_at": 1000.8, "num_generated_tokens": 3,
            "kv_bytes": 4096}]
    frame = build_records(trace, prompts, log, t0, client_status=None)
    assert list(frame["status"]) == ["ok", "failed_error", "unfinished"]
    assert list(frame["request_id"]) == [10, 11, 12]
    assert np.allclose(frame.loc[0, ["arrival_at", "prefill_start_at", "prefill_end_at",
                                     "transfer_start_at", "transfer_end_at", "first_token_at",
                                     "finished_at"]].to_numpy(float),
                       [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8])
    assert math.isnan(frame.loc[1, "transfer_start_at"]) and frame.loc[2, "arrival_at"] == 2.0
    assert frame.loc[0, "kv_bytes"] == 4096 and frame.loc[1, "decode_instance"] == 1
    timed_out = build_records(trace, prompts, log, t0, ["failed_timeout", "ok", "ok"])
    assert timed_out.loc[0, "status"] == "failed_timeout"     # the client saw what workers did not


def test_lengths_scale_by_one_factor_to_fit_the_context():
    trace = Trace.from_columns([0.0, 1.0], [1000, 10], [24, 3])
    fitted, scale = fit_to_context(trace, 512)
    assert scale == 0.5
    assert list(fitted.num_prompt_tokens) == [500, 5] and list(fitted.num_output_tokens) == [12, 1]
    assert fit_to_context(fitted, 512) == (fitted, 1.0)


def test_tenants_survive_scaling_and_reach_the_records():
    trace = dataclasses.replace(Trace.from_columns([0.0, 1.0], [1000, 10], [24, 3]),
                                tenant=np.array(["a", "b"], dtype=object))
    fitted, _ = fit_to_context(trace, 512)
    assert list(fitted.tenant) == ["a", "b"]
    frame = build_records(fitted, [[1] * 500, [2] * 5], [], 0.0, client_status=None)
    assert list(frame["tenant"]) == ["a", "b"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_run_writes_what_finished_marked_incomplete_and_leaves_no_process(signum,
                                                                                  tmp_path):
    pytest.importorskip("torch")
    needs.mooncake_engine()
    from tests.processes import killed_after, start_hawk, tagged, wait_until
    from traces.schema import INCOMPLETE, read_records

    out = tmp_path / "run"
    with killed_after() as tag:
        proc = start_hawk(tag, "real", "run", "--workload", "chatbot", "--num-requests", "40",
                          "--rate", "0.5", "--out", str(out), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
        deadline, seen = time.monotonic() + 600, b""
        while b" 1/40" not in seen and b" 2/40" not in seen and time.monotonic() < deadline:
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
        proc.send_signal(signum)                # Ctrl-C, or timeout(1) and kill
        stdout, _ = proc.communicate(timeout=300)
        assert wait_until(lambda: not tagged(tag)), f"left running: {tagged(tag)}"
    assert proc.returncode == 130, stdout.decode()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["num_requests"] == 40
    assert summary["statuses"].get("ok", 0) >= 1 and summary["statuses"].get("unfinished", 0) >= 1
    records = out / "records.parquet"
    assert "stopped" in (records / INCOMPLETE).read_text()
    with pytest.raises(ValueError, match="records are incomplete"):
        read_records(records)
    import pandas as pd
    assert len(pd.read_parquet(records)) == 40         # what it has, readable as a dataset
