"""admission order served by an index (priority descending, then id)

Revision ID: 0007
Revises: 0006

Admission reads queued jobs by `priority DESC, id`; an index on `priority, id`
cannot give that mixed order, so every pass sorted all jobs of the state.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_schedule")
        batch_op.create_index(
            "ix_jobs_schedule", ["schedule_state", sa.text("priority DESC"), "id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_schedule")
        batch_op.create_index(
            "ix_jobs_schedule", ["schedule_state", "priority", "id"], unique=False
        )
