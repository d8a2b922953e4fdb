"""Statement helpers shared by the store's writers: dialect inserts, implicit parent rows, IN chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from harnessrl.store.records import RolloutState, utcnow
from harnessrl.store.schema import Run

CHUNK = 500  # keys per IN (...) list: far below SQLite's and PostgreSQL's bound-parameter limits
DialectInsert = Callable[[Any], Any]


class NotFound(LookupError):
    """The run, task, rollout, attempt, call or policy version named does not exist in the store."""


def dialect_insert(dialect_name: str) -> DialectInsert:
    """The dialect's ``insert`` (both have ``on_conflict_do_nothing`` / ``on_conflict_do_update``)."""
    return pg_insert if dialect_name == "postgresql" else sqlite_insert


def chunks(items: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def ensure_runs(conn: Connection, insert: DialectInsert, runs: Iterable[str]) -> None:
    """Create the runs that do not exist yet; sorted, so concurrent writers take locks in one order."""
    names = sorted(set(runs))
    if names:
        conn.execute(
            insert(Run).on_conflict_do_nothing(), [{"name": n, "created_at": utcnow()} for n in names]
        )


def attempt_row(
    rollout_id: str, attempt: int, run: str, state: RolloutState, now: datetime
) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "attempt": attempt,
        "run": run,
        "state": state.value,
        "created_at": now,
        "updated_at": now,
    }
