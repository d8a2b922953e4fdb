"""Writing a batch of calls: validate, skip stored call_ids, encode against predecessors, insert once.

The whole batch is one transaction and one insert: on SQLite a multi-row ``INSERT ... ON CONFLICT (call_id)
DO NOTHING`` (SQLAlchemy's insertmanyvalues pages it), on PostgreSQL a COPY with the same semantics (see
``call_copy``), so a replayed or concurrently written call_id is skipped without touching the stored row.

A predecessor is taken from the same batch or from its stored row's digests, never from memory alone, so a
delta always references a row that exists. The one lookup that finds stored predecessors (one statement on
PostgreSQL) also finds the batch's call_ids stored already and stored calls holding a batch call's (rollout,
attempt, seq): a proxy that restarted numbers from 0 again, and its calls are placed after the stored ones
(``_renumber_restarted``); two calls of the batch at one place are separated the same way
(``_renumber_twins``), since the table holds one call per (rollout, attempt, seq). JSON columns are written as the text ``encode`` produced when it checked them
(serialised once).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Container, Iterable, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    Row,
    String,
    Text,
    and_,
    any_,
    bindparam,
    func,
    select,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.sql import ClauseElement

from harnessrl.store import delta
from harnessrl.store.call_copy import JSON_COLUMNS, copy_insert
from harnessrl.store.call_rows import InvalidCall, PreparedCall, prepare_call
from harnessrl.store.delta import Anchor
from harnessrl.store.records import CallRecord
from harnessrl.store.schema import LlmCall
from harnessrl.store.statements import DialectInsert, chunks, ensure_attempts

ANCHOR_COLUMNS = (
    LlmCall.call_id, LlmCall.rollout_id, LlmCall.attempt, LlmCall.seq,
    LlmCall.context_len, LlmCall.context_digest, LlmCall.input_len, LlmCall.input_digest,
    LlmCall.io_len, LlmCall.io_digest,
)  # fmt: skip
Key = tuple[str, int, int]  # (rollout_id, attempt, seq)
log = logging.getLogger(__name__)


def prepare_batch(calls: Sequence[CallRecord | PreparedCall]) -> dict[str, PreparedCall]:
    """Validate every call not prepared yet (``InvalidCall`` names all bad ones); the first of a repeated
    call_id wins."""
    problems: dict[str, str] = {}
    prepared: dict[str, PreparedCall] = {}
    for index, call in enumerate(calls):
        record = call.record if isinstance(call, PreparedCall) else call
        name = record.call_id if isinstance(record.call_id, str) and record.call_id else f"#{index}"
        if name in prepared:
            continue
        try:
            prepared[name] = call if isinstance(call, PreparedCall) else prepare_call(call)
        except ValueError as exc:
            problems[name] = str(exc)
    if problems:
        raise InvalidCall(problems)
    return prepared


def write_calls(
    conn: Connection,
    insert: DialectInsert,
    prepared: dict[str, PreparedCall],
    known_attempts: Container[tuple[str, int]] = (),
    *,
    conflict_safe: bool = False,
) -> int:
    """Insert the calls not stored yet, inside the caller's transaction; returns how many were inserted.

    ``known_attempts``: (rollout_id, attempt) pairs whose rows are known to exist (committed earlier), so
    their run, rollout and attempt rows are not ensured again. On PostgreSQL, raises ``CopyConflict`` when
    another writer stored one of the calls meanwhile, unless ``conflict_safe`` (see ``call_copy``).
    """
    # One lookup finds the call_ids stored already, the stored predecessors, and any stored call already
    # holding a batch call's place (keys of calls that turn out stored are asked for too: harmless, and it
    # saves a round trip).
    keys = {k for p in prepared.values() for k in (p.key, p.predecessor_key) if k is not None}
    existing, stored = _lookup(conn, list(prepared), keys)
    new = [p for call_id, p in sorted(prepared.items()) if call_id not in existing]  # sorted: one lock order
    if not new:
        return 0
    _renumber_twins(conn, new, stored)
    if any(p.key in stored for p in new):
        _renumber_restarted(conn, new, stored)
        _renumber_twins(conn, new, stored)  # a restarted numbering moved onto a place the batch holds
    in_batch: dict[Key, PreparedCall] = {}
    for p in new:
        in_batch.setdefault(p.key, p)
    anchors = _parents(conn, new, in_batch, stored)
    rows: list[tuple[PreparedCall, dict[str, Any]]] = []
    problems: dict[str, str] = {}
    for p in new:
        try:
            rows.append((p, p.encode(anchors.get(p.record.call_id))))
        except ValueError as exc:
            problems[p.record.call_id] = str(exc)
    if problems:
        raise InvalidCall(problems)
    _ensure_attempts(conn, insert, new, known_attempts)
    if conn.dialect.name == "postgresql":
        inserted = copy_insert(conn, rows, conflict_safe=conflict_safe)
    else:
        inserted = set(conn.scalars(_insert_with_json_text(insert), [_with_json_text(p, r) for p, r in rows]))
    _unlink_from_skipped(conn, new, inserted)
    return len(inserted)


def _parents(
    conn: Connection, new: list[PreparedCall], in_batch: dict[Key, PreparedCall], stored: dict[Key, Anchor]
) -> dict[str, Anchor]:
    """Each call's anchor: its predecessor (seq - 1) when that one's tokens begin its prompt; otherwise, of the
    ``PARENT_SEARCH`` calls before it (in the batch or stored; one more lookup, only for such calls), the one
    whose prompt + completion is the longest token prefix of its prompt (the nearest on a tie), else the
    predecessor still (its request input may be reused)."""

    def anchor_at(key: Key) -> Anchor | None:
        return in_batch[key].anchor if key in in_batch else stored.get(key)

    chosen: dict[str, Anchor] = {}
    searching: list[PreparedCall] = []
    for p in new:
        key = p.predecessor_key
        anchor = None if key is None else anchor_at(key)
        if anchor is not None:
            chosen[p.record.call_id] = anchor
        if key is not None and (anchor is None or not p.extends(anchor)):
            searching.append(p)
    if not searching:
        return chosen
    longest: dict[Key, int] = {}  # per earlier call, the longest prompt (in tokens) it might begin
    for p in searching:
        tokens = len(p.prompt_bytes) // 4
        for k in _earlier_keys(p):
            if k not in in_batch and k not in stored and longest.get(k, -1) < tokens:
                longest[k] = tokens
    stored.update(_stored_anchors(conn, set(longest), longest))
    for p in searching:
        best, best_len = None, 0
        for key in _earlier_keys(p):
            anchor = anchor_at(key)
            n = 0 if anchor is None else p.extends(anchor)
            if n > best_len:
                best, best_len = anchor, n
        if best is not None:
            chosen[p.record.call_id] = best
    return chosen


def _earlier_keys(p: PreparedCall) -> list[Key]:
    """The places of the calls a call may extend, nearest first."""
    r = p.record
    return [(r.rollout_id, r.attempt, seq) for seq in range(r.seq - 1, max(r.seq - 1 - delta.PARENT_SEARCH, -1), -1)]


def _renumber_restarted(conn: Connection, new: list[PreparedCall], stored: dict[Key, Anchor]) -> None:
    """Place calls whose (rollout, attempt, seq) another stored call holds after the attempt's last call.

    That happens when a proxy restarts in the middle of a rollout (a sidecar container restarted, a gateway
    replaced): its numbering starts at 0 again. The calls of such an attempt, from the first that clashes,
    are renumbered in order after the highest stored seq, so the trajectory stays in the order it was made
    and each call's predecessor is the call made just before it. Stateless: every later call of the
    restarted numbering clashes too (the stored seqs stay contiguous), so it lands after its predecessor.
    """
    by_attempt: dict[tuple[str, int], list[PreparedCall]] = {}
    for p in new:
        by_attempt.setdefault((p.record.rollout_id, p.record.attempt), []).append(p)
    clashing = sorted({(p.record.rollout_id, p.record.attempt) for p in new if p.key in stored})
    tops = _top_seqs(conn, clashing)
    for key in clashing:
        calls = sorted(by_attempt[key], key=lambda p: p.record.seq)
        first = next(i for i, p in enumerate(calls) if p.key in stored)
        log.warning(
            "rollout %s attempt %d: calls numbered from seq %d again (a restarted proxy?); "
            "stored after seq %d, in the order they were made",
            key[0], key[1], calls[first].record.seq, tops[key],
        )  # fmt: skip
        for offset, p in enumerate(calls[first:], start=1):
            p.record = replace(p.record, seq=tops[key] + offset)
    wanted = {k for p in new if (k := p.predecessor_key) is not None and k not in stored}
    stored.update(_stored_anchors(conn, wanted))


def _renumber_twins(conn: Connection, new: list[PreparedCall], stored: dict[Key, Anchor]) -> None:
    """Place calls that share a (rollout, attempt, seq) with another call of the batch after the attempt's last.

    Two numberings of one attempt in one batch (a proxy that forgot an attempt's counter, two writers' spools
    replayed together): the unique constraint allows one call per place, so the first made (``created_at``,
    then ``call_id``) keeps it and the others follow the attempt's highest seq, stored or in the batch, in the
    order they were made; nothing is dropped.
    """
    first: dict[Key, PreparedCall] = {}
    twins: list[PreparedCall] = []
    for p in sorted(new, key=lambda p: (p.record.created_at, p.record.call_id)):
        if p.key in first:
            twins.append(p)
        else:
            first[p.key] = p
    if not twins:
        return
    attempts = {(p.record.rollout_id, p.record.attempt) for p in twins}
    tops = _top_seqs(conn, sorted(attempts))
    for p in new:
        key = (p.record.rollout_id, p.record.attempt)
        if key in attempts:
            tops[key] = max(tops.get(key, -1), p.record.seq)
    for p in twins:
        key = (p.record.rollout_id, p.record.attempt)
        tops[key] += 1
        log.warning(
            "rollout %s attempt %d: calls %s and %s share seq %d in one batch; %s stored at seq %d",
            key[0], key[1], first[p.key].record.call_id, p.record.call_id, p.record.seq, p.record.call_id,
            tops[key],
        )  # fmt: skip
        p.record = replace(p.record, seq=tops[key])
    wanted = {k for p in new if (k := p.predecessor_key) is not None and k not in stored}
    stored.update(_stored_anchors(conn, wanted))


def _top_seqs(conn: Connection, attempts: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """The highest stored seq of each of ``attempts`` that has a stored call."""
    tops: dict[tuple[str, int], int] = {}
    for chunk in chunks(attempts):
        query = (
            select(LlmCall.rollout_id, LlmCall.attempt, func.max(LlmCall.seq))
            .where(tuple_(LlmCall.rollout_id, LlmCall.attempt).in_(list(chunk)))
            .group_by(LlmCall.rollout_id, LlmCall.attempt)
        )
        tops.update(((rollout_id, attempt), top) for rollout_id, attempt, top in conn.execute(query))
    return tops


def _insert_with_json_text(insert: DialectInsert) -> Any:
    """The plain insert, but the JSON columns bound as the text ``encode`` produced (not serialised again)."""
    texts = {name: bindparam(f"{name}__text", type_=Text()) for name in JSON_COLUMNS}
    # The target is call_id only: a call at a place another call holds is an error to see, never a skip.
    return (
        insert(LlmCall)
        .values(texts)
        .on_conflict_do_nothing(index_elements=[LlmCall.call_id])
        .returning(LlmCall.call_id)
    )


def _with_json_text(p: PreparedCall, row: dict[str, Any]) -> dict[str, Any]:
    params = {k: v for k, v in row.items() if k not in JSON_COLUMNS}
    params.update((f"{name}__text", text) for name, text in p.json_texts().items())
    return params


# PostgreSQL statements, built once: building these constructs cost more than running them (~0.6 ms a
# batch). The keys go as three array parameters, unnested into rows and joined on the (rollout, attempt, seq)
# index; an IN list of row values cost psycopg milliseconds per query to parse for a full batch. They are
# compiled to SQL once and run by psycopg itself in binary (``_pg_rows``).
def _unnested_keys(*extra: str) -> Any:
    """The keys' array parameters (``rollouts``, ``attempts``, ``seqs``, ``extra`` integer ones) as rows."""
    arrays = [bindparam(name, type_=ARRAY(Integer)) for name in ("attempts", "seqs", *extra)]
    return (
        func.unnest(bindparam("rollouts", type_=ARRAY(String)), *arrays)
        .table_valued("rollout_id", "attempt", "seq", *extra)
        .render_derived()
    )


