"""The decode instance's state objects check their invariants (``sim.engine.decode_state``):
a run keeps them at every step, and a broken one is caught."""

from __future__ import annotations

import numpy as np
import pytest

import sim.engine.cluster as cluster
from sim.engine.decode import DecodeInstance
from tests.builders import checked_simulate, make_config, random_trace

PREEMPTING = {"cluster.decode.max_batch_size": 32, "cluster.decode.max_num_blocks": 200}


def trace():
    return random_trace(np.random.default_rng(3), 150, 3.0, max_output=300)


def made_decodes(monkeypatch) -> list:
    made, base = [], cluster.DecodeInstance
    monkeypatch.setattr(cluster, "DecodeInstance",
                        lambda *a, **k: made.append(base(*a, **k)) or made[-1])
    return made


def test_a_run_that_preempts_keeps_every_invariant_and_ends_holding_nothing():
    result = checked_simulate(make_config(**PREEMPTING), trace())
    assert result.stats["decode_preemptions"][0] > 0


def test_a_cut_run_holds_requests_its_end_check_sees(monkeypatch):
    made = made_decodes(monkeypatch)
    cluster.simulate(make_config(**PREEMPTING), trace(), until=20.0)
    (decode,) = made
    decode.check()                                  # consistent, mid-run
    with pytest.raises(AssertionError, match="requests left"):
        decode.check(ended=True)


def test_a_context_base_out_of_step_with_the_batch_is_caught(monkeypatch):
    finish = DecodeInstance._finish

    def off_by_one(self, i, now):
        finish(self, i, now)
        if i == 40:
            self.batch.context_base += 1

    monkeypatch.setattr(DecodeInstance, "_finish", off_by_one)
    with pytest.raises(AssertionError, match="context base"):
        checked_simulate(make_config(**PREEMPTING), trace())


def test_a_preempted_request_missing_from_pending_is_caught(monkeypatch):
    made = made_decodes(monkeypatch)
    cluster.simulate(make_config(**PREEMPTING), trace(), until=20.0)
    (decode,) = made
    decode.room.preempted_at[10_000] = 0.0
    with pytest.raises(AssertionError, match="preempted, not pending"):
        decode.check()
