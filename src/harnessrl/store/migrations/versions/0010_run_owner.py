"""runs.owner: which TrainingRun a run's rows belong to

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05

Adds ``runs.owner`` (nullable text): ``<namespace>/<name>`` of the TrainingRun whose operator first used the run
name in this store. The store names runs by ``metadata.name`` alone, so two namespaces' runs of the same name on
one database (the chart's PostgreSQL serves every namespace) would otherwise share tasks, attempts and steps.
Runs stored before (and every ``harnessrl run``) have none; the first operator to use such a run claims it.

Runs on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("owner", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("owner")
