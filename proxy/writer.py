"""The batched trace writer: the only code that talks to the store, on its own thread.

The response path hands finished calls, rewards and rollout ends to ``TraceWriter.put`` (never blocks, never
touches the database). One writer thread drains the queue in order: consecutive calls become one
``store.add_calls(batch)``; a reward or a finish is applied where it stands in the order, so a
reward never overtakes the calls sent before it.

When the store fails with an outage-type error (connection refused or lost, database not accepting
connections, SQLite locked) the unwritten items go to the spool and, while the spool holds anything, every
new item is appended behind them, so order holds across the outage. The spool is replayed with exponential
backoff until the store answers again. Errors that retrying cannot fix (bad data, illegal transition) send
the one offending item to the spool's ``.rejected`` file and the rest go on.

Memory is bounded by the admission check in the HTTP layer (``has_room``): while the in-memory queue is at
its limit, by count or by estimated bytes (the store is slow but answering), new LLM calls wait before they
start; calls already running always get their record queued. During an outage the queue drains into the
spool, so calls keep flowing, until the spool reaches its byte bound: then the writer holds what it took,
the queue fills and new calls wait, and ``/healthz`` says why.

Whoever needs to know that an item is in the store (the reward route: a harness exits right after it, and
the scheduler must see the reward then) passes ``on_done`` to ``put`` and is told once the item is stored
or refused for good.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, Protocol

from harnessrl.store import codec
from harnessrl.store.call_rows import PreparedCall, prepare_call
from harnessrl.store.digest_cache import PrefixDigestCache
from harnessrl.store.records import CallRecord, CallStatus, RolloutState

from .metrics import ProxyMetrics
from .spool import Spool, SpoolFull
from .strict_json import storable

log = logging.getLogger(__name__)


class TraceSink(Protocol):
    """The part of ``harnessrl.store.TraceStore`` the writer uses."""

    def add_calls(self, calls: Sequence[CallRecord | PreparedCall]) -> int: ...

    def set_reward(
        self, rollout_id: str, attempt: int, value: float, info: dict | None = None, *, run: str | None = None
    ) -> None: ...

    def finish_attempt(
        self,
        rollout_id: str,
        attempt: int,
        state: RolloutState,
        reason: str | None = None,
        *,
        run: str | None = None,
    ) -> None: ...

    def mark_upstream_failed(self, rollout_id: str, attempt: int, *, run: str | None = None) -> None: ...

    def release(self) -> None: ...


# ------------------------------------------------------------------------------------------------ items


@dataclass
class CallItem:
    """One captured call, queued as captured and then prepared for the store (``prepare_call``).

    The proxy queues the record at once (its place in the order is fixed then) and prepares it in an
    event-loop callback that runs after the answer has gone out to the harness, so the packing, stripping
    and digests are not on the harness's wait. Preparing there costs no more CPU than on the writer thread,
    and a call waiting in the queue then holds packed bytes and a few small objects: while queued calls held
    their decoded answers, the cyclic garbage collector rescanned them at every collection (~40% of the
    proxy's CPU at concurrency 64). If the writer takes the item before the callback ran, the store
    prepares it (the swap of ``call`` is one atomic store).
    """

    call: CallRecord | PreparedCall
    size: int = 0  # the request's bytes as received, if known; the token estimate is added (``item_bytes``)
    # The record's prompt and completion ids as the store packs them (``codec.pack_ids``), packed once for the
    # store and the proxy's ledger (``LastCall.of``); None when prepared already or not token ids (the store
    # then says what is wrong with them).
    packed: tuple[bytes, bytes] | None = None
    digests: PrefixDigestCache | None = None  # the proxy's, so a call hashes only its new messages

    def __post_init__(self) -> None:
        record = self.record
        tokens = len(record.prompt_token_ids) + len(record.completion_token_ids)
        self.size += ITEM_OVERHEAD_BYTES + BYTES_PER_TOKEN * tokens
        if self.packed is None and not isinstance(self.call, PreparedCall):
            try:
                self.packed = (codec.pack_ids(record.prompt_token_ids), codec.pack_ids(record.completion_token_ids))
            except (ValueError, TypeError):
                pass

    def prepare(self) -> None:
        call = self.call
        if isinstance(call, PreparedCall):
            return
        try:
            self.call = prepare_call(call, self.packed, self.digests)
        except ValueError:
            pass  # the writer hands it over as it is: the store refuses it with the reason (kept in .rejected)
        self.packed = None  # the prepared call holds the same bytes

    def strict(self) -> CallItem | None:
        """This call with what strict JSON cannot hold written as text (``strict_json.py``), or None when its
        request and response are strict JSON already (the store refused it for another reason)."""
        record = self.record
        strict = replace(record, request=storable(record.request), response=storable(record.response))
        if strict.request is record.request and strict.response is record.response:
            return None
        return CallItem(strict)

    @property
    def record(self) -> CallRecord:
        """The call as captured (rebuilt from its prepared form; for the spool)."""
        return self.call.full_record() if isinstance(self.call, PreparedCall) else self.call


@dataclass
class RewardItem:
    """A reward; with ``run`` the store creates an attempt no call has reached yet instead of refusing it."""

    rollout_id: str
    attempt: int
    value: float
    info: dict[str, Any] | None = None
    run: str | None = None


@dataclass
class FinishItem:
    """A rollout end; ``run`` as for ``RewardItem``."""

    rollout_id: str
    attempt: int
    state: RolloutState
    reason: str | None = None
    run: str | None = None


@dataclass
class UpstreamFailedItem:
    """The LLM upstream failed one of the attempt's calls (unavailable or timed out): the attempt's failure is
    retried without using one of ``harness.maxAttempts`` (``store.attempt_budget``). Queued and spooled like a
    call, so the mark survives a store outage as the call it follows does; ``run`` as for ``RewardItem``."""

    rollout_id: str
    attempt: int
    run: str | None = None


Item = CallItem | RewardItem | FinishItem | UpstreamFailedItem

ITEM_OVERHEAD_BYTES = 512
BYTES_PER_TOKEN = 16  # its id and log-prob as captured, and its share of the answer's text


def item_bytes(item: Item) -> int:
    """What a queued item holds in memory, estimated for the queue's byte bound (``queue_max_bytes``).

    An estimate, not a measurement (measuring nested JSON costs more CPU than the capture): a call counts its
    request as received plus ``BYTES_PER_TOKEN`` per prompt and completion token, so a few huge prompts fill
    the bound as surely as many small calls fill the count bound; a reward or finish counts its overhead.
    """
    if isinstance(item, CallItem):
        return item.size
    return ITEM_OVERHEAD_BYTES

_CALL_FIELDS = [f.name for f in fields(CallRecord)]


def record_to_json(record: CallRecord) -> dict[str, Any]:
    out = {name: getattr(record, name) for name in _CALL_FIELDS}
    out["status"] = record.status.value
    out["created_at"] = record.created_at.isoformat()
    out["logprobs"] = [lp if math.isfinite(lp) else None for lp in record.logprobs]
    return out


def record_from_json(data: Mapping[str, Any]) -> CallRecord:
    values = {name: data[name] for name in _CALL_FIELDS if name in data}
    values["status"] = CallStatus(values["status"])
    values["created_at"] = datetime.fromisoformat(values["created_at"])
    values["logprobs"] = [math.nan if lp is None else lp for lp in values["logprobs"]]
    return CallRecord(**values)


def item_to_json(item: Item) -> dict[str, Any]:
    if isinstance(item, CallItem):
        return {"kind": "call", "record": record_to_json(item.record)}
    if isinstance(item, RewardItem):
        return {
            "kind": "reward",
            "rollout_id": item.rollout_id,
            "attempt": item.attempt,
            "value": item.value,
            "info": item.info,
            "run": item.run,
        }
    if isinstance(item, UpstreamFailedItem):
        return {"kind": "upstream_failed", "rollout_id": item.rollout_id, "attempt": item.attempt, "run": item.run}
    return {
        "kind": "finish",
        "rollout_id": item.rollout_id,
        "attempt": item.attempt,
        "state": item.state.value,
        "reason": item.reason,
        "run": item.run,
    }


def item_from_json(data: Mapping[str, Any]) -> Item:
    kind = data.get("kind")
    if kind == "call":
        return CallItem(record_from_json(data["record"]))
    if kind == "reward":
        return RewardItem(
            data["rollout_id"], int(data["attempt"]), float(data["value"]), data.get("info"), data.get("run")
        )
    if kind == "finish":
        return FinishItem(
            data["rollout_id"],
            int(data["attempt"]),
            RolloutState(data["state"]),
            data.get("reason"),
            data.get("run"),
        )
    if kind == "upstream_failed":
        return UpstreamFailedItem(data["rollout_id"], int(data["attempt"]), data.get("run"))
    raise ValueError(f"unknown spool item kind {kind!r}")


def is_outage(exc: BaseException) -> bool:
    """Whether retrying later can fix a store error (the database is away), as opposed to bad data."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(
        exc,
        (
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
            sa_exc.DisconnectionError,
            sa_exc.TimeoutError,
            ConnectionError,
            TimeoutError,
        ),
    ):
        return True
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a core dependency
        return False
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


