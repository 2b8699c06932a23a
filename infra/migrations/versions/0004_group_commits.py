"""Create group_commits: every offset commit of a consumer-group worker, kept beside Kafka's.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
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
    # Spelled out rather than imported from infra.db: a migration is a snapshot and must not change when the model does.
    op.create_table(
        "group_commits",
        sa.Column("id", sa.Integer(), nullable=False, autoincrement=True),
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("instance", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("log_id", sa.String(64), nullable=False),
        sa.Column("produced_ends", sa.Text(), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_group_commits"),
    )
    op.create_index("ix_group_commits_group_partition", "group_commits", ["group_id", "topic", "partition"])


def downgrade() -> None:
    op.drop_index("ix_group_commits_group_partition", table_name="group_commits")
    op.drop_table("group_commits")
