"""Measuring what a set of calls costs in the database, the same way on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, DateTime, Float, Integer, LargeBinary, String, Text, func, select, text

from harnessrl.store import TraceStore
from harnessrl.store.schema import LlmCall

FIXED_WIDTH = {Integer: 4, Float: 8, DateTime: 8, Boolean: 1}


def _byte_length(column, dialect: str):
    if dialect == "sqlite":
        return func.length(func.cast(column, LargeBinary))
    if isinstance(column.type, LargeBinary):
        return func.octet_length(column)
    return func.octet_length(func.cast(column, Text))


def stored_call_bytes(store: TraceStore, call_ids: list[str]) -> int:
    """Sum of the stored column sizes of these calls' rows: exact byte length of every variable-width value
    (JSON text, token blobs, strings), nominal width of fixed-width ones; NULL costs nothing."""
    dialect = store.engine.dialect.name
    parts = []
    for column in LlmCall.__table__.columns:
        kind = type(column.type.impl if hasattr(column.type, "impl") else column.type)
        if isinstance(column.type, LargeBinary | JSON | String | Text):
            parts.append(func.coalesce(func.sum(_byte_length(column, dialect)), 0))
        else:
            width = next(w for base, w in FIXED_WIDTH.items() if issubclass(kind, base))
            parts.append(func.count(column) * width)
    total = 0
    with store.engine.connect() as conn:
        for start in range(0, len(call_ids), 500):
            row = conn.execute(select(*parts).where(LlmCall.call_id.in_(call_ids[start : start + 500]))).one()
            total += sum(int(v) for v in row)
    return total


def postgres_row_bytes(store: TraceStore, call_ids: list[str]) -> int | None:
    """PostgreSQL's own size of these rows (``pg_column_size`` of the row: headers, TOAST compression)."""
    if store.engine.dialect.name != "postgresql":
        return None
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT sum(pg_column_size(c.*)) FROM llm_calls c WHERE call_id = ANY(:ids)"),
                {"ids": call_ids},
            ).scalar()
        )