class _Outage(Exception):
    """Internal: the store is away; ``index`` is the first item of the group not known to be written."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


# ----------------------------------------------------------------------------------------------- writer


class TraceWriter:
    """Queue + writer thread + spool. ``put`` from any thread; ``flush``/``close`` block (use a thread).

    Nothing the thread meets ends it: an error outside the store's own (the spool or its ``.rejected`` file
    cannot be written, the disk is full, a bug) is logged, shown as ``failure`` (the proxy's ``/healthz``
    answers 503 with it, metric ``writer_failing``), and the items it was handling are kept and retried with
    backoff, so nothing is lost and nothing waits silently. Memory is bounded by count and by bytes
    (``queue_size``, ``queue_max_bytes``), the spool file by bytes (``Spool.max_bytes``): a full spool holds
    the rest in memory, where the queue bound makes new calls wait.
    """

    def __init__(
        self,
        store: TraceSink,
        spool: Spool,
        metrics: ProxyMetrics,
        *,
        batch_size: int = 256,
        queue_size: int = 10_000,
        queue_max_bytes: int | None = None,
        retry_s: float = 0.2,
        retry_max_s: float = 5.0,
        linger_s: float = 0.1,
        release_idle_s: float = 5.0,
    ) -> None:
        self.store = store
        self.spool = spool
        self.metrics = metrics
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.queue_max_bytes = math.inf if queue_max_bytes is None else queue_max_bytes
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        self.linger_s = linger_s
        self.release_idle_s = release_idle_s
        self._holding = True  # the store may hold a connection (start-up checks opened one)
        self._last_use = time.monotonic()
        self._wake = threading.Event()  # set by flush/close (and a waited-for item) to cut a linger short
        # ... and by a queue half full (by count or bytes) or holding a batch, so a long linger never makes new
        # calls wait for room while the writer sleeps.
        self._wake_items = max(1, min(batch_size, queue_size // 2))
        self._wake_bytes = self.queue_max_bytes / 2
        self._queue: queue.SimpleQueue[tuple[int, Item]] = queue.SimpleQueue()
        self._epoch = uuid.uuid4().hex  # tells this process's spool lines from an earlier process's
        self._issued = 0  # tickets handed out by put()
        self._written = 0  # every ticket <= this is in the store (or rejected for good)
        self._queued_bytes = 0  # estimated size of what waits in the queue (see ``item_bytes``)
        self._waiters: dict[int, Callable[[BaseException | None], None]] = {}
        self._held: list[tuple[int, Item]] = []  # taken from the queue, neither stored nor spooled yet
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._stop_deadline = math.inf
        self._next_replay = 0.0
        self._backoff = retry_s
        self._failure_backoff = retry_s
        self.failure: str | None = None  # why the writer cannot make progress now (None: it can)
        self._thread = threading.Thread(target=self._run, name="harnessrl-trace-writer", daemon=True)
        metrics.queue_depth.set_function(lambda: self.queued)
        metrics.queue_bytes.set_function(lambda: self._queued_bytes)
        metrics.spool_pending.set_function(lambda: self.spool.pending)
        metrics.spool_bytes.set_function(lambda: self.spool.size)
        metrics.writer_failing.set_function(lambda: 0 if self.problem() is None else 1)

    # -- producer side -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def depth(self) -> int:
        """Items accepted but not yet in the store (queued, being written, or spooled this run)."""
        return self._issued - self._written

    @property
    def queued(self) -> int:
        """Items in memory waiting for the writer thread (spooled items do not count: they are on disk)."""
        return self._queue.qsize()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def has_room(self) -> bool:
        return self._queue.qsize() < self.queue_size and self._queued_bytes < self.queue_max_bytes

    def problem(self) -> str | None:
        """Why captured items are not reaching the store or the spool now; None while the writer works."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping.is_set():
            return "the trace writer thread has stopped"
        return self.failure

    def put(self, item: Item, on_done: Callable[[BaseException | None], None] | None = None) -> None:
        """Queue ``item`` (never blocks). ``on_done(error)`` is called on the writer thread once the item is
        in the store (``None``) or refused for good (the store's error); not while it waits in the spool."""
        size = item_bytes(item)
        with self._lock:
            self._issued += 1
            ticket = self._issued
            self._queued_bytes += size
            if on_done is not None:
                self._waiters[ticket] = on_done
        self._queue.put((ticket, item))
        if on_done is not None or isinstance(item, UpstreamFailedItem):
            # Someone waits for this one, or a harness is about to exit after its 502 (the scheduler should find
            # the mark when it settles the exit): no lingering for a larger batch.
            self._wake.set()
        elif self._queue.qsize() >= self._wake_items or self._queued_bytes >= self._wake_bytes:
            self._wake.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything put before this call is in the store; False on timeout (still kept)."""
        self._wake.set()
        with self._lock:
            target = self._issued
            return self._progress.wait_for(lambda: self._written >= target, timeout)

    def close(self, timeout: float) -> bool:
        """Stop: write the queue to the store, or to the spool if the store stays away until ``timeout``.

        Returns True when everything reached the store; otherwise the rest is in the spool, replayed by
        the next proxy started on the same spool path (or lost, if even the spool could not take it: logged).
        """
        self._stop_deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        self.spool.close()
        return self.spool.pending == 0 and self.depth == 0

    # -- writer thread -------------------------------------------------------------------------------

    def _mark_written(self, ticket: int | None) -> None:
        if ticket is None:
            return
        with self._lock:
            if ticket > self._written:
                self._written = ticket
                self._progress.notify_all()

    def _done(self, ticket: int | None, error: BaseException | None) -> None:
        """Tell whoever waits for ``ticket`` how it ended (a callback that fails is logged, never fatal)."""
        if ticket is None or not self._waiters:
            return
        with self._lock:
            waiter = self._waiters.pop(ticket, None)
        if waiter is not None:
            try:
                waiter(error)
            except Exception:
                log.exception("a waiter for trace item %d failed", ticket)

    def _take(self, linger: float) -> list[tuple[int, Item]]:
        """Wait ``linger``, then take what is queued (up to a batch).

        The writer does not block on the queue: a blocked reader is woken by every ``put``, and each wake-up
        makes the event loop's thread hand the GIL over (measured: ~0.3 ms per call under load). Lingering
        lets ``put`` stay a plain append and makes batches larger; capture is delayed by at most ``linger``
        (``flush``, ``close``, an item someone waits for and a queue half full cut it short), never the
        response. Why 0.1 s by default: a write costs ~1.3 ms of the proxy's CPU plus ~0.1 ms per call
        (PostgreSQL, bench/proxy_overhead.py's calls), so at 1,000 calls/s batches of 20 ms cost 1.5x the
        CPU per call of batches of 100 ms.
        """
        if self._queue.qsize() < self.batch_size and linger > 0:
            self._wake.wait(linger)
            self._wake.clear()
        batch: list[tuple[int, Item]] = []
        while len(batch) < self.batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if batch:
            size = sum(item_bytes(item) for _, item in batch)
            with self._lock:
                self._queued_bytes -= size
        return batch

    def _run(self) -> None:
        while True:
            stopping = self._stopping.is_set()
            try:
                self._step(stopping)
            except Exception as exc:  # noqa: BLE001 - the guard: whatever it is, keep the items and retry
                self._fail(exc)
                if not (stopping and time.monotonic() >= self._stop_deadline):
                    self._stopping.wait(self._failure_backoff)
                    self._failure_backoff = min(self.retry_max_s, self._failure_backoff * 2)
                    continue
            else:
                if self.failure is not None and not self._held:
                    log.warning("trace writer works again (it failed with: %s)", self.failure)
                    self.failure = None
                    self._failure_backoff = self.retry_s
            if stopping and not self._held and self._queue.empty():
                if self.spool.pending == 0 or time.monotonic() >= self._stop_deadline:
                    if self.spool.pending:
                        log.warning(
                            "trace writer stopping with %d items in the spool %s (the store is "
                            "away); the next proxy on this spool path replays them",
                            self.spool.pending,
                            self.spool.path,
                        )
                    return
                time.sleep(min(self._backoff, max(0.0, self._stop_deadline - time.monotonic())))
            elif stopping and time.monotonic() >= self._stop_deadline and self.failure is not None:
                lost = len(self._held) + self._queue.qsize()
                log.error(
                    "trace writer stopping after its deadline while failing (%s): %d captured items could "
                    "be neither stored nor spooled and are lost",
                    self.failure,
                    lost,
                )
                return

    def _step(self, stopping: bool) -> None:
        """One pass: take a batch (or retry the held one), replay the spool when due, store or spool."""
        if not self._held:
            self._held = self._take(0.0 if stopping else self.linger_s)
        if self.spool.pending and (time.monotonic() >= self._next_replay or stopping):
            self._replay()
        if not self._held:
            if not self.spool.pending:
                self._release_when_idle()
            return
        if self.spool.pending:
            self._to_spool()
        else:
            self._write()

    def _release_when_idle(self) -> None:
        """Give the store's connection back once nothing was written for ``release_idle_s``.

        Why: every harness pod runs a proxy, and a proxy that kept its connection for its whole life would
        hold one server slot per pod, busy or not (tool runs, weight syncs, pods waiting to end), so the
        database's ``max_connections`` would cap the pods of a run; a proxy refused a slot spools and retries,
        and now gets one as soon as an idle proxy lets go. Why not after every batch: opening a PostgreSQL
        connection forks a server process (milliseconds of server CPU), which a busy proxy writing every
        ``linger_s`` would pay ten times a second; after a few idle seconds it is paid at most once per pause.
        """
        if self._holding and time.monotonic() - self._last_use >= self.release_idle_s:
            self._holding = False
            self.store.release()

    def _fail(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if reason != self.failure:
            log.error(
                "trace writer failed (%s); %d items held in memory, retrying", reason, len(self._held),
                exc_info=not isinstance(exc, (OSError, SpoolFull)),
            )
        self.failure = reason
        self.metrics.write_errors.labels(kind="spool_full" if isinstance(exc, SpoolFull) else "writer").inc()

    def _to_spool(self) -> None:
        """Append the held items to the spool, as many as its byte bound allows (``SpoolFull`` for the rest)."""
        entries = []
        for ticket, item in self._held:
            entry = item_to_json(item)
            entry["t"] = ticket
            entry["e"] = self._epoch
            entries.append(entry)
        appended = self.spool.append(entries)
        self.metrics.spooled.inc(appended)
        self._held = self._held[appended:]
        if self._held:
            raise SpoolFull(self.spool, len(self._held))

    def _write(self) -> None:
        for group in _groups(self._held):
            try:
                self._apply([item for _, item in group], [None] * len(group), [t for t, _ in group])
            except _Outage as outage:
                self._enter_outage(outage.cause)
                self._to_spool()
                return
            self._mark_written(group[-1][0])
            self._held = self._held[len(group) :]

    def _enter_outage(self, cause: BaseException) -> None:
        self.metrics.write_errors.labels(kind="outage").inc()
        log.warning(
            "trace store unavailable (%s: %s); spooling to %s",
            type(cause).__name__,
            str(cause).splitlines()[0] if str(cause) else "",
            self.spool.path,
        )
        self._next_replay = time.monotonic() + self._backoff
        self._backoff = min(self.retry_max_s, self._backoff * 2)

    def _replay(self) -> None:
        while self.spool.pending:
            peeked = self.spool.peek(self.batch_size)
            if not peeked:  # count and file disagree: only possible if the file was edited by hand
                self.spool.consume([])
                break
            parsed: list[tuple[Item | None, bytes, int | None]] = []
            for entry, raw in peeked:
                try:
                    if entry is None:
                        raise ValueError("not a JSON object")
                    item: Item | None = item_from_json(entry)
                except (KeyError, TypeError, ValueError) as exc:
                    self.spool.reject(entry, raw, f"unreadable spool line: {exc}")
                    self.metrics.write_errors.labels(kind="rejected").inc()
                    item = None
                ticket = entry.get("t") if entry is not None and entry.get("e") == self._epoch else None
                parsed.append((item, raw, ticket if isinstance(ticket, int) else None))
            for group in _groups(parsed, key=lambda p: p[0]):
                raws = [raw for _, raw, _ in group]
                tickets = [t for _, _, t in group]
                if group[0][0] is not None:
                    try:
                        self._apply([item for item, _, _ in group], raws, tickets)  # type: ignore[misc]
                    except _Outage as outage:
                        self._enter_outage(outage.cause)
                        return
                    self.metrics.replayed.inc(len(group))
                self.spool.consume(raws)
                known = [t for t in tickets if t is not None]
                if known:
                    self._mark_written(max(known))
        self._backoff = self.retry_s
        log.info("trace store answers again: spool %s replayed", self.spool.path)

    def _apply(self, items: list[Item], raws: list[bytes | None], tickets: list[int | None]) -> None:
        """Write one group (consecutive calls, or one other item); raises ``_Outage``."""
        try:
            self._apply_once(items)
        except Exception as exc:  # classified right below
            if is_outage(exc):
                raise _Outage(exc) from exc
            if len(items) == 1:
                if not self._stored_strict(items[0]):
                    self._reject(items[0], raws[0], tickets[0], exc)
                else:
                    self._done(tickets[0], None)
                return
        else:
            for ticket in tickets:
                self._done(ticket, None)
            return
        # A batch failed for a reason other than an outage: find the bad item(s) one by one.
        for item, raw, ticket in zip(items, raws, tickets):
            try:
                self._apply_once([item])
            except Exception as exc:
                if is_outage(exc):
                    raise _Outage(exc) from exc
                if not self._stored_strict(item):
                    self._reject(item, raw, ticket, exc)
                    continue
            self._done(ticket, None)

    def _stored_strict(self, item: Item) -> bool:
        """Store a refused call again with what strict JSON cannot hold as text (``CallItem.strict``): the
        harness got a 200 for it, so it must not be lost. False when that is no fix (or did not store)."""
        strict = item.strict() if isinstance(item, CallItem) else None
        if strict is None:
            return False
        try:
            self._apply_once([strict])
        except Exception as exc:
            if is_outage(exc):
                raise _Outage(exc) from exc
            return False
        self.metrics.write_errors.labels(kind="nonstrict_json").inc()
        return True

    def _apply_once(self, items: list[Item]) -> None:
        self._holding = True
        self._last_use = time.monotonic()
        first = items[0]
        if isinstance(first, CallItem):
            records = [i.call for i in items]  # type: ignore[union-attr]
            self.store.add_calls(records)
            self.metrics.batch_size.observe(len(records))
        elif isinstance(first, RewardItem):
            self.store.set_reward(first.rollout_id, first.attempt, first.value, first.info, run=first.run)
        elif isinstance(first, UpstreamFailedItem):
            self.store.mark_upstream_failed(first.rollout_id, first.attempt, run=first.run)
        else:
            self.store.finish_attempt(
                first.rollout_id, first.attempt, first.state, first.reason, run=first.run
            )

    def _reject(self, item: Item, raw: bytes | None, ticket: int | None, exc: BaseException) -> None:
        """Tell the waiter first (its answer does not depend on the file), then keep the item aside."""
        self._done(ticket, exc)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.error("trace store refused an item for good (%s); kept in %s.rejected", message, self.spool.path)
        self.metrics.write_errors.labels(kind="rejected").inc()
        self.spool.reject(item_to_json(item), raw, message)


def _groups(entries: list[Any], key: Any = lambda e: e[1]) -> list[list[Any]]:
    """Consecutive calls together (one add_calls); every other item or unreadable line alone, in place."""
    groups: list[list[Any]] = []
    for entry in entries:
        if isinstance(key(entry), CallItem) and groups and isinstance(key(groups[-1][-1]), CallItem):
            groups[-1].append(entry)
        else:
            groups.append([entry])
    return groups
