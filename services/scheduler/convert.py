"""Rows to proto messages, and times both ways."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, NamedTuple

from google.protobuf import timestamp_pb2
from sqlalchemy import Row

from managedjobs.v1 import job_pb2

_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_UTC = _EPOCH.replace(tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)


def set_time(field: timestamp_pb2.Timestamp, value: dt.datetime | None) -> None:
    """Sets a message's time field in place (left unset for None). SQLite hands back
    naive datetimes; every time we store is UTC.

    Arithmetic on the datetime rather than `Timestamp.FromDatetime`, and no Timestamp
    of its own copied into the message: a page of 1,000 jobs sets thousands of times.
    """
    if value is None:
        return
    micros = (value - (_EPOCH if value.tzinfo is None else _EPOCH_UTC)) // _MICROSECOND
    field.seconds, rest = divmod(micros, 1_000_000)
    field.nanos = rest * 1000


def from_timestamp(value: timestamp_pb2.Timestamp) -> dt.datetime | None:
    if not value.seconds and not value.nanos:
        return None
    return value.ToDatetime(tzinfo=dt.UTC)


def task_message(row: Row[Any], with_spec: bool) -> job_pb2.Task:
    # By key, not by attribute: a row's attribute is found only after a failed lookup,
    # several times slower, and a page of jobs reads tens of thousands of them.
    t = row._mapping
    task = job_pb2.Task(
        task_id=t["task_id"],
        name=t["name"],
        status=int(t["status"]),  # type: ignore[arg-type]
        cluster_name=t["cluster_name"],
        region=t["region"],
        resources=t["resources"],
        recovery_count=t["recovery_count"],
        restart_count=t["restart_count"],
        failure_reason=t["failure_reason"],
        condition=t["condition"],
    )
    set_time(task.start_time, t["start_time"])
    set_time(task.end_time, t["end_time"])
    set_time(task.condition_time, t["condition_time"])
    if t["max_duration_seconds"] is not None:
        task.max_duration_seconds = t["max_duration_seconds"]
    if with_spec:
        task.spec.ParseFromString(t["spec"])
    return task


def job_message(row: Row[Any], tasks: Iterable[Row[Any]], with_specs: bool = False) -> job_pb2.Job:
    """A job from its row (every column of `jobs`) and its tasks' rows, in any order."""
    j = row._mapping
    job = job_pb2.Job(
        job_id=j["id"],
        name=j["name"],
        user=j["user"],
        priority=j["priority"],
        pool=j["pool"],
        status=int(j["status"]),  # type: ignore[arg-type]
        schedule_state=int(j["schedule_state"]),  # type: ignore[arg-type]
        tasks=[task_message(t, with_specs) for t in sorted(tasks, key=_task_id)],
        recovery_count=j["recovery_count"],
        failure_reason=j["failure_reason"],
        controller_id=j["controller_id"] or "",
        epoch=j["epoch"],
        current_task_id=j["current_task"],
        wait_reason=j["wait_reason"],
        cancel_requested=j["cancel_requested"],
    )
    if j["timeouts"]:
        job.timeouts.ParseFromString(j["timeouts"])
    set_time(job.submit_time, j["submit_time"])
    set_time(job.start_time, j["start_time"])
    set_time(job.end_time, j["end_time"])
    return job


def _task_id(row: Row[Any]) -> int:
    return int(row._mapping["task_id"])


class NewEvent(NamedTuple):
    """An event as just inserted: what `event_message` reads, without building an ORM
    row (about four times cheaper, for the thousands a handback writes at once)."""

    id: int
    job_id: int
    task_id: int
    status: int
    schedule_state: int
    time: dt.datetime
    message: str
    epoch: int = 0


def event_message(row: Row[Any] | NewEvent) -> job_pb2.JobEvent:
    event = job_pb2.JobEvent(
        event_id=row.id,
        job_id=row.job_id,
        task_id=row.task_id,
        status=int(row.status),  # type: ignore[arg-type]
        schedule_state=int(row.schedule_state),  # type: ignore[arg-type]
        message=row.message,
    )
    set_time(event.time, row.time)
    return event


def attempt_message(row: Row[Any]) -> job_pb2.Attempt:
    attempt = job_pb2.Attempt(
        attempt=row.attempt,
        cluster_name=row.cluster_name,
        region=row.region,
        outcome=row.outcome,
    )
    set_time(attempt.start_time, row.start_time)
    set_time(attempt.end_time, row.end_time)
    if row.exit_code is not None:
        attempt.exit_code = row.exit_code
    return attempt
