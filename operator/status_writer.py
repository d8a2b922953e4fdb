"""A run's status patches, off the reconcile path.

A status PATCH is one round trip to the API server; on a busy control plane it was a quarter of a reconcile
pass's wall time (py-spy on bench/operator_scale.py), and every pass waited for it before the next one could
settle ended pods and fill their slots. Only the newest status matters, so the writer keeps at most one patch
in flight per run and coalesces the ones that come meanwhile (latest wins). A terminal status is written in
order and waited for: nothing written earlier can land after it.

A patch that fails is logged and counted; it is not retried here, because the next pass compares its status
with the one the watch shows and patches again while they differ.
"""

from __future__ import annotations

import logging
import threading
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

    def __init__(self, patch: Callable[[dict[str, Any]], None], on_error: Callable[[], None] = lambda: None) -> None:
        self._patch = patch
        self._on_error = on_error
        self._lock = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._busy = False  # a job of this run is in the pool

    def write(self, status: dict[str, Any]) -> None:
        """Patch ``status`` soon; returns at once. Replaces a status given earlier and not written yet."""
        with self._lock:
            self._pending = status
            if self._busy:
                return
            self._busy = True
        _status_pool().submit(self._drain)

    def write_now(self, status: dict[str, Any]) -> None:
        """Patch ``status`` after any patch in flight, dropping the pending one, and return once written (errors
        raise): for a final status, which must be the last one the run gets."""
        with self._lock:
            self._pending = None
            while self._busy:
                self._lock.wait()
            self._busy = True
        try:
            self._patch(status)
        finally:
            with self._lock:
                self._busy = False
                self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; False if ``timeout`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy and self._pending is None, timeout)

    def _drain(self) -> None:
        while True:
            with self._lock:
                status, self._pending = self._pending, None
                if status is None:
                    self._busy = False
                    self._lock.notify_all()
                    return
            try:
                self._patch(status)
            except Exception:  # noqa: BLE001 - the next pass patches again (see the module docstring)
                log.warning("patching a TrainingRun's status failed; the next pass writes it again", exc_info=True)
                self._on_error()
