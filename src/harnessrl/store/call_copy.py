"""PostgreSQL fast path for inserting ``llm_calls`` rows: COPY instead of one huge ``INSERT ... VALUES``.

A multi-row ``INSERT ... VALUES`` of a 256-call batch is a statement of ~8,000 parameters that psycopg parses
anew for every batch (its statement cache skips long queries): that Python work ran on the proxy's writer
thread and took the GIL from the request path. COPY streams the rows with no statement to parse.

The writer has just checked which call_ids are stored, so the rows are copied straight into ``llm_calls``.
Only when another writer stored one of them in between does the COPY fail (a unique violation, raised as
``CopyConflict``; the transaction is lost), and the caller writes the batch again with ``conflict_safe``: the
rows are copied into a temp table and moved with ``INSERT ... SELECT ... ORDER BY call_id ON CONFLICT
(call_id) DO NOTHING RETURNING call_id``, the plain insert's exact semantics (idempotent on call_id, one lock
order). A savepoint around the direct COPY would spare that retry, but cost two round trips on every batch
for a race between writers of the same call (two proxies replaying one spool) that almost never happens.
The temp table lives for the session, is emptied at every commit and is named after the column list, so a
connection that outlives a schema change gets a fresh one. JSON columns are sent as the text the call's
encoding already produced, so nothing is serialised twice.

COPY runs in PostgreSQL's binary format: token arrays, log-probs and digests go over as they are, where the
text format escapes every byte of a ``bytea`` into hex for the server to parse back (measured: binary COPY of
the proxy's benchmark rows is 1.5-2.2x the text format's rate). Binary COPY needs each column's type: they
are read from the catalog once per connection, so the types always follow the migrated table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from psycopg.errors import UniqueViolation
from psycopg.types.json import set_json_dumps
from sqlalchemy import Connection, LargeBinary

from harnessrl.store.call_rows import PreparedCall
from harnessrl.store.schema import LlmCall

JSON_COLUMNS = ("request", "response", "response_stripped", "sampling")
_COLUMNS = [c.name for c in LlmCall.__table__.columns]
_TEMP = "harnessrl_llm_calls_in_" + hashlib.blake2b(",".join(_COLUMNS).encode(), digest_size=4).hexdigest()
_COLUMN_LIST = ", ".join(_COLUMNS)
CREATE_TEMP = f"CREATE TEMP TABLE IF NOT EXISTS {_TEMP} (LIKE llm_calls) ON COMMIT DELETE ROWS"
COPY_IN = f"COPY {_TEMP} ({_COLUMN_LIST}) FROM STDIN (FORMAT BINARY)"
COPY_DIRECT = f"COPY llm_calls ({_COLUMN_LIST}) FROM STDIN (FORMAT BINARY)"
COLUMN_TYPES = (
    "SELECT attname, atttypid::int FROM pg_attribute "
    "WHERE attrelid = 'llm_calls'::regclass AND attnum > 0 AND NOT attisdropped"
)
MOVE = (
    f"INSERT INTO llm_calls ({_COLUMN_LIST}) SELECT {_COLUMN_LIST} FROM {_TEMP} ORDER BY call_id "
    "ON CONFLICT (call_id) DO NOTHING RETURNING call_id"
)


def _bind_processors(conn: Connection) -> list[Callable[[Any], Any] | None]:
    """SQLAlchemy's own bind conversions per column (e.g. timestamps to UTC), as the plain insert applies.

    Not for binary columns: COPY takes ``bytes`` as ``bytea`` as they are, and the DBAPI ``Binary`` wrapper
    SQLAlchemy adds was the largest single cost of writing a row (profiled: ~9 us a column, six columns).
    """
    return [
        None
        if c.name in JSON_COLUMNS or isinstance(c.type, LargeBinary)
        else c.type.bind_processor(conn.dialect)
        for c in LlmCall.__table__.columns
    ]


def _values(p: PreparedCall, row: dict[str, Any], processors: list[Callable[[Any], Any] | None]) -> list[Any]:
    row = {**row, **p.json_texts()}
    out = []
    for name, process in zip(_COLUMNS, processors, strict=True):
        value = row[name]
        out.append(process(value) if process is not None and value is not None else value)
    return out


class CopyConflict(Exception):
    """Another writer stored one of the batch's call_ids after the batch's lookup; the transaction is lost.
    Write the batch again in a new transaction with ``conflict_safe=True``."""


def copy_insert(
    conn: Connection, calls: Sequence[tuple[PreparedCall, dict[str, Any]]], *, conflict_safe: bool = False
) -> set[str]:
    """Insert the (call, row) pairs inside the caller's transaction; returns the call_ids inserted.

    Rows go in call_id order (the caller sorts them), so concurrent writers take row locks in one order.
    Raises ``CopyConflict`` unless ``conflict_safe``, which skips the call_ids stored already.
    """
    processors = _bind_processors(conn)
    values = [_values(p, row, processors) for p, row in calls]
    cursor = conn.connection.driver_connection.cursor()  # the psycopg connection, in SQLAlchemy's transaction
    set_json_dumps(_as_is, cursor)  # JSON values are already text (psycopg would encode a str as a string)
    types = _column_types(conn, cursor)
    try:
        if not conflict_safe:
            try:
                _copy(cursor, COPY_DIRECT, types, values)
            except UniqueViolation as exc:
                raise CopyConflict(str(exc).splitlines()[0]) from exc
            return {p.record.call_id for p, _ in calls}
        cursor.execute(CREATE_TEMP)
        _copy(cursor, COPY_IN, types, values)
        cursor.execute(MOVE)
        return {r[0] for r in cursor.fetchall()}
    finally:
        cursor.close()


def _as_is(text: str) -> str:
    return text


def _column_types(conn: Connection, cursor: Any) -> list[int]:
    """The type oids of ``llm_calls``'s columns in ``_COLUMNS`` order, cached on the pooled connection."""
    cache = conn.connection.info
    types = cache.get(_TEMP)
    if types is None:
        by_name = dict(cursor.execute(COLUMN_TYPES).fetchall())
        types = cache[_TEMP] = [by_name[name] for name in _COLUMNS]
    return types


def _copy(cursor: Any, statement: str, types: list[int], values: list[list[Any]]) -> None:
    with cursor.copy(statement) as copy:
        copy.set_types(types)
        for row in values:
            copy.write_row(row)
