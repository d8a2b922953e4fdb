"""Ctrl-C and SIGTERM reach the local run as a request to stop at a safe point, never as an exception mid-write."""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import pytest

import harnessrl.store.engine as store_engine
from harnessrl.local.stop_signals import StopSignals
from harnessrl.store import TraceStore
from harnessrl.store.states import RolloutState


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_is_recorded_not_raised_and_the_handlers_come_back(signum: signal.Signals, code: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals() as stop:
        assert stop.received is None and stop.exit_code == 0
        os.kill(os.getpid(), signum)  # delivered to this (main) thread before os.kill returns to Python code
        assert stop.received is signum
        assert stop.exit_code == code
        other = signal.SIGTERM if signum is signal.SIGINT else signal.SIGINT
        os.kill(os.getpid(), other)  # a second, different signal does not overwrite what stopped the run
        assert stop.received is signum
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_during_store_writes_leaves_the_store_writable(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure this guards against: KeyboardInterrupt raised between BEGIN IMMEDIATE and SQLAlchemy's
    bookkeeping left the process holding SQLite's write lock, and its shutdown writes then waited out the busy
    timeout on its own lock ("database is locked")."""
    monkeypatch.setattr(store_engine, "SQLITE_BUSY_TIMEOUT_MS", 2000)  # a leaked lock fails fast
    rng = random.Random(7)
    with TraceStore.connect(f"sqlite:///{tmp_path / 'trace.sqlite'}") as store:
        store.upgrade()
        store.ensure_run("r")
        (task,) = store.add_tasks("r", [{"id": "t", "data": {}}])
        index = 0
        for _ in range(25):
            timer = threading.Timer(rng.uniform(0.001, 0.02), os.kill, (os.getpid(), signal.SIGINT))
            with StopSignals() as stop:
                timer.start()
                while stop.received is None:  # the runner's loop shape: check between passes
                    rollout = store.create_rollout("r", task, index)
                    store.try_transition(rollout, 0, RolloutState.QUEUED, RolloutState.RUNNING)
                    index += 1
            timer.join()
            # What the runner's shutdown does next: move attempts on, in this same process.
            running = store.list_attempts("r", states=[RolloutState.RUNNING])
            for attempt in running:
                assert store.try_transition(attempt.rollout_id, attempt.attempt, RolloutState.RUNNING,
                                            RolloutState.CANCELLED, "stopping")
        assert store.count_attempts("r")[RolloutState.CANCELLED] == index
