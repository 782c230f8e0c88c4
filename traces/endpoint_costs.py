"""What each request costs beyond its own steps, measured by ``hawk profile --endpoint``
(``traces.endpoint_profile``): the front end's time per request (``frontend_cost``, from the
bursts) and what a request's coming and going costs the steps of the others (the ``churn``
point, ``churn_cost``).

The decode points send their N requests at once and time the steps while all N decode: no
request arrives or finishes inside that window. Under a trace, requests come and go at every
step; each one costs the engine more than its share of the step that prefills it (the API
server's work for it on a core the engine shares, the scheduler's and the model runner's
bookkeeping to add it to the batch and take it out). A churn point measures that:

- N requests of P prompt tokens and T output tokens at once, alone: the decode step ``s0``
  (the median over the N of each one's mean gap while all N decode);
- the same, with one-token requests (one prompt token, ``max_tokens`` 1) sent meanwhile at
  ``rate`` per second: the step ``s1``, and the rate ``r`` at which those finished inside
  the window (what reached the engine, whatever the front end let through).

Alternated ``repeats`` times (the two halves of a pair see the same machine). In one second
of the window the engine spends ``1 - s0 / s1`` more on the N requests' steps than without
churn, for ``r`` requests: ``(1 - s0 / s1) / r`` seconds per request. The simulator prices a
one-token request's prefill inside a step as the table says (``mixed_step_time``); what it
does not see is the rest: ``request_overhead`` subtracts that share, and
``sim.engine.aggregated`` adds the rest to the step that admits each request.
"""

from __future__ import annotations

import asyncio

import numpy as np

#: one-token requests per second sent during a churn run (the front end lets through fewer)
CHURN_RATE = 50.0


async def churn_pair(http, config, prompts, counter, prompt: int, batch: int,
                     max_tokens: int, *, run, step_of, error,
                     rate: float = CHURN_RATE) -> tuple[float, float, float]:
    """(s0, s1, r) of one alternation: the step alone, the step with churn, the churn rate
    that finished inside the window. ``run(prompt, batch, max_tokens)`` sends a batch and
    returns its progress states, ``step_of(states)`` is a decode run's step, ``error`` the
    exception a failed request raises (``traces.endpoint_profile``'s)."""
    s0 = step_of(await run(prompt, batch, max_tokens))
    streams, small = await _with_churn(http, config, prompts, counter, prompt, batch,
                                       max_tokens, rate)
    bad = [s for s in streams + small if s.status is None or s.status.value != "ok"]
    if bad:
        raise error(f"{len(bad)} requests of a churn run failed: {bad[0].status} "
                    f"{bad[0].error}")
    start = max(s.token_at[0] for s in streams)
    end = min(s.token_at[-1] for s in streams)
    done = sum(1 for s in small if start <= s.token_at[-1] <= end)
    return s0, step_of(streams), done / max(end - start, 1e-9)


async def _with_churn(http, config, prompts, counter, prompt, batch, max_tokens, rate):
    """The batch's and the one-token requests' progress states, the latter sent every
    ``1 / rate`` seconds until the batch is done."""
    from traces.replay import _Progress, _send, request_body

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    streams = [_Progress(0.0, max_tokens) for _ in range(batch)]
    tasks = [asyncio.ensure_future(_send(http, config, request_body(
        config, prompts.prompt(next(counter), prompt), max_tokens), s, t0)) for s in streams]
    small, sent = [], []
    while not all(t.done() for t in tasks):
        state = _Progress(loop.time() - t0, 1)
        small.append(state)
        sent.append(asyncio.ensure_future(_send(http, config, request_body(
            config, prompts.prompt(next(counter), 1), 1), state, t0)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks, *sent)
    return streams, small


def frontend_cost(samples: dict[str, dict]) -> float | None:
    """Seconds the front end spends on each request: the least-squares slope of the bursts'
    median drain time against their size (None without two sizes; never below 0)."""
    bursts = sorted((s["batch"], float(np.median(s["seconds"]))) for s in samples.values()
                    if s["kind"] == "burst")
    if len(bursts) < 2:
        return None
    k, t = np.array(bursts, dtype=float).T
    return max(0.0, float(np.polyfit(k, t, 1)[0]))


def frontend_token_cost(samples: dict[str, dict]) -> float | None:
    """Seconds of the API server's CPU per streamed token: per decode run, its CPU less the
    bursts' CPU per one-token request for each of its N requests, over the N x (T - 1)
    tokens after their first; the median over the runs (never below 0). None without the
    CPU readings (an endpoint without vLLM's ``/metrics``)."""
    bursts = [s for s in samples.values() if s["kind"] == "burst" and "api_cpu_seconds" in s]
    runs = [(s, cpu) for s in samples.values() if s["kind"] == "decode"
            for cpu in s.get("api_cpu_seconds", []) if s["max_tokens"] > 1]
    if not bursts or not runs:
        return None
    widest = max(bursts, key=lambda s: s["batch"])
    per_request = float(np.median(widest["api_cpu_seconds"])) / widest["batch"]
    each = [(cpu - s["batch"] * per_request) / (s["batch"] * (s["max_tokens"] - 1))
            for s, cpu in runs]
    return max(0.0, float(np.median(each)))


def churn_cost(samples: dict[str, dict]) -> dict | None:
    """``[serving]`` keys of the churn point: ``request_churn_s``, the median over its runs of
    ``(1 - s0 / s1) / r`` (seconds a request's coming and going adds to the others' steps,
    its prefill's share included; never below 0), and the point's ``churn_batch`` and ``churn_context`` (so
    the simulator can take out the share its table already prices). None without one."""
    runs, point = [], None
    for s in samples.values():
        if s["kind"] != "churn":
            continue
        point = s
        runs += [(1.0 - s0 / s1) / r for s0, s1, r in
                 zip(s["baseline_seconds"], s["seconds"], s["rates"]) if r > 0 and s1 > 0]
    if not runs:
        return None
    return {"request_churn_s": max(0.0, float(np.median(runs))),
            "churn_batch": int(point["batch"]),
            "churn_context": int(point["prompt"] + point["max_tokens"] // 2)}