def _at(keys: Any, *conditions: Any) -> Any:
    """Rows of ``llm_calls`` at the unnested ``keys`` (the (rollout, attempt, seq) index)."""
    return and_(
        LlmCall.rollout_id == keys.c.rollout_id,
        LlmCall.attempt == keys.c.attempt,
        LlmCall.seq == keys.c.seq,
        *conditions,
    )


_WANTED = _unnested_keys()
_AT_KEYS = select(*ANCHOR_COLUMNS, true().label("by_key")).join_from(LlmCall, _WANTED, _at(_WANTED))
_BY_IDS = select(*ANCHOR_COLUMNS, ~true().label("by_key")).where(
    LlmCall.call_id == any_(bindparam("ids", type_=ARRAY(String)))
)
_PG_LOOKUP = union_all(_AT_KEYS, _BY_IDS)
# The parent search's lookup: the rows short enough to begin the prompt searching them (a fourth array, the
# longest such prompt per key), so a call that extends none of them costs no row at all: when a harness
# resends the same prompt, or compacts its history, all of them are longer than its prompt.
_SEARCHED = _unnested_keys("longest")
_EXTENDABLE = select(*ANCHOR_COLUMNS).join_from(
    LlmCall, _SEARCHED, _at(_SEARCHED, LlmCall.context_len <= _SEARCHED.c.longest)
)


