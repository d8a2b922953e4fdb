"""Statement helpers shared by the store's writers: dialect inserts, implicit parent rows, IN chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from harnessrl.store.records import RolloutState, utcnow
from harnessrl.store.schema import Rollout, RolloutAttempt, Run

CHUNK = 500  # keys per IN (...) list: far below SQLite's and PostgreSQL's bound-parameter limits
DialectInsert = Callable[[Any], Any]


class NotFound(LookupError):
    """The run, task, rollout, attempt, call or policy version named does not exist in the store."""


class RunOwnedElsewhere(Exception):
    """The run name is another TrainingRun's in this store (``runs.owner``, ``<namespace>/<name>``)."""

    def __init__(self, run: str, owner: str | None) -> None:
        super().__init__(f"the store's run {run!r} belongs to TrainingRun {owner}")
        self.run, self.owner = run, owner


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


def ensure_attempts(
    conn: Connection, insert: DialectInsert, attempts: Mapping[tuple[str, int], tuple[str, int | None]]
) -> None:
    """Create the missing run, rollout and attempt rows, so a proxy without a scheduler never loses a write.

    ``attempts``: (rollout_id, attempt) -> (run, policy version it started under, if known). An attempt
    created here starts as running (a call, reward or finish reported on it proves it runs); an existing
    attempt is left exactly as it is. Sorted, so concurrent writers take locks in one order.
    """
    if not attempts:
        return
    ensure_runs(conn, insert, (run for run, _ in attempts.values()))
    now = utcnow()
    rollouts = {rollout_id: run for (rollout_id, _), (run, _) in attempts.items()}
    conn.execute(
        insert(Rollout).on_conflict_do_nothing(),
        [{"rollout_id": rid, "run": run, "created_at": now} for rid, run in sorted(rollouts.items())],
    )
    rows = []
    for (rollout_id, attempt), (run, version) in sorted(attempts.items()):
        row = attempt_row(rollout_id, attempt, run, RolloutState.RUNNING, now)
        row.update(started_at=now, policy_version_start=version)
        rows.append(row)
    conn.execute(insert(RolloutAttempt).on_conflict_do_nothing(), rows)
