"""one call per (rollout, attempt, seq)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03

Replaces the plain index on ``llm_calls (rollout_id, attempt, seq)`` with a unique constraint. Two calls at
one place of a trajectory (two writers racing before the store renumbered restarted proxies, or data written
by hand) made the learner's row builder fail on that rollout's group at every step.

Existing duplicates are resolved first, and the rule is: **keep the first**, the call made first
(``created_at``, then the lowest ``call_id`` on a tie); the later ones at the same place are deleted and their
ids logged. A kept call stored as a delta against a deleted one is re-encoded in full first, so every kept call
still rebuilds bit-exact. Tables are read by reflection (the columns of this revision, not of today's models).

Runs on PostgreSQL and SQLite: alter tables inside ``op.batch_alter_table`` (SQLite recreates the table,
PostgreSQL alters it in place).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from harnessrl.store.call_rows import CallRebuilder, prepare_call

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("harnessrl.store.migrations")
ENCODING_COLUMNS = ("base_call_id", "prompt_offset", "prompt_suffix", "request", "request_reused")


def drop_duplicate_calls(conn: sa.Connection) -> list[str]:
    """Delete all but the first call at each duplicated (rollout, attempt, seq); returns the deleted ids."""
    calls = sa.Table("llm_calls", sa.MetaData(), autoload_with=conn)
    c = calls.c
    duplicated = conn.execute(
        sa.select(c.rollout_id, c.attempt)
        .group_by(c.rollout_id, c.attempt, c.seq)
        .having(sa.func.count() > 1)
        .distinct()
    ).all()
    dropped: list[str] = []
    for rollout_id, attempt in sorted(set(duplicated)):
        rows = conn.execute(
            sa.select(calls)
            .where(c.rollout_id == rollout_id, c.attempt == attempt)
            .order_by(c.seq, c.created_at, c.call_id)
        ).all()
        rebuilder = CallRebuilder()
        records = {row.call_id: rebuilder.rebuild(row) for row in rows}  # bases come first: lower seq
        seen: set[int] = set()
        gone: set[str] = set()
        for row in rows:
            if row.seq in seen:
                gone.add(row.call_id)
            seen.add(row.seq)
        for row in rows:
            if row.call_id not in gone and row.base_call_id in gone:
                full = prepare_call(records[row.call_id]).encode(None)
                values = {name: full[name] for name in ENCODING_COLUMNS}
                conn.execute(sa.update(calls).where(c.call_id == row.call_id).values(**values))
        conn.execute(sa.delete(calls).where(c.call_id.in_(sorted(gone))))
        log.warning(
            "rollout %s attempt %d: deleted %d duplicate calls (kept the first made at each seq): %s",
            rollout_id, attempt, len(gone), ", ".join(sorted(gone)),
        )  # fmt: skip
        dropped.extend(sorted(gone))
    return dropped


def upgrade() -> None:
    drop_duplicate_calls(op.get_bind())
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_llm_calls_rollout_id_attempt_seq"))
        batch_op.create_unique_constraint(
            batch_op.f("uq_llm_calls_rollout_id_attempt_seq"), ["rollout_id", "attempt", "seq"]
        )


def downgrade() -> None:
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_llm_calls_rollout_id_attempt_seq"), type_="unique")
        batch_op.create_index(
            batch_op.f("ix_llm_calls_rollout_id_attempt_seq"), ["rollout_id", "attempt", "seq"], unique=False
        )
