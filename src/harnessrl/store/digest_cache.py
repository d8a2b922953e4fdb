"""Message prefix digests computed incrementally across the calls of one conversation.

``delta.prefix_digests`` serialises and hashes every message of a call; in an agent loop each call resends
the whole history, so a trajectory of n calls costs O(n^2) JSON text and hashing (332 µs per call at 51
messages, measured in the proxy). ``PrefixDigestCache`` keeps, per conversation, a private copy of the
previous call's items with the hash state after them, and serialises and hashes only the items after the
longest prefix that is verified equal to that copy.

Why the result is always exactly ``delta.prefix_digests(items)``:

* the comparison is ``_same``: exact types (dict, list, str, int, float, bool, None; str keys), dict keys in
  the same order, floats with the same sign; for such values equal under ``_same`` ``json.dumps`` writes
  the same text, so the hash state after the shared prefix is the one a full pass would reach. Plain ``==``
  is not enough (``1 == 1.0 == True``, key order, ``0.0 == -0.0``), so those never match;
* the cache compares against its own deep copy (``_snapshot``), made when the items were hashed, never
  handed out: a caller that mutates its messages afterwards cannot make a stale state match;
* anything else (tuples, subclasses, non-str keys, NaN) is never matched or kept: it is hashed in full.

Comparing objects costs much less than serialising and hashing them (``bench/prefix_digests.py``). Memory
is bounded by a count of entries and by the JSON bytes of the items held (least recently used go first);
one lock guards the table, the hashing runs outside it, entries are never changed once made.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from harnessrl.store import delta

MAX_ENTRIES = 4096  # conversations held; a miss costs only a full pass
MAX_BYTES = 128 * 2**20  # JSON bytes of the items held (their Python objects take a few times more)
PER_KEY = 4  # conversations of one key side by side (an agent and its sub-agents in one attempt)


class _Uncacheable(Exception):
    pass


def _snapshot(value: Any) -> Any:
    """A private deep copy of a value made only of exact JSON types; ``_Uncacheable`` for anything else."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return value
    if t is float:
        if math.isnan(value):
            raise _Uncacheable
        return value
    if t is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _Uncacheable
            out[k] = _snapshot(v)
        return out
    if t is list:
        return [_snapshot(v) for v in value]
    raise _Uncacheable


def _same(kept: Any, value: Any) -> bool:
    """Whether ``value`` serialises to the same JSON text as ``kept`` (a ``_snapshot``). String values of a
    dict, most of a message, are compared inline: the call per node is most of this walk's cost."""
    t = type(kept)
    if t is not type(value):
        return False
    if t is dict:
        if len(kept) != len(value):
            return False
        for (k1, v1), (k2, v2) in zip(kept.items(), value.items()):
            if k1 != k2 or type(k2) is not str:
                return False
            if type(v1) is str:
                if type(v2) is not str or v1 != v2:
                    return False
            elif not _same(v1, v2):
                return False
        return True
    if t is str or t is int or t is bool or kept is None:
        return kept == value
    if t is float:
        return kept == value and math.copysign(1.0, kept) == math.copysign(1.0, value)
    # a snapshot holds lists otherwise
    if len(kept) != len(value):
        return False
    for v1, v2 in zip(kept, value):
        if not _same(v1, v2):
            return False
    return True


@dataclass(frozen=True)
class _Entry:
    items: list[Any]  # snapshots
    digests: list[bytes]  # delta.prefix_digests(items)
    states: list[Any]  # states[n]: the hash state after items[:n], so a call that edits item n resumes there
    sizes: list[int]  # sizes[n]: what the bounds count for items[:n] (JSON bytes, and STATE_BYTES per state)

    @property
    def nbytes(self) -> int:
        return self.sizes[-1]


STATE_BYTES = 512  # a blake2b object as Python holds it (448 bytes measured)


class PrefixDigestCache:
    """``digests(key, items)`` == ``delta.prefix_digests(items)``, reusing the work done for the key's
    previous calls. ``key`` names a conversation's owner (the proxy uses run, rollout and attempt)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, per_key: int = PER_KEY):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.per_key = per_key
        self._lock = threading.Lock()
        self._table: OrderedDict[Hashable, list[_Entry]] = OrderedDict()  # least recently used first
        self._entries = 0
        self._bytes = 0
        self.hashed_items = 0  # items serialised and hashed since creation (shows what the cache saves)

    @property
    def held_entries(self) -> int:
        return self._entries

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def forget(self, key: Hashable) -> None:
        """Drop the key's conversations (the proxy: its rollout attempt finished)."""
        with self._lock:
            self._drop(self._table.pop(key, []))

    def digests(self, key: Hashable, items: list[Any]) -> list[bytes]:
        with self._lock:
            candidates = self._table.get(key, [])
        best, shared = None, 0
        for entry in candidates:  # newest first; the first one the items extend is the conversation
            n = _shared_prefix(entry.items, items)
            if best is None or n > shared:
                best, shared = entry, n
            if n == len(entry.items) or n == len(items):
                break
        if best is not None and shared == len(items):  # held already (a call sent again, or cut short)
            self._keep(key, best, best)
            return best.digests[: shared + 1]
        if best is None:
            h = hashlib.blake2b(b"L", digest_size=delta.DIGEST_SIZE)
            kept: list[Any] = []
            digests = [h.copy().digest()]
            states = [h.copy()]
            sizes = [STATE_BYTES]
        else:
            kept = best.items[:shared]
            digests = best.digests[: shared + 1]
            states = best.states[: shared + 1]
            sizes = best.sizes[: shared + 1]
            h = states[shared].copy()
        cacheable = True
        for item in items[shared:]:
            text = delta._item_text(item)
            h.update(text)
            h.update(b"\x1e")
            digests.append(h.copy().digest())
            states.append(h.copy())
            sizes.append(sizes[-1] + len(text) + STATE_BYTES)
            if cacheable:
                try:
                    kept.append(_snapshot(item))
                except (_Uncacheable, RecursionError):
                    cacheable = False
        self.hashed_items += len(items) - shared
        if cacheable:
            # the new list supersedes the one it continues (all of it, or all but its last item: a reply the
            # harness resends rewritten never comes back as it was)
            superseded = best if best is not None and shared >= len(best.items) - 1 else None
            self._keep(key, _Entry(kept, digests, states, sizes), superseded)
        return list(digests)

    def _keep(self, key: Hashable, entry: _Entry, superseded: _Entry | None) -> None:
        """Make ``entry`` the key's newest (replacing ``superseded``, which may be ``entry`` itself)."""
        with self._lock:
            old = self._table.pop(key, [])
            entries = [entry] + [e for e in old if e is not superseded and e is not entry]
            self._drop([e for e in old if e is superseded or e is entry] + entries[self.per_key :])
            self._table[key] = entries[: self.per_key]
            self._entries += 1
            self._bytes += entry.nbytes
            while self._table and (self._entries > self.max_entries or self._bytes > self.max_bytes):
                _, oldest = self._table.popitem(last=False)
                self._drop(oldest)

    def _drop(self, entries: list[_Entry]) -> None:
        self._entries -= len(entries)
        self._bytes -= sum(e.nbytes for e in entries)


def _shared_prefix(kept: list[Any], items: list[Any]) -> int:
    n = 0
    for a, b in zip(kept, items):
        if not _same(a, b):
            break
        n += 1
    return n
