"""The reconcile loop's pacing: a pod event wakes the next pass, but never sooner than the minimum interval
after the last one, so the events of that time share a pass."""

from __future__ import annotations

import threading
import time

from harnessrl.operator.handlers import wait_for_next_pass


class Stopped(threading.Event):
    """kopf's DaemonStopped as the loop uses it, recording each wait."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_a_wake_soon_after_a_pass_waits_for_the_interval_and_is_consumed() -> None:
    wake, stopped = threading.Event(), Stopped()
    started = time.perf_counter()
    wake.set()
    wait_for_next_pass(wake, stopped, started, 0.4)
    assert time.perf_counter() - started >= 0.4 and len(stopped.waits) == 1 and 0 < stopped.waits[0] <= 0.4
    assert not wake.is_set()  # the events of the wait are handled by the pass that follows


def test_a_wake_long_after_the_last_pass_goes_at_once() -> None:
    wake, stopped = threading.Event(), Stopped()
    wake.set()
    wait_for_next_pass(wake, stopped, time.perf_counter() - 10.0, 0.4)  # the last pass started 10 s ago
    assert stopped.waits == [] and not wake.is_set()


def test_stopping_cuts_the_wait_short() -> None:
    wake, stopped = threading.Event(), Stopped()
    wake.set()
    stopped.set()
    wait_for_next_pass(wake, stopped, time.perf_counter(), 600.0)  # returns: it would hang otherwise
    assert len(stopped.waits) == 1
