"""Shared-prefix workloads: system prompts and multi-turn sessions, with prefix block hashes.

A *session* (one user's chat) opens at a Poisson instant (``SessionSpec.rate`` sessions/s)
and picks one of ``num_system_prompts`` system prompts (uniformly). Its turn k sends the
system prompt, every earlier turn's user message and answer, and a new user message:

    prompt_k = system + u_1 + o_1 + ... + u_(k-1) + o_(k-1) + u_k          output_k = o_k

so turn k's prompt starts with the whole of turn k-1's prompt and answer. The next turn
arrives an exponential think time (mean ``think_time_s``) after the previous one *arrived*:
the trace is open-loop, as every trace file is, so a slow server does not delay it. A session
has a geometric number of turns (mean ``mean_turns``) and ends early when the next turn's
prompt and output would pass ``max_tokens``. User messages and answers are geometric with
means ``user_tokens`` and ``output_tokens`` (>= 1 each).

Hashes (``Trace.hash_ids``, blocks of ``hash_block_size`` tokens): block j of a prompt ends
at token e = min((j + 1) B, prompt length); its content is fixed by who wrote tokens 0..e,
which is the system prompt alone when e <= its length and the session otherwise. So the
block's hash is the number given to (system prompt, e) or (session, e), numbered in order of
first use. Equal numbers are equal prefixes, as in Mooncake's ``hash_ids``; a partial block
gets its own number, which no other prompt's block shares unless the prompt is the same.
The numbers (and the whole trace) depend only on the spec and the seed.

The defaults are illustrative, not fitted to any trace: four 1,024-token system prompts,
four turns of 200-token messages and 200-token answers, 10 s to think. ``hash_block_size``
defaults to Mooncake's 512 (``traces.loaders.MOONCAKE_BLOCK_SIZE``), so ``write_mooncake``
writes a trace that loads back with the same hashes; vLLM's own block is 16 tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from traces.trace import Trace


@dataclass(frozen=True)
class SessionSpec:
    """A shared-prefix workload (see the module docstring for each field)."""

    rate: float = 0.5                   # sessions opened per second (Poisson)
    num_sessions: int = 100
    num_system_prompts: int = 4
    system_prompt_tokens: int = 1024
    mean_turns: float = 4.0             # geometric, >= 1
    user_tokens: float = 200.0          # mean user message, geometric
    output_tokens: float = 200.0        # mean answer, geometric
    think_time_s: float = 10.0          # mean, exponential, from one turn's arrival
    max_tokens: int = 8192              # a turn's prompt + output at most
    hash_block_size: int = 512

    def __post_init__(self) -> None:
        for name in ("rate", "think_time_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"sessions: {name} must be finite and > 0, got {value}")
        for name in ("mean_turns", "user_tokens", "output_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"sessions: {name} must be finite and >= 1, got {value}")
        for name in ("num_sessions", "num_system_prompts", "system_prompt_tokens",
                     "max_tokens", "hash_block_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"sessions: {name} must be a whole number >= 1, got {value!r}")
        if self.max_tokens <= self.system_prompt_tokens + 1:
            raise ValueError(f"sessions: max_tokens {self.max_tokens} leaves no room past the "
                             f"{self.system_prompt_tokens}-token system prompt")


def session_trace(spec: SessionSpec, seed: int = 0, name: str = "sessions") -> Trace:
    """The requests of ``spec``'s sessions, in arrival order, ids in that order."""
    rng = np.random.default_rng(seed)
    opens = np.cumsum(rng.exponential(1.0 / spec.rate, size=spec.num_sessions))
    systems = rng.integers(spec.num_system_prompts, size=spec.num_sessions)
    turns = rng.geometric(1.0 / spec.mean_turns, size=spec.num_sessions)
    numbers: dict[tuple, int] = {}
    rows = []                                   # (arrival, prompt, output, hashes)
    for s in range(spec.num_sessions):
        at, context = float(opens[s]), spec.system_prompt_tokens
        for _ in range(int(turns[s])):
            user = int(rng.geometric(1.0 / spec.user_tokens))
            output = int(rng.geometric(1.0 / spec.output_tokens))
            prompt = context + user
            if prompt + output > spec.max_tokens:
                break
            rows.append((at, prompt, output,
                         _hashes(prompt, int(systems[s]), s, spec, numbers)))
            context = prompt + output
            at += float(rng.exponential(spec.think_time_s))
    order = sorted(range(len(rows)), key=lambda k: rows[k][0])
    hashes = np.empty(len(rows), dtype=object)
    hashes[:] = [rows[k][3] for k in order]
    return Trace(np.array([rows[k][0] for k in order]), np.array([rows[k][1] for k in order]),
                 np.array([rows[k][2] for k in order]), np.arange(len(rows)), name=name,
                 hash_ids=hashes, hash_block_size=spec.hash_block_size)


def _hashes(prompt: int, system: int, session: int, spec: SessionSpec,
            numbers: dict) -> tuple[int, ...]:
    """Block hashes of a prompt of ``prompt`` tokens (see the module docstring)."""
    B, out = spec.hash_block_size, []
    for end in range(B, prompt + B, B):
        end = min(end, prompt)
        key = ("system", system, end) if end <= spec.system_prompt_tokens else \
            ("session", session, end)
        out.append(numbers.setdefault(key, len(numbers)))
    return tuple(out)


def write_mooncake(trace: Trace, path) -> None:
    """``trace`` as a Mooncake JSONL trace (timestamp in ms, input_length, output_length,
    hash_ids), which ``traces.loaders`` reads back; its hash blocks must be Mooncake's."""
    from traces.loaders import MOONCAKE_BLOCK_SIZE

    if trace.hash_ids is None or trace.hash_block_size != MOONCAKE_BLOCK_SIZE:
        raise ValueError(f"trace {trace.name!r}: a Mooncake trace has hash_ids of "
                         f"{MOONCAKE_BLOCK_SIZE}-token blocks; this one has "
                         f"{'none' if trace.hash_ids is None else trace.hash_block_size}")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for k in range(len(trace)):
            f.write(json.dumps({"timestamp": round(float(trace.arrival_at[k]) * 1e3, 3),
                                "input_length": int(trace.num_prompt_tokens[k]),
                                "output_length": int(trace.num_output_tokens[k]),
                                "hash_ids": list(trace.hash_ids[k])}) + "\n")
