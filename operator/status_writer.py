"""A run's status patches, off the reconcile path.

A status PATCH is one round trip to the API server; on a busy control plane it was a quarter of a reconcile
pass's wall time (py-spy on bench/operator_scale.py), and every pass waited for it before the next one could
settle ended pods and fill their slots. Only the newest status matters, so the writer keeps at most one patch
in flight per run and coalesces the ones that come meanwhile (latest wins). A terminal status is written in
order and waited for: nothing written earlier can land after it.

Routine statuses (rollout counts move on every pass) are patched at most once per ``min_interval_s``: each
patch is also a watch event that kopf processes for the run (a diff-base deep copy of the whole object), and at
concurrency 200 the operator ran ~7 passes a second, so one patch per pass was 7% of its CPU and 0.3 API
requests per rollout (py-spy, bench/operator_scale.py). A status whose phase or reason changed is ``urgent``:
it goes out at once, as does the final one.

A patch that fails is logged and counted; it is not retried here, because the next pass compares its status
with the one the watch shows and patches again while they differ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harnessrl.operator.thread_pools import shared_pool

log = logging.getLogger(__name__)

# Patches in flight at once, for all runs of the operator together.
STATUS_WORKERS = 4


def _status_pool() -> ThreadPoolExecutor:
    return shared_pool("status", STATUS_WORKERS)


class StatusWriter:
    """Writes one run's status with ``patch``; ``on_error`` is called (in the writing thread) on a failure."""

    def __init__(
        self,
        patch: Callable[[dict[str, Any]], None],
        on_error: Callable[[], None] = lambda: None,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._patch = patch
        self._on_error = on_error
        self._interval = min_interval_s
        self._clock = clock
        self._lock = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._urgent = False  # the pending status may not wait for the interval
        self._busy = False  # a job of this run is in the pool, or its timer is set
        self._timer: threading.Timer | None = None  # a drain waiting for the interval to pass
        self._last = float("-inf")  # when the last patch was sent

    def write(self, status: dict[str, Any], urgent: bool = False) -> None:
        """Patch ``status`` soon (``urgent``: without waiting for the interval); returns at once. Replaces a
        status given earlier and not written yet."""
        with self._lock:
            self._pending = status
            self._urgent = self._urgent or urgent
            if self._busy:
                if urgent and self._timer is not None:  # cut the wait short
                    self._timer.cancel()
                    self._timer = None
                    _status_pool().submit(self._drain)
                return
            self._busy = True
        _status_pool().submit(self._drain)

    def write_now(self, status: dict[str, Any]) -> None:
        """Patch ``status`` after any patch in flight, dropping the pending one, and return once written (errors
        raise): for a final status, which must be the last one the run gets."""
        with self._lock:
            self._pending = None
            if self._timer is not None:  # nothing is in flight, only a wait for the interval
                self._timer.cancel()
                self._timer = None
                self._busy = False
            while self._busy:
                self._lock.wait()
            self._busy = True
        try:
            self._patch(status)
        finally:
            with self._lock:
                self._last = self._clock()
                self._busy = False
                self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; False if ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy and self._pending is None, timeout)

    def _drain(self) -> None:
        while True:
            with self._lock:
                status = self._pending
                if status is None:
                    self._busy = False
                    self._lock.notify_all()
                    return
                wait = self._last + self._interval - self._clock()
                if wait > 0 and not self._urgent:
                    timer = threading.Timer(wait, self._fire)
                    timer.daemon = True
                    self._timer = timer
                    timer.start()
                    return
                self._pending, self._urgent = None, False
            try:
                self._patch(status)
            except Exception:  # noqa: BLE001 - the next pass patches again (see the module docstring)
                log.warning("patching a TrainingRun's status failed; the next pass writes it again", exc_info=True)
                self._on_error()
            with self._lock:
                self._last = self._clock()

    def _fire(self) -> None:
        with self._lock:
            if self._timer is None or self._timer is not threading.current_thread():
                return  # cancelled: an urgent or final write took over
            self._timer = None
        _status_pool().submit(self._drain)
