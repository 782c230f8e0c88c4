"""MovableTimer: one pending firing, moved in SimPy's queue, ordered as a new timer would be."""

import simpy
from simpy.events import NORMAL, Timeout

from sim.engine.timers import MovableTimer, run_now_if_next


def test_simpy_queue_layout_the_timer_relies_on():
    env = simpy.Environment()
    timeout = Timeout(env, 2.5)
    (entry,) = env._queue
    assert entry[0] == 2.5 and entry[1] == NORMAL and entry[3] is timeout
    assert next(env._eid) == entry[2] + 1


def run_log(moves):
    """Set a timer at 5, then at each (instant, new_at) of ``moves`` move it; a plain timer
    also fires at 5. Returns (fire log, events processed)."""
    env, log = simpy.Environment(), []
    timer = MovableTimer(env, lambda: log.append(("timer", env.now)))
    timer.set(5.0)
    Timeout(env, 5.0).callbacks.append(lambda _e: log.append(("plain", env.now)))
    for when, new_at in moves:
        Timeout(env, when).callbacks.append(lambda _e, a=new_at: timer.set(a))
    events = 0
    while env.peek() < float("inf"):
        env.step()
        events += 1
    return log, events


def test_a_timer_moved_later_or_earlier_fires_once_there():
    assert run_log([(1.0, 8.0)]) == ([("plain", 5.0), ("timer", 8.0)], 3)
    assert run_log([(1.0, 3.0)]) == ([("timer", 3.0), ("plain", 5.0)], 3)
    assert run_log([(1.0, 8.0), (2.0, 2.5)]) == ([("timer", 2.5), ("plain", 5.0)], 4)


def test_a_moved_timer_orders_among_same_instant_events_as_a_new_timer():
    """Moved at 1 to 6 and at 2 back to 5, it sorts after the plain timer set at 0 for 5, as
    a Timeout made at 2 would; set at 0 for 5, it sorts before it, and setting it again to
    the instant it is pending at keeps its place."""
    assert run_log([(1.0, 6.0), (2.0, 5.0)])[0] == [("plain", 5.0), ("timer", 5.0)]
    assert run_log([])[0] == [("timer", 5.0), ("plain", 5.0)]
    assert run_log([(1.0, 5.0)])[0] == [("timer", 5.0), ("plain", 5.0)]


def test_a_past_instant_fires_now_and_a_cancelled_timer_does_nothing():
    env, log = simpy.Environment(), []
    timer = MovableTimer(env, lambda: log.append(env.now))
    env.run(until=2.0)
    timer.set(1.0)
    assert timer.at == 1.0 and timer.pending
    env.run(until=3.0)
    assert log == [2.0] and not timer.pending
    timer.set(4.0)
    timer.cancel()
    env.run()
    assert log == [2.0] and env.now == 4.0       # the firing stays in the queue, inert


def test_a_timer_set_from_its_own_callback_schedules_a_new_firing():
    env, log = simpy.Environment(), []

    def tick():
        log.append(env.now)
        if len(log) < 3:
            timer.set(env.now + 1.0)

    timer = MovableTimer(env, tick)
    timer.set(1.0)
    env.run()
    assert log == [1.0, 2.0, 3.0]


def test_a_cancelled_firing_left_in_the_queue_never_fires_a_later_one():
    """The event of a firing that ran carries the next one; a cancelled firing's event stays
    in the queue, so a timer set again after a cancel fires once, at its new instant."""
    env, log = simpy.Environment(), []
    timer = MovableTimer(env, lambda: log.append(env.now))
    timer.set(1.0)
    env.run(until=1.5)
    timer.set(2.0)                    # reuses the event of the firing at 1
    timer.cancel()
    timer.set(3.0)
    env.run(until=2.5)
    assert log == [1.0] and timer.pending
    timer.set(4.0)
    env.run()
    assert log == [1.0, 4.0] and env.now == 4.0


def test_a_timer_knows_its_instant_and_whether_an_instant_comes_first():
    """``fires_at`` is the instant as a Timeout rounds it; ``first_until(at)`` holds while no
    event (bar the timer's own, later) is due at or before ``at``; ``set``'s ``now`` times
    the firing from that instant instead of the clock's."""
    env = simpy.Environment()
    timer = MovableTimer(env, lambda: None)
    assert timer.fires_at == float("inf") and timer.first_until(100.0)
    timer.set(5.0)
    assert timer.fires_at == 5.0 and timer.first_until(4.9) and not timer.first_until(5.0)
    Timeout(env, 3.0)
    assert timer.first_until(2.9) and not timer.first_until(3.0)
    env = simpy.Environment()
    env.run(until=0.2)
    timer = MovableTimer(env, lambda: None)
    timer.set(1.8, now=0.6)                       # as a Timeout made at 0.6 would round it
    assert timer.fires_at == 0.6 + (1.8 - 0.6) == 1.8000000000000003
    timer.set(1.9)
    timer.set(1.8)                                # from the clock: 0.2 + (1.8 - 0.2)
    assert timer.fires_at == 1.8


def test_an_event_runs_now_only_when_it_comes_strictly_before_every_queued_one():
    env = simpy.Environment()
    env.timeout(2.0)
    assert not run_now_if_next(env, 2.0) and env.now == 0.0     # a tie: it must queue
    assert not run_now_if_next(env, 3.0) and env.now == 0.0
    assert run_now_if_next(env, 1.5) and env.now == 1.5         # the clock moves there
    env.run()
    assert env.now == 2.0 and run_now_if_next(env, 0.25) and env.now == 2.25   # empty queue
