"""Create the experience bank's tables: experiences, experience_versions and bank_position.

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Spelled out rather than imported from infra.db: a migration is a snapshot and must not change when the model does.
    op.create_table(
        "experiences",
        sa.Column("experience_id", sa.String(256), nullable=False),
        sa.Column("task_family", sa.String(256), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("merged_into", sa.String(256), nullable=True),
        sa.Column("parents", sa.Text(), nullable=False),
        sa.Column("generation_id", sa.String(256), nullable=False),
        sa.Column("extractor_version", sa.Integer(), nullable=False),
        sa.Column("source_trajectory_ids", sa.Text(), nullable=False),
        sa.Column("retired_reason", sa.String(64), nullable=True),
        sa.Column("key_model", sa.String(256), nullable=False),
        sa.Column("key_dim", sa.Integer(), nullable=False),
        sa.Column("key", sa.LargeBinary(), nullable=False),
        sa.Column("op_offsets", sa.Text(), nullable=False),
        sa.Column("retrievals", sa.Integer(), nullable=False),
        sa.Column("trainings", sa.Integer(), nullable=False),
        sa.Column("last_trained_step", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("experience_id", name="pk_experiences"),
    )
    op.create_index("ix_experiences_task_family_status", "experiences", ["task_family", "status"])
    op.create_table(
        "experience_versions",
        sa.Column("experience_id", sa.String(256), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("op_id", sa.String(256), nullable=False),
        sa.Column("op_kind", sa.String(64), nullable=False),
        sa.Column("op_offset", sa.BigInteger(), nullable=False),
        sa.Column("generation_id", sa.String(256), nullable=False),
        sa.Column("extractor_version", sa.Integer(), nullable=False),
        sa.Column("source_trajectory_ids", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("experience_id", "version", name="pk_experience_versions"),
    )
    op.create_table(
        "bank_position",
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("log_id", sa.String(64), nullable=False),
        sa.Column("state_hash", sa.String(64), nullable=False),
        sa.Column("applied", sa.BigInteger(), nullable=False),
        sa.Column("duplicates", sa.BigInteger(), nullable=False),
        sa.Column("rejected", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("topic", "partition", name="pk_bank_position"),
    )


def downgrade() -> None:
    op.drop_table("bank_position")
    op.drop_table("experience_versions")
    op.drop_index("ix_experiences_task_family_status", table_name="experiences")
    op.drop_table("experiences")
