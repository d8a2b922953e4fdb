"""Pause/drain for weight syncs: new calls wait or are refused while in-flight calls finish.

The learner (or the operator) pauses the proxy, waits for the drain report, reloads the weights, sets the
new policy version and resumes. ``reject`` answers new calls 503 with ``Retry-After`` (the OpenAI SDKs retry
that on their own); ``wait`` holds them until resume. The gate is the one place that knows about it, so
driving it from a shared source later (the store, vLLM's own pause state) means calling ``pause``/``resume``
from a watcher instead of the admin route.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

PauseMode = Literal["reject", "wait"]


class PausedError(Exception):
    """A new call arrived while paused in reject mode."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("paused for a weight sync")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class DrainReport:
    paused: bool
    mode: PauseMode
    in_flight_at_pause: int
    in_flight: int  # still running when the drain wait ended
    drained: bool
    waited_s: float

    def as_json(self) -> dict:
        return {
            "paused": self.paused,
            "mode": self.mode,
            "in_flight_at_pause": self.in_flight_at_pause,
            "in_flight": self.in_flight,
            "drained": self.drained,
            "waited_s": round(self.waited_s, 4),
        }


class PauseGate:
    """Admission of LLM calls (event-loop thread only)."""

    def __init__(self, default_mode: PauseMode = "reject", retry_after_s: int = 1) -> None:
        self.default_mode = default_mode
        self.retry_after_s = retry_after_s
        self.paused = False
        self.mode: PauseMode = default_mode
        self.in_flight = 0
        self.waiting = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        while self.paused:
            if self.mode == "reject":
                raise PausedError(self.retry_after_s)
            self.waiting += 1
            try:
                await self._resumed.wait()
            finally:
                self.waiting -= 1
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def pause(self, mode: PauseMode | None = None, timeout_s: float = 30.0) -> DrainReport:
        self.mode = mode or self.default_mode
        self.paused = True
        # Wake callers waiting under an earlier pause so they re-check the (possibly new) mode.
        old, self._resumed = self._resumed, asyncio.Event()
        old.set()
        at_pause = self.in_flight
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return DrainReport(
            self.paused, self.mode, at_pause, self.in_flight, self.in_flight == 0, time.monotonic() - start
        )

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    def state(self) -> dict:
        return {
            "paused": self.paused,
            "mode": self.mode,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
        }
