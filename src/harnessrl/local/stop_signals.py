"""Ctrl-C and SIGTERM stop the local run between two scheduler passes, never in the middle of one.

Python's default SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside a
store write that can leave the runner's own SQLite connection holding the write lock (between ``BEGIN
IMMEDIATE`` and SQLAlchemy's bookkeeping), so the shutdown that follows (cancel the active attempts, print the
report) waited out the busy timeout on a lock its own process held and failed with "database is locked".
Here a signal only records that a stop was asked for; the loop checks at a safe point. While the stop runs the
previous handlers are back, so pressing Ctrl-C again interrupts a slow shutdown at once (the children still
get SIGTERM from the kernel, see ``orphans.py``, and nothing stored is lost).
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType
from typing import Any, Self

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager: while entered, SIGINT and SIGTERM set ``received`` instead of acting at once.

    Enter it from the main thread (the only thread Python lets install signal handlers).
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Self:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal (130 for SIGINT, 143 for SIGTERM); 0 if none."""
        return 128 + int(self.received) if self.received is not None else 0
