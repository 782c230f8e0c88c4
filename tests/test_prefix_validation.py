"""The pieces of ``sim.validation.prefix`` that need no engine: the engine's cacheable blocks,
unshared twins, paired TTFT and the command's one-line errors (the comparison with a live vLLM
is tests/test_vllm_prefix.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim.validation.prefix import (engine_cache_blocks, main, paired_ttft, simulate_hit_rate,
                                   with_unshared_twins)
from traces.sessions import SessionSpec, session_trace

SPEC = SessionSpec(num_sessions=6, rate=1.0, num_system_prompts=1, system_prompt_tokens=64,
                   mean_turns=2.0, user_tokens=16.0, output_tokens=8.0, think_time_s=1.0,
                   max_tokens=500, hash_block_size=32)


def test_vllm_caches_one_block_fewer_than_its_pool_holds():
    assert engine_cache_blocks(20) == 19
    with pytest.raises(ValueError, match="num_gpu_blocks must exceed 1, got 1"):
        engine_cache_blocks(1)


def test_each_twin_has_its_original_s_lengths_later_and_shares_no_block():
    trace = session_trace(SPEC, seed=3)
    merged, original = with_unshared_twins(trace, 0.5)
    assert len(merged) == 2 * len(trace) and np.all(np.diff(merged.arrival_at) >= 0)
    twins = np.flatnonzero(original >= 0)
    assert len(twins) == len(trace) and np.all(original[original >= 0] < 2 * len(trace))
    assert set(original[twins]) == set(np.flatnonzero(original < 0))
    for t in twins:
        o = original[t]
        assert merged.arrival_at[t] == pytest.approx(merged.arrival_at[o] + 0.5)
        assert merged.num_prompt_tokens[t] == merged.num_prompt_tokens[o]
        assert merged.num_output_tokens[t] == merged.num_output_tokens[o]
        others = {h for k, hashes in enumerate(merged.hash_ids) if k != t for h in hashes}
        assert not others & set(merged.hash_ids[t])


def test_twins_double_the_queries_and_add_no_hit_to_an_unbounded_cache():
    trace = session_trace(SPEC, seed=3)
    alone = simulate_hit_rate(trace)
    merged = simulate_hit_rate(with_unshared_twins(trace, 0.5)[0])
    assert alone["hit_tokens"] > 0
    assert merged["hit_tokens"] == alone["hit_tokens"]
    assert merged["query_tokens"] == 2 * alone["query_tokens"]


def test_pairs_compare_each_original_with_its_own_twin():
    original = np.array([-1, -1, 0, 1])                 # ids 2 and 3 are twins of 0 and 1
    records = pd.DataFrame({"request_id": [3, 2, 1, 0], "arrival_at": [1.5, 1.0, 0.5, 0.0],
                            "first_token_at": [2.5, 1.4, 0.6, 0.1]})
    pairs = paired_ttft(records, original)               # originals 0.1, 0.1; twins 0.4, 1.0
    assert pairs["num_pairs"] == 2
    assert pairs["shared_ttft_mean_s"] == pytest.approx(0.1)
    assert pairs["twin_ttft_mean_s"] == pytest.approx(0.7)
    assert pairs["diff_mean_s"] == pytest.approx(-0.6)
    assert pairs["diff_median_s"] == pytest.approx(-0.6)


@pytest.mark.parametrize("argv, message", [
    (["--vocab", "x"], "--vocab takes LOW:HIGH, got 'x'"),
    (["--blocks", "1"], "num_gpu_blocks must exceed 1"),
    (["--blocks", "5"], "4 KV blocks of 32 tokens hold 128 tokens"),
    (["--block", "0"], "hash_block_size must be a whole number >= 1"),
])
def test_bad_input_is_one_line_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
