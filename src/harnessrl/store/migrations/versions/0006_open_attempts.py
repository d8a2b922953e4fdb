"""a scheduler pass costs what is open, not what the run ever made

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

Adds the partial index ``ix_rollout_attempts_open`` (run, state) over the attempts no learner step consumed,
and the table ``run_counters`` (run, name, value) with the totals a pass used to count over every row:
``training_rollouts`` and ``consumed:<state>``. Existing rows are counted once here, so a store upgraded in
the middle of a run reads the same totals as before.

Runs on PostgreSQL and SQLite (both have partial indexes and INSERT ... SELECT).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN = sa.text("consumed_by_step IS NULL")


def upgrade() -> None:
    op.create_index("ix_rollout_attempts_open", "rollout_attempts", ["run", "state"], unique=False,
                    postgresql_where=OPEN, sqlite_where=OPEN)
    op.create_table(
        "run_counters",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_run_counters_run_runs")),
        sa.PrimaryKeyConstraint("run", "name", name=op.f("pk_run_counters")),
    )
    op.execute(
        "INSERT INTO run_counters (run, name, value) "
        "SELECT run, 'training_rollouts', count(*) FROM rollouts "
        "WHERE task_id IS NOT NULL AND kind = 'train' GROUP BY run"
    )
    op.execute(
        "INSERT INTO run_counters (run, name, value) "
        "SELECT run, 'consumed:' || state, count(*) FROM rollout_attempts "
        "WHERE consumed_by_step IS NOT NULL GROUP BY run, state"
    )


def downgrade() -> None:
    op.drop_table("run_counters")
    op.drop_index("ix_rollout_attempts_open", table_name="rollout_attempts")
