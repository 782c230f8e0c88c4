"""The run's ledger turns into the records table: statuses, all-or-nothing generated tokens,
instance columns, a cut run's unfinished requests, and an open request named when none was
expected."""

from __future__ import annotations

import math

import pytest

from sim.engine.ledger import Ledger
from tests.builders import make_trace
from traces.schema import Status


def make_ledger():
    trace = make_trace([0.0, 1.0, 2.0, 3.0], [100, 200, 300, 400], [10, 20, 30, 40])
    ledger = Ledger(trace)
    ledger.prefill_instance[0] = ledger.prefill_instance[1] = 1
    ledger.decode_instance[0] = 2
    ledger.first_token_at[0] = 1.5
    ledger.finish(0, 4.0)
    ledger.fail(1, Status.FAILED_TRANSFER, 5.0)
    ledger.fail(2, Status.REJECTED_PROMPT_TOO_LONG, 2.0)
    return ledger


def test_records_carry_each_status_and_generated_tokens_all_or_nothing():
    ledger = make_ledger()
    ledger.finish(3, 9.0)
    rec = ledger.frame()
    assert rec["status"].tolist() == ["ok", "failed_transfer", "rejected_prompt_too_long", "ok"]
    assert rec["num_generated_tokens"].tolist() == [10, 0, 0, 40]
    assert rec["prefill_instance"].tolist() == [1, 1, -1, -1]
    assert rec["decode_instance"].tolist() == [2, -1, -1, -1]
    assert str(rec["prefill_instance"].dtype) == "int64"
    assert rec["finished_at"].tolist() == [4.0, 5.0, 2.0, 9.0]
    assert ledger.num_ended == 4 and ledger.num_rejected == 1


def test_an_open_request_is_unfinished_in_a_cut_run_and_an_error_otherwise():
    ledger = make_ledger()
    with pytest.raises(RuntimeError, match="request 3 ended in no state"):
        ledger.frame()
    rec = ledger.frame(cut_at=4.5)             # request 1 failed after the cut
    assert rec["status"].tolist() == ["ok", "unfinished", "rejected_prompt_too_long",
                                      "unfinished"]
    assert rec["num_generated_tokens"].tolist() == [10, 0, 0, 0]
    assert math.isnan(rec["finished_at"][1]) and rec["finished_at"][0] == 4.0


def test_judge_names_each_rejection_and_none_for_the_servable():
    ledger = make_ledger()
    reasons = ledger.judge(lambda prompt, output: (prompt > 250) * 1 + (output == 10) * 3)
    assert reasons == [Status.REJECTED_DECODE_CAPACITY, None, Status.REJECTED_PROMPT_TOO_LONG,
                       Status.REJECTED_PROMPT_TOO_LONG]
    assert ledger.judge(lambda prompt, output: 0 * prompt) == [None] * 4
    assert not ledger.rejected.any()
