"""The scheduler's tables: jobs, their tasks, and the event log.

The database is the only truth. A job row carries the admission state, the
replica it is assigned to and the epoch of that assignment (the fencing token
every report must match). Statuses are stored by name, so the database reads
well with any SQL client.
"""

from __future__ import annotations

import datetime as dt
from typing import cast

from sqlalchemy import (
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, orm_insert_sentinel

from services.common.statuses import JobStatus, ScheduleState

# SQLite only autoincrements INTEGER PRIMARY KEY; PostgreSQL wants BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def status_column() -> Enum:
    return Enum(JobStatus, native_enum=False, length=24, validate_strings=True)


def schedule_column() -> Enum:
    return Enum(ScheduleState, native_enum=False, length=16, validate_strings=True)


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("user", "idempotency_key", name="uq_jobs_user_idempotency_key"),
        # Admission order: priority descending, then submission (see migration 0007).
        Index("ix_jobs_schedule", "schedule_state", text("priority DESC"), "id"),
        Index("ix_jobs_controller", "controller_id", "schedule_state"),
        Index("ix_jobs_user", "user", "id"),
        Index("ix_jobs_pending_deadline", "schedule_state", "pending_deadline"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63))
    user: Mapped[str] = mapped_column(String(128))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    pool: Mapped[str] = mapped_column(String(128), default="")
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    status: Mapped[JobStatus] = mapped_column(status_column())
    schedule_state: Mapped[ScheduleState] = mapped_column(schedule_column())
    current_task: Mapped[int] = mapped_column(Integer, default=0)
    num_tasks: Mapped[int] = mapped_column(Integer)
    controller_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    # The number (`seq`) of the last report about the job applied at this assignment; a
    # report numbered no higher is a replay. A new assignment starts again from 0.
    report_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    recovery_count: Mapped[int] = mapped_column(Integer, default=0)
    failure_reason: Mapped[str] = mapped_column(Text, default="")
    wait_reason: Mapped[str] = mapped_column(Text, default="")
    submit_time: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    start_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    end_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The job's timeouts (a serialized JobTimeouts), when it has any.
    timeouts: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # submit_time + max_pending: a job still WAITING then ends FAILED_NO_RESOURCE.
    pending_deadline: Mapped[dt.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    # Lets one multi-row INSERT ... RETURNING hand back ids in submission order (SQLite).
    _sentinel: Mapped[int | None] = orm_insert_sentinel()


class SecretRow(Base):
    """A job's secrets, apart from everything that is ever read back to a client: only the
    assignment of the job to a replica carries them."""

    __tablename__ = "job_secrets"

    job_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    # JSON: one {name: value} map per task, in task order.
    data: Mapped[str] = mapped_column(Text)


class TaskRow(Base):
    __tablename__ = "tasks"

    job_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    status: Mapped[JobStatus] = mapped_column(status_column())
    # The validated TaskSpec message, serialized.
    spec: Mapped[bytes] = mapped_column()
    resources: Mapped[str] = mapped_column(Text, default="")
    cluster_name: Mapped[str] = mapped_column(String(128), default="")
    region: Mapped[str] = mapped_column(String(64), default="")
    recovery_count: Mapped[int] = mapped_column(Integer, default=0)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    failure_reason: Mapped[str] = mapped_column(Text, default="")
    start_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    end_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # A running task's condition (e.g. its cluster is unreachable), and since when.
    condition: Mapped[str] = mapped_column(Text, default="", server_default="")
    condition_time: Mapped[dt.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    # The spec's max_duration, kept apart so that GetJob can show it without the spec.
    max_duration_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


class AttemptRow(Base):
    """One cluster a task ran on, with how it ended (contract §18)."""

    __tablename__ = "attempts"

    job_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_name: Mapped[str] = mapped_column(String(128), default="")
    region: Mapped[str] = mapped_column(String(64), default="")
    start_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    end_time: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    outcome: Mapped[str] = mapped_column(Text, default="")


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigId, ForeignKey("jobs.id", ondelete="CASCADE"))
    task_id: Mapped[int] = mapped_column(Integer)
    status: Mapped[JobStatus] = mapped_column(status_column())
    schedule_state: Mapped[ScheduleState] = mapped_column(schedule_column())
    time: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    message: Mapped[str] = mapped_column(Text, default="")
    # The assignment epoch that wrote it (0 for the scheduler's own changes).
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    _sentinel: Mapped[int | None] = orm_insert_sentinel()


# The tables themselves, for Core statements on hot paths (bulk inserts).
JOBS = cast(Table, JobRow.__table__)
TASKS = cast(Table, TaskRow.__table__)
EVENTS = cast(Table, EventRow.__table__)
SECRETS = cast(Table, SecretRow.__table__)
ATTEMPTS = cast(Table, AttemptRow.__table__)