def _pg_sql(statement: ClauseElement) -> str:
    """The statement as psycopg's SQL, compiled once, every parameter in binary (``%(name)b``: with the
    ``%(name)s`` SQLAlchemy writes, psycopg sends a list of strings as text)."""
    return re.sub(r"%\((\w+)\)s", r"%(\1)b", str(statement.compile(dialect=PGDialect_psycopg())))


_PG_LOOKUP_SQL, _AT_KEYS_SQL, _EXTENDABLE_SQL = map(_pg_sql, (_PG_LOOKUP, _AT_KEYS, _EXTENDABLE))


def _pg_rows(conn: Connection, sql: str, params: dict[str, list[Any]]) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run by psycopg on the transaction's connection, parameters and results in binary.

    Through SQLAlchemy, in psycopg's text format, every element of the arrays (a batch's 256 call_ids and
    its keys) was quoted and escaped to be parsed back by the server, each digest came back as hex, and each
    row went through SQLAlchemy's result machinery: 3.1 ms of CPU for a 256-call batch's lookup, 1.3 here.
    """
    with conn.connection.driver_connection.cursor(binary=True) as cursor:
        return cursor.execute(sql, params).fetchall()


def _lookup(conn: Connection, call_ids: list[str], keys: set[Key]) -> tuple[set[str], dict[Key, Anchor]]:
    """(the call_ids stored already, the stored rows at ``keys`` as anchors); one query on PostgreSQL."""
    if conn.dialect.name != "postgresql":
        return _sqlite_existing(conn, call_ids), _stored_anchors(conn, keys)
    params = {"ids": call_ids, **_key_arrays(keys)}
    existing: set[str] = set()
    at_keys = []
    for row in _pg_rows(conn, _PG_LOOKUP_SQL, params):
        if row[-1]:  # by_key
            at_keys.append(row)
        else:
            existing.add(row[0])
    return existing, _anchors(at_keys)


def _key_arrays(keys: set[Key]) -> dict[str, list[Any]]:
    """The keys as the three array parameters ``_WANTED`` unnests."""
    rollouts, attempts, seqs = zip(*sorted(keys), strict=True) if keys else ((), (), ())
    return {"rollouts": list(rollouts), "attempts": list(attempts), "seqs": list(seqs)}


def _sqlite_existing(conn: Connection, call_ids: list[str]) -> set[str]:
    found: set[str] = set()
    for chunk in chunks(sorted(call_ids)):
        found.update(conn.scalars(select(LlmCall.call_id).where(LlmCall.call_id.in_(chunk))))
    return found


def _stored_anchors(
    conn: Connection, keys: set[Key], longest: dict[Key, int] | None = None
) -> dict[Key, Anchor]:
    """The stored rows at ``keys`` as anchors; with ``longest``, only the rows whose prompt + completion is at
    most that many tokens for their key (only those can begin such a prompt: ``delta.extends``)."""
    if not keys:
        return {}
    if conn.dialect.name == "postgresql":
        if longest is None:
            return _anchors(_pg_rows(conn, _AT_KEYS_SQL, _key_arrays(keys)))
        params = {**_key_arrays(keys), "longest": [longest[k] for k in sorted(keys)]}  # the arrays' order
        return _anchors(_pg_rows(conn, _EXTENDABLE_SQL, params))
    rows = []
    for chunk in chunks(sorted(keys)):
        query = select(*ANCHOR_COLUMNS).where(
            tuple_(LlmCall.rollout_id, LlmCall.attempt, LlmCall.seq).in_(list(chunk))
        )
        if longest is not None:
            query = query.where(LlmCall.context_len <= max(longest[k] for k in chunk))
        rows.extend(conn.execute(query))
    if longest is not None:
        rows = [r for r in rows if r.context_len <= longest[(r.rollout_id, r.attempt, r.seq)]]
    return _anchors(rows)


def _anchors(rows: Iterable[Row[Any] | tuple[Any, ...]]) -> dict[Key, Anchor]:
    """Anchors by key from rows of ``ANCHOR_COLUMNS`` (in that order); where two stored calls hold one key
    (data from before restarts were renumbered), the lowest call_id, so every writer picks the same."""
    anchors: dict[Key, Anchor] = {}
    for row in sorted(rows, key=lambda r: r[0]):
        call_id, rollout_id, attempt, seq, *digests = row[:10]
        anchors.setdefault((rollout_id, attempt, seq), Anchor(call_id, *digests))
    return anchors


def _ensure_attempts(
    conn: Connection, insert: DialectInsert, calls: list[PreparedCall], known: Container[tuple[str, int]]
) -> None:
    """Missing parent rows; a created attempt starts under its first call's policy version."""
    firsts: dict[tuple[str, int], CallRecord] = {}
    for p in calls:
        r = p.record
        if (r.rollout_id, r.attempt) in known:
            continue
        if (r.rollout_id, r.attempt) not in firsts or r.seq < firsts[(r.rollout_id, r.attempt)].seq:
            firsts[(r.rollout_id, r.attempt)] = r
    ensure_attempts(conn, insert, {key: (r.run, r.policy_version) for key, r in firsts.items()})


def _unlink_from_skipped(conn: Connection, new: list[PreparedCall], inserted: set[str]) -> None:
    """Store in full any inserted call whose in-batch base lost an insert race to another writer.

    The base row that won may hold different content than the one this call was encoded against.
    """
    batch_ids = {p.record.call_id for p in new}
    for p in new:
        base = p.encoded.base_call_id if p.encoded else None
        if p.record.call_id in inserted and base in batch_ids and base not in inserted:
            row = p.encode(None)
            conn.execute(update(LlmCall).where(LlmCall.call_id == p.record.call_id).values(**row))
