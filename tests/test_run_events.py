"""``sim.engine.timers.run_events``: SimPy's run loop with ``step`` inlined must process the same
events in the same order as ``env.run`` and fail the same way."""

from __future__ import annotations

import pytest
import simpy

from sim.engine.timers import run_events


def scenario(env: simpy.Environment, log: list, fail_at: float | None = None) -> None:
    """Two processes and bare timeouts with ties at the same instants."""

    def ticker(name: str, period: float, count: int):
        for k in range(count):
            yield env.timeout(period)
            log.append((env.now, name, k))
            if fail_at is not None and env.now >= fail_at:
                raise KeyError(f"{name} failed at {env.now}")

    env.process(ticker("a", 1.0, 4))
    env.process(ticker("b", 0.5, 6))
    for at in (0.5, 1.0, 2.0):
        env.timeout(at).callbacks.append(lambda ev: log.append((env.now, "bare", None)))


def test_the_same_events_in_the_same_order_as_env_run():
    logs = []
    for run in (lambda env: env.run(), run_events):
        env, log = simpy.Environment(), []
        scenario(env, log)
        run(env)
        logs.append((log, env.now))
    assert logs[0] == logs[1]
    assert logs[0][1] == 4.0 and len(logs[0][0]) == 13


def test_a_failed_process_raises_as_env_run_raises_it():
    raised = []
    for run in (lambda env: env.run(), run_events):
        env, log = simpy.Environment(), []
        scenario(env, log, fail_at=1.5)
        with pytest.raises(KeyError) as info:
            run(env)
        raised.append((str(info.value), type(info.value.__cause__), log, env.now))
    assert raised[0] == raised[1]
    assert raised[0][0] == "'b failed at 1.5'"


def test_a_cut_run_stops_where_env_run_stops():
    env, log = simpy.Environment(), []
    scenario(env, log)
    run_events(env, until=1.0)
    assert env.now == 1.0
    assert (1.0, "a", 0) not in log and (0.5, "b", 0) in log   # the cut comes first
