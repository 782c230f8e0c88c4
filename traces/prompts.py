"""Synthetic prompts for a replay: distinct from their first token, or sharing a set prefix.

A real engine skips the prefill of any prefix it has cached (vLLM's automatic prefix caching,
SGLang's radix cache, llama-server's per-slot prompt cache). Prompts that repeat one word share
all their tokens, so such a replay measures the cache, not prefill: llama-server evaluated
about a fifth of the prompt tokens it was sent. So by default every prompt is a seeded random
sequence over a vocabulary of V entries, and request ``i``'s first token is entry ``i mod V``
of a seeded permutation of the vocabulary: any V consecutive requests differ from their first
token on, and each later token matches another prompt's with probability 1/V.

``shared_prefix_ratio`` r in [0, 1) gives a prompt of N tokens a first ``floor(r N)`` tokens
taken from one shared seeded sequence (the same for every request), then its distinct part:
a deliberate prefix-sharing workload for studying caching.

A trace with prefix block hashes (``Trace.hash_ids``, blocks of ``hash_block_size`` tokens)
says which prompts share what: ``prompt(i, n, hashes, block)`` builds block j of a prompt from
the seeded sequence of its hash (block j of hash h: the same ``block`` tokens in every prompt
that has h there; a last, partial block takes the first tokens of its hash's), so two prompts
with the same leading hashes share exactly those tokens and an engine's prefix cache finds
what the trace says it would. Tokens past the hashed blocks are the request's distinct ones.

Vocabularies (``kind``):

* ``words`` (default): ``WORDS``, common short English words, each one token in common BPE
  tokenizers when preceded by a space. A prompt of N words is about N tokens, not exactly (a
  BOS token or a chat template adds a few); the replay records the server's own count.
* ``token_ids``: ids in ``[token_id_low, token_id_high)``, sent as a list of ints to the
  completions API (vLLM and SGLang accept it; llama-cpp-python takes strings only). Exact.

Same spec, same index, same length: the same prompt, in any run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PROMPT_KINDS = ("words", "token_ids")

WORDS = tuple("""
the of and to in is you that it he was for on are as with his they at be this have from or
one had by word but not what all were we when your can said there use an each which she do
how their if will up other about out many then them these so some her would make like him
into time has look two more write go see number no way could people my than first water been
call who oil its now find long down day did get come made may part over new sound take only
little work know place year live me back give most very after thing our just name good man
think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must
big even such because turn here why ask went men read need land different home us move try
kind hand picture again change off play spell air away animal house point page letter mother
answer found study still learn should world high every near add food between own below
country plant last school father keep tree never start city earth eye light thought head under
story saw left few while along might close something seem next hard open example begin life
always those both paper together got group often run important until children side feet car
mile night walk white sea began grow took river four carry state once book hear stop without
second later miss idea enough eat face watch far real almost let above girl sometimes mountain
cut young talk soon list song being leave family
""".split())


@dataclass(frozen=True)
class PromptSpec:
    """How prompts are made; see the module docstring."""

    kind: str = "words"
    seed: int = 0
    shared_prefix_ratio: float = 0.0
    token_id_low: int = 1000
    token_id_high: int = 30000

    def __post_init__(self) -> None:
        if self.kind not in PROMPT_KINDS:
            raise ValueError(f"prompt kind {self.kind!r} is not one of {list(PROMPT_KINDS)}")
        if not (math.isfinite(self.shared_prefix_ratio) and 0 <= self.shared_prefix_ratio < 1):
            raise ValueError(f"shared prefix ratio must be in [0, 1), "
                             f"got {self.shared_prefix_ratio}")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise ValueError(f"token ids need 0 <= low < high, got "
                             f"[{self.token_id_low}, {self.token_id_high})")
        if self.seed < 0:
            raise ValueError(f"prompt seed must be >= 0, got {self.seed}")

    @property
    def vocab_size(self) -> int:
        return len(WORDS) if self.kind == "words" else self.token_id_high - self.token_id_low


class PromptMaker:
    """Prompts of one replay: ``prompt(i, n)`` is request ``i``'s prompt of ``n`` tokens."""

    def __init__(self, spec: PromptSpec, max_prompt_tokens: int):
        self.spec = spec
        size = spec.vocab_size
        self._first = np.random.default_rng([spec.seed, 0]).permutation(size)
        shared = max_prompt_tokens if spec.shared_prefix_ratio > 0 else 0
        self._shared = np.random.default_rng([spec.seed, 1]).integers(0, size, shared)

    def shared_tokens(self, num_tokens: int) -> int:
        """Tokens of an ``num_tokens``-token prompt taken from the shared prefix."""
        return min(math.floor(self.spec.shared_prefix_ratio * num_tokens), num_tokens - 1)

    def tokens(self, index: int, num_tokens: int) -> np.ndarray:
        """Vocabulary indices of request ``index``'s prompt: shared part, then distinct part."""
        size = self.spec.vocab_size
        k = self.shared_tokens(num_tokens)
        first = self._first[index % size]
        if k > 0 and first == self._shared[k]:     # keep the shared prefix exactly k long
            first = self._first[(index + size // 2) % size]
        rest = np.random.default_rng([self.spec.seed, 2, index]).integers(
            0, size, num_tokens - k - 1)
        return np.concatenate([self._shared[:k], [first], rest]).astype(np.int64)

    def hashed_tokens(self, index: int, num_tokens: int, hashes, block: int) -> np.ndarray:
        """Vocabulary indices of a prompt built from its block hashes (module docstring)."""
        size, seed, parts = self.spec.vocab_size, self.spec.seed, []
        for j, h in enumerate(hashes[:-(-num_tokens // block)]):
            n = min(block, num_tokens - j * block)
            parts.append(np.random.default_rng([seed, 3, int(h) % 2**63]).integers(
                0, size, block)[:n])
        rest = num_tokens - sum(len(p) for p in parts)
        if rest:
            parts.append(self.tokens(index, rest))
        return np.concatenate(parts).astype(np.int64)

    def prompt(self, index: int, num_tokens: int, hashes=None,
               block: int = 512) -> str | list[int]:
        """Text (``words``) or a list of token ids (``token_ids``); from ``hashes`` (the
        request's block hashes of ``block`` tokens) where given."""
        tokens = (self.tokens(index, num_tokens) if hashes is None else
                  self.hashed_tokens(index, num_tokens, hashes, block))
        if self.spec.kind == "words":
            return " ".join(WORDS[t] for t in tokens)
        return (tokens + self.spec.token_id_low).tolist()
