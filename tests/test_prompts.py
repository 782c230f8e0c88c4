"""Replay prompts: distinct from their first token by default, a set shared prefix on request."""

import itertools

import numpy as np
import pytest

from traces.prompts import WORDS, PromptMaker, PromptSpec


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("spec", [PromptSpec(), PromptSpec(kind="token_ids", seed=3)])
def test_default_prompts_differ_from_their_first_token(spec):
    maker = PromptMaker(spec, 64)
    n = min(spec.vocab_size, 400)
    firsts = {maker.tokens(i, 64)[0] for i in range(n)}
    assert len(firsts) == n               # any vocabulary-size run of requests: no shared token


def test_exact_lengths_and_token_id_range():
    words = PromptMaker(PromptSpec(), 100)
    assert all(len(words.prompt(i, n).split()) == n for i, n in [(0, 1), (1, 7), (2, 100)])
    assert set(words.prompt(5, 100).split()) <= set(WORDS)
    ids = PromptMaker(PromptSpec(kind="token_ids", token_id_low=50, token_id_high=60), 30)
    prompt = ids.prompt(0, 30)
    assert len(prompt) == 30 and all(50 <= t < 60 for t in prompt)


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b = PromptMaker(PromptSpec(seed=1), 20), PromptMaker(PromptSpec(seed=1), 20)
    assert [a.prompt(i, 20) for i in range(5)] == [b.prompt(i, 20) for i in range(5)]
    c = PromptMaker(PromptSpec(seed=2), 20)
    assert a.prompt(0, 20) != c.prompt(0, 20)


@pytest.mark.parametrize("ratio, n, shared", [(0.5, 40, 20), (0.25, 10, 2), (0.9, 10, 9)])
def test_shared_prefix_ratio_shares_exactly_that_many_tokens(ratio, n, shared):
    maker = PromptMaker(PromptSpec(kind="token_ids", shared_prefix_ratio=ratio), n)
    prompts = [maker.prompt(i, n) for i in range(30)]
    for a, b in itertools.combinations(prompts, 2):
        assert common_prefix(a, b) == shared


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="shared prefix ratio must be in"):
        PromptSpec(shared_prefix_ratio=1.0)
    with pytest.raises(ValueError, match="prompt kind 'bytes' is not one of"):
        PromptSpec(kind="bytes")
    with pytest.raises(ValueError, match="0 <= low < high"):
        PromptSpec(kind="token_ids", token_id_low=5, token_id_high=5)
    assert np.all(PromptMaker(PromptSpec(), 3).tokens(0, 3) < len(WORDS))
