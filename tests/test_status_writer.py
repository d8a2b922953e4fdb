"""The operator's status writer: at most one patch in flight per run, latest wins, a final status lands last."""

from __future__ import annotations

import threading
import time
from typing import Any

from harnessrl.operator.status_writer import StatusWriter


class GatedPatch:
    """Records patches; each waits for the gate, so a test decides when the one in flight lands."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.written: list[dict[str, Any]] = []

    def __call__(self, status: dict[str, Any]) -> None:
        self.started.set()
        assert self.gate.wait(60)
        self.written.append(status)


def test_statuses_given_while_one_is_in_flight_are_coalesced_to_the_newest() -> None:
    patch = GatedPatch()
    writer = StatusWriter(patch)
    writer.write({"n": 1})
    assert patch.started.wait(60)
    for n in (2, 3, 4):
        writer.write({"n": n})  # returns at once: the first patch is still in flight
    patch.gate.set()
    assert writer.flush(60)
    assert patch.written == [{"n": 1}, {"n": 4}]


def test_a_final_status_waits_for_the_patch_in_flight_and_drops_the_pending_one() -> None:
    patch = GatedPatch()
    writer = StatusWriter(patch)
    writer.write({"phase": "Running", "n": 1})
    assert patch.started.wait(60)
    writer.write({"phase": "Running", "n": 2})
    final = threading.Thread(target=writer.write_now, args=({"phase": "Succeeded"},))
    final.start()
    deadline = time.monotonic() + 60
    while writer._pending is not None and time.monotonic() < deadline:  # the final write dropped it
        time.sleep(0.01)
    patch.gate.set()
    final.join(60)
    assert patch.written == [{"phase": "Running", "n": 1}, {"phase": "Succeeded"}]
    assert writer.flush(60)
    assert patch.written[-1] == {"phase": "Succeeded"}


def test_a_failed_patch_is_counted_and_the_writer_goes_on() -> None:
    errors: list[int] = []
    calls: list[dict[str, Any]] = []

    def patch(status: dict[str, Any]) -> None:
        calls.append(status)
        if status["n"] == 1:
            raise RuntimeError("the API server said no")

    writer = StatusWriter(patch, on_error=lambda: errors.append(1))
    writer.write({"n": 1})
    assert writer.flush(60)
    writer.write({"n": 2})
    assert writer.flush(60)
    assert calls == [{"n": 1}, {"n": 2}] and errors == [1]


def test_routine_statuses_wait_for_the_interval_and_urgent_ones_do_not() -> None:
    written: list[dict[str, Any]] = []
    writer = StatusWriter(written.append, min_interval_s=600)
    writer.write({"n": 1})
    assert writer.flush(60)
    writer.write({"n": 2})  # counts moved: waits for the interval (ten minutes here)
    writer.write({"n": 3})
    assert not writer.flush(0.5) and written == [{"n": 1}]
    writer.write({"n": 4, "phase": "Suspended"}, urgent=True)  # a phase change goes out at once, newest only
    assert writer.flush(60)
    assert written == [{"n": 1}, {"n": 4, "phase": "Suspended"}]
    writer.write({"n": 5})
    writer.write_now({"phase": "Succeeded"})  # the final status neither waits nor lets the pending one land
    assert writer.flush(60)
    assert written == [{"n": 1}, {"n": 4, "phase": "Suspended"}, {"phase": "Succeeded"}]


def test_a_routine_status_lands_once_the_interval_passed() -> None:
    written: list[dict[str, Any]] = []
    now = [0.0]  # the writer's clock: the interval passes only when the test says so
    writer = StatusWriter(written.append, min_interval_s=0.05, clock=lambda: now[0])
    writer.write({"n": 1})
    assert writer.flush(60)
    for n in range(2, 6):
        writer.write({"n": n})
    assert not writer.flush(0.3) and written == [{"n": 1}]  # its timer fired and found the interval not over
    now[0] = 1.0
    assert writer.flush(60)
    assert written == [{"n": 1}, {"n": 5}]
