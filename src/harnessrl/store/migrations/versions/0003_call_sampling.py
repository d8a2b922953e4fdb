"""the sampling parameters of each stored call

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

Adds ``llm_calls.sampling`` (JSON, nullable): the sampling parameters the proxy actually sent upstream —
temperature and top_p, and in train mode the neutral top_k, min_p, penalties and logit_bias that replace
whatever the harness asked for. The harness's own request stays in ``request``; this column is what the
stored log-probs were taken under. Calls stored before this revision keep NULL (not recorded).

Runs on PostgreSQL and SQLite: alter tables inside ``op.batch_alter_table`` (SQLite recreates the table,
PostgreSQL alters it in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sampling", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.drop_column("sampling")
