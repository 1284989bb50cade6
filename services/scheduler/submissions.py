"""Submissions: new jobs stored with their tasks, secrets and first events (contract §11).

A submission is stored whole or not at all, in one transaction: the jobs, one
row per task (its spec serialized), the secrets apart (one map per task, only
ever sent with an assignment), and each job's SUBMITTED event as it moves from
INACTIVE to WAITING. A job whose (user, idempotency key) was seen before, in the
database or earlier in the same call, is not stored again: its answer is the
first job's id. The intake (`intake.py`) groups concurrent submissions into
one such transaction.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Sequence

from sqlalchemy import bindparam, insert, select

from managedjobs.v1 import job_pb2
from services.common.event_messages import SUBMITTED
from services.common.statuses import JobStatus, ScheduleState, schedule_transition
from services.scheduler.db.models import JOBS, SECRETS, TASKS
from services.scheduler.spec.parse import resources_summary
from services.scheduler.txn import Move, Txn

S = JobStatus
St = ScheduleState
J = JOBS.c


@dataclasses.dataclass(frozen=True)
class NewJob:
    name: str
    user: str
    priority: int
    pool: str
    idempotency_key: str
    tasks: Sequence[job_pb2.TaskSpec]
    # One map per task (may be empty); stored apart, only ever sent with an assignment.
    secrets: Sequence[dict[str, str]] = ()
    timeouts: job_pb2.JobTimeouts | None = None


INSERT_JOBS = insert(JOBS).returning(J.id, sort_by_parameter_order=True)
INSERT_TASKS = insert(TASKS)
INSERT_SECRETS = insert(SECRETS)
# Users first: the unique index on (user, key) serves the lookup.
KEYED_JOBS = select(J.id, J.user, J.idempotency_key).where(
    J.user.in_(bindparam("users", expanding=True)),
    J.idempotency_key.in_(bindparam("keys", expanding=True)),
)


def insert_jobs(txn: Txn, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
    """Stores jobs with their tasks, secrets and first events in `txn`; (job_id, created)
    for each, in order (a repeated idempotency key answers with the first job's id)."""
    answers: list[tuple[int, bool] | None] = [None] * len(jobs)
    keys = {job.idempotency_key for job in jobs if job.idempotency_key}
    users = {job.user for job in jobs if job.idempotency_key}
    existing: dict[tuple[str, str], int] = {}
    if keys:
        rows = txn.conn.execute(KEYED_JOBS, {"users": list(users), "keys": list(keys)})
        existing = {(u, k or ""): int(i) for i, u, k in rows.all()}
    fresh: list[int] = []
    first_in_call: dict[tuple[str, str], int] = {}
    repeats: list[tuple[int, int]] = []
    for index, job in enumerate(jobs):
        key = (job.user, job.idempotency_key)
        if job.idempotency_key and key in existing:
            answers[index] = (existing[key], False)
        elif job.idempotency_key and key in first_in_call:
            repeats.append((index, first_in_call[key]))
        else:
            if job.idempotency_key:
                first_in_call[key] = index
            fresh.append(index)
    if fresh:
        state = schedule_transition(St.INACTIVE, St.WAITING)
        ids = txn.conn.scalars(
            INSERT_JOBS, [_job_values(jobs[i], state, txn.now) for i in fresh]
        ).all()
        txn.conn.execute(
            INSERT_TASKS,
            [
                _task_values(job_id, task_id, spec)
                for job_id, i in zip(ids, fresh, strict=True)
                for task_id, spec in enumerate(jobs[i].tasks)
            ],
        )
        secrets = [
            {"job_id": job_id, "data": json.dumps(list(jobs[i].secrets))}
            for job_id, i in zip(ids, fresh, strict=True)
            if any(jobs[i].secrets)
        ]
        if secrets:
            txn.conn.execute(INSERT_SECRETS, secrets)
        for job_id, i in zip(ids, fresh, strict=True):
            txn.event(int(job_id), 0, S.PENDING, state, SUBMITTED)
            txn.moves.append(Move(int(job_id), None, None, 0, St.INACTIVE, state))
            answers[i] = (int(job_id), True)
    for index, first in repeats:
        first_answer = answers[first]
        assert first_answer is not None
        answers[index] = (first_answer[0], False)
    return [a for a in answers if a is not None]


def _job_values(job: NewJob, state: ScheduleState, now: dt.datetime) -> dict[str, object]:
    return {
        "name": job.name,
        "user": job.user,
        "priority": job.priority,
        "pool": job.pool,
        "idempotency_key": job.idempotency_key or None,
        "status": S.PENDING,
        "schedule_state": state,
        "current_task": 0,
        "num_tasks": len(job.tasks),
        "epoch": 0,
        "cancel_requested": False,
        "recovery_count": 0,
        "failure_reason": "",
        "wait_reason": "",
        "submit_time": now,
        "timeouts": job.timeouts.SerializeToString() if job.timeouts else None,
        "pending_deadline": (
            now + dt.timedelta(seconds=job.timeouts.max_pending_seconds)
            if job.timeouts and job.timeouts.HasField("max_pending_seconds")
            else None
        ),
    }


def _task_values(job_id: int, task_id: int, spec: job_pb2.TaskSpec) -> dict[str, object]:
    return {
        "job_id": job_id,
        "task_id": task_id,
        "name": spec.name,
        "status": S.PENDING,
        "spec": spec.SerializeToString(),
        "resources": resources_summary(spec),
        "cluster_name": "",
        "region": "",
        "recovery_count": 0,
        "restart_count": 0,
        "failure_reason": "",
        "condition": "",
        "max_duration_seconds": (
            spec.max_duration_seconds if spec.HasField("max_duration_seconds") else None
        ),
    }
