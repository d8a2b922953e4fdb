"""rollout kinds: training rollouts and evaluation rollouts

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

Adds ``rollouts.kind`` (``train`` or ``evaluation``; existing rollouts are training rollouts) and
``rollouts.evaluated_version``: the policy version an evaluation rollout scores (NULL for training). The
learner claims training rollouts only, so an evaluation is never trained on; evaluation results per version
are computed from these rollouts' attempts (``harnessrl.store.evaluations``).

Runs on PostgreSQL and SQLite: alter tables inside ``op.batch_alter_table`` (SQLite recreates the table,
PostgreSQL alters it in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), server_default="train", nullable=False))
        batch_op.add_column(sa.Column("evaluated_version", sa.Integer(), nullable=True))
        batch_op.create_check_constraint(op.f("ck_rollouts_kind"), "kind IN ('train', 'evaluation')")
        batch_op.create_index(op.f("ix_rollouts_run_kind_evaluated_version"), ["run", "kind", "evaluated_version"])


def downgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(op.f("ix_rollouts_run_kind_evaluated_version"))
        batch_op.drop_constraint(op.f("ck_rollouts_kind"), type_="check")
        batch_op.drop_column("evaluated_version")
        batch_op.drop_column("kind")
