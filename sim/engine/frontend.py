"""The front end of an engine measured from outside (``hawk profile --endpoint``): its API
server, one process serving one thing at a time, in the order things come. It admits each
request (``cost_s`` of work, after the request's round trip) before the engine sees it, and
streams each token the engine makes (``token_s`` of work each) before the client sees it, so
a burst of tokens delays the admissions behind it and a burst of arrivals the tokens.

``arrivals_seen`` is when the engine sees each request with admissions only (no tokens yet
known); ``serve`` takes an engine run's first-token and finish instants (the tokens between
them spread evenly), puts admissions and tokens through the one queue, and returns when the
engine sees each request and how long each one's first and last token waited to be
streamed. ``sim.engine.cluster`` runs the engine again on the new arrivals (a fixed point,
``PASSES`` times) and adds those waits to the records. Every wait is 0 for a request alone:
the round trip already holds one admission and one token's streaming.
"""

from __future__ import annotations

import math

import numpy as np

#: engine runs after the first one, each on the arrivals the previous one's tokens allow
PASSES = 2


def arrivals_seen(arrivals, latencies, cost_s: float) -> np.ndarray:
    """When the engine sees each request: ``latencies`` after its arrival (the round trip,
    which holds the front end's ``cost_s`` of work for it), admitted one at a time in arrival
    order (one stalled delays those behind it). A lone request is seen ``max(latency,
    cost_s)`` after it arrives."""
    arrivals = np.asarray(arrivals, dtype=float)
    seen = np.empty_like(arrivals)
    free_at = -math.inf
    for i, (a, latency) in enumerate(zip(arrivals, latencies)):
        seen[i] = free_at = max(a + max(latency - cost_s, 0.0), free_at) + cost_s
    return seen


def serve(arrivals, latencies, cost_s: float, token_s: float, first_token_at, finished_at,
          num_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seen, first wait, last wait): admissions ready at ``arrival + latency - cost_s`` and
    each request's ``num_tokens`` tokens ready from ``first_token_at`` to ``finished_at``
    (evenly; NaN: none), served first come first served (an admission before a token ready at
    the same instant). ``seen``: each admission's end; the waits: how long its first and
    last token waited for the front end (NaN without tokens)."""
    arrivals = np.asarray(arrivals, dtype=float)
    n = len(arrivals)
    # admissions in arrival order (as ``arrivals_seen``: one stalled holds those behind it)
    ready = [np.maximum.accumulate(
        arrivals + np.maximum(np.asarray(latencies, dtype=float) - cost_s, 0.0))]
    kind, owner, index = [np.zeros(n, dtype=np.int8)], [np.arange(n)], [np.zeros(n, int)]
    first = np.asarray(first_token_at, dtype=float)
    last = np.asarray(finished_at, dtype=float)
    tokens = np.asarray(num_tokens, dtype=np.int64)
    has = np.isfinite(first) & np.isfinite(last) & (tokens >= 1)
    for i in np.flatnonzero(has):
        k = int(tokens[i])
        ready.append(first[i] + (last[i] - first[i]) * np.arange(k) / max(k - 1, 1))
        kind.append(np.ones(k, dtype=np.int8))
        owner.append(np.full(k, i))
        index.append(np.arange(k))
    ready, kind = np.concatenate(ready), np.concatenate(kind)
    owner, index = np.concatenate(owner), np.concatenate(index)
    order = np.lexsort((kind, ready))
    seen, first_wait, last_wait = np.empty(n), np.full(n, math.nan), np.full(n, math.nan)
    free_at = -math.inf
    costs = (cost_s, token_s)
    for j in order.tolist():
        start = max(float(ready[j]), free_at)
        free_at = start + costs[kind[j]]
        i = int(owner[j])
        if kind[j] == 0:
            seen[i] = free_at
        elif index[j] == 0:
            first_wait[i] = start - ready[j]
        if kind[j] == 1 and index[j] == tokens[i] - 1:
            last_wait[i] = start - ready[j]
    return seen, first_wait, last_wait


def through_front_end(run, trace, m, seed: int):
    """The engine behind its measured front end (``m``: ``sim.engine.measured``), run by
    ``run(arrival_at)`` -> (env, ledger, pool): requests seen after their round trip and the
    front end's queue of admissions, and, with a cost per streamed token, of tokens too (the
    engine run again on the arrivals those allow); the records keep the requests' own
    arrivals and add their first and last tokens' waits."""
    latencies = m.request_latencies(len(trace), seed)
    env, ledger, pool = run(arrivals_seen(trace.arrival_at, latencies, m.frontend_request_s))
    waits = None
    for _ in range(PASSES if m.frontend_token_s else 0):
        seen, first_wait, last_wait = serve(
            trace.arrival_at, latencies, m.frontend_request_s, m.frontend_token_s,
            ledger.first_token_at, ledger.finished_at, trace.num_output_tokens)
        env, ledger, pool = run(seen)
        waits = (first_wait, last_wait)
    if waits is not None:       # the waits the last run's own tokens meet, not the previous'
        _, first_wait, last_wait = serve(
            trace.arrival_at, latencies, m.frontend_request_s, m.frontend_token_s,
            ledger.first_token_at, ledger.finished_at, trace.num_output_tokens)
        ok = np.isfinite(first_wait) & np.isfinite(last_wait)
        for i in np.flatnonzero(ok).tolist():
            ledger.first_token_at[i] += first_wait[i]
            ledger.finished_at[i] += last_wait[i]
    ledger.trace, ledger.arrival_at = trace, trace.arrival_at.tolist()
    return env, ledger, pool
