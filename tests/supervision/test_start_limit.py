"""supervise's start limit: failed starts back off, doubling from backoff_s up to backoff_max_s, and past
start_limit_burst within start_limit_interval_s supervise gives up; failures older than the window are forgotten."""
from restartkit.supervision.start_limit import StartLimit

CFG = {"start_limit_interval_s": 60.0, "start_limit_burst": 5, "backoff_s": 1.0, "backoff_max_s": 5.0}


def test_the_backoff_doubles_up_to_its_maximum_and_the_burst_gives_up():
    limit = StartLimit(CFG)
    waits = []
    for i in range(6):
        limit.note(1000.0 + i)
        waits.append(limit.backoff_s())
        assert limit.exceeded() == (i == 5), i
    assert waits == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert limit.within(1005.0) == 6 and limit.within(1100.0) == 0


def test_failures_outside_the_window_are_forgotten_and_a_crash_after_serving_clears_them():
    limit = StartLimit(CFG)
    for t in (0.0, 1.0, 2.0):
        limit.note(t)
    limit.note(100.0)  # the three before are older than the window
    assert len(limit) == 1 and limit.backoff_s() == 0.0
    limit.clear()
    assert len(limit) == 0 and not limit.exceeded()
