"""The spool: an append-only local file of captured items the trace store could not take yet.

Format: JSON lines, one item per line, written only by the writer thread. JSON (not msgpack) because a
spool is what an operator inspects by hand after an outage; floats are written in their shortest
round-tripping form, so log-probs come back bit-exact.

Durability policy: every append (one writer batch) is flushed and ``fsync``-ed before the writer takes its
next batch, so a crash loses at most the batch being written plus whatever is still in the in-memory queue;
SIGTERM drains the queue into the store or the spool before exit. A torn last line from a crash is cut off
when the spool is opened again.

Replay reads from an offset held in memory; when everything has been replayed the file is truncated to
zero. After a crash mid-replay the next process replays from the start, which is harmless: the store skips
call ids it already has, rewards are re-applied in their original order (the last one still wins).

Size: ``max_bytes`` bounds the file. ``append`` takes the entries that fit and leaves the rest to the caller
(the writer keeps them in memory and reports the spool full); the first entry always fits an empty spool, so
one item larger than the bound can never block it forever. An append that fails half-way (disk full) is cut
back to the last whole line, so the file never holds a torn line in the middle.

Items that the store rejects for good (not an outage: bad data, an illegal state transition) go to
``<spool>.rejected`` with the error, so they are kept and visible instead of blocking the spool forever.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .protocol import dumps, loads
from .strict_json import lenient_loads

log = logging.getLogger(__name__)


class SpoolFull(Exception):
    """The spool file reached its byte bound; ``held`` items wait in memory until a replay makes room."""

    def __init__(self, spool: Spool, held: int) -> None:
        super().__init__(
            f"spool {spool.path} is full ({spool.size} of {spool.max_bytes} bytes, the store is away): "
            f"{held} items held in memory and new calls wait; raise the proxy's spool bound "
            "(HARNESSRL_SPOOL_MAX_BYTES) or bring the store back"
        )
        self.held = held


class Spool:
    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut_torn_tail()
        self._append = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the spool
        self._read = open(self.path, "rb")  # noqa: SIM115
        self._offset = 0
        self.size = os.fstat(self._append.fileno()).st_size
        self.pending = self._count_lines()

    def _cut_torn_tail(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            # Walk back to the last complete line and cut the rest.
            block = 1 << 16
            pos = size
            while pos > 0:
                start = max(0, pos - block)
                fh.seek(start)
                chunk = fh.read(pos - start)
                nl = chunk.rfind(b"\n")
                if nl != -1:
                    keep = start + nl + 1
                    break
                pos = start
            else:
                keep = 0
            log.warning("spool %s: cut a torn last line (%d bytes) left by a crash", self.path, size - keep)
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())

    def _count_lines(self) -> int:
        count = 0
        with open(self.path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                count += chunk.count(b"\n")
        return count

    def append(self, entries: list[dict[str, Any]]) -> int:
        """Append as many of ``entries`` as fit below ``max_bytes``, durably; returns how many.

        Raises ``OSError`` (nothing appended, the file cut back) when the write or the fsync fails.
        """
        lines = []
        size = self.size
        for entry in entries:
            line = dumps(entry) + b"\n"
            if self.max_bytes is not None and size + len(line) > self.max_bytes and (lines or self.size):
                break
            lines.append(line)
            size += len(line)
        if not lines:
            return 0
        data = b"".join(lines)
        fd = self._append.fileno()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self.size)
            except OSError:
                log.exception("spool %s: could not cut back a failed append", self.path)
            raise
        self.size = size
        self.pending += len(lines)
        return len(lines)

    def peek(self, max_items: int) -> list[tuple[dict[str, Any] | None, bytes]]:
        """Up to ``max_items`` entries from the replay offset, without consuming them.

        Each is ``(entry, raw_line)``; ``entry`` is ``None`` for a line that is not valid JSON.
        """
        self._read.seek(self._offset)
        out: list[tuple[dict[str, Any] | None, bytes]] = []
        while len(out) < max_items:
            line = self._read.readline()
            if not line or not line.endswith(b"\n"):
                break
            try:
                entry = loads(line)
            except ValueError:
                entry = lenient_loads(line)
            out.append((entry if isinstance(entry, dict) else None, line))
        return out

    def consume(self, lines: list[bytes]) -> None:
        """Mark entries returned by ``peek`` as replayed; truncates the file once nothing is left."""
        self._offset += sum(len(line) for line in lines)
        self.pending -= len(lines)
        if self.pending <= 0:
            self.pending = 0
            self._offset = 0
            self._append.truncate(0)
            os.fsync(self._append.fileno())
            self.size = 0

    def reject(self, entry: dict[str, Any] | None, raw: bytes | None, error: str) -> None:
        """Keep an item the store refuses for good, with the reason, next to the spool."""
        record = (
            {"error": error, "item": entry}
            if entry is not None
            else {"error": error, "raw": (raw or b"").decode("utf-8", "replace")}
        )
        with open(self.path.with_name(self.path.name + ".rejected"), "ab") as fh:
            fh.write(dumps(record) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def close(self) -> None:
        self._append.close()
        self._read.close()
