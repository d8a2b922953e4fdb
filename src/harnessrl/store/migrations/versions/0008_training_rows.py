"""what the learner made of each attempt: its row count and its own log-probs per trained token

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05

Adds ``rollout_attempts.train_rows`` (nullable integer) with an index on (run, train_rows), so the trace
explorer's rollout list filters and sorts by rows per rollout in the database (and one on (run, reason), its
sort by failure reason), and the table
``learner_logprobs``: per training row, the learner's log-probs of its trained tokens at the step that consumed
it, shown beside the serving engine's in the token view. The learner writes both in the transaction that
commits the step. Attempts consumed before this revision keep NULL and no log-probs: their rows were not kept.

Runs on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a nullable column without a default: a plain ALTER TABLE on both databases (no SQLite table rebuild)
    op.add_column("rollout_attempts", sa.Column("train_rows", sa.Integer(), nullable=True))
    op.create_index("ix_rollout_attempts_run_train_rows", "rollout_attempts", ["run", "train_rows"], unique=False)
    op.create_index("ix_rollout_attempts_run_reason", "rollout_attempts", ["run", "reason"], unique=False)
    op.create_table(
        "learner_logprobs",
        sa.Column("rollout_id", sa.String(length=128), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("row_index", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id", "attempt"], ["rollout_attempts.rollout_id", "rollout_attempts.attempt"],
                                name=op.f("fk_learner_logprobs_rollout_id_attempt_rollout_attempts")),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_learner_logprobs_run_runs")),
        sa.PrimaryKeyConstraint("rollout_id", "attempt", "row_index", name=op.f("pk_learner_logprobs")),
    )


def downgrade() -> None:
    op.drop_table("learner_logprobs")
    op.drop_index("ix_rollout_attempts_run_reason", table_name="rollout_attempts")
    op.drop_index("ix_rollout_attempts_run_train_rows", table_name="rollout_attempts")
    with op.batch_alter_table("rollout_attempts", schema=None) as batch_op:
        batch_op.drop_column("train_rows")
