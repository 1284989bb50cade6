"""How a task's status changes: the one rule, and a replica's `TaskTransition` applied.

A task status only changes along `TASK_TRANSITIONS` (contract §4): one task at a
time through `set_task_status`, many at once through `set_task_statuses` (a
conditional bulk UPDATE from the statuses `task_sources` allows). Everything that
changes a task's status, a report or the scheduler's own end of a job, goes
through one of the two.

A transition report costs O(1) in the length of the chain: the job row keeps the
index of its current task, so applying one reads and writes the job, the task,
its attempt, and at most the next task, all from the batch's rows
(`batch_rows.py`). A job shows its first unfinished (not SUCCEEDED) task's status.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import update

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.bounds import MAX_TASKS, check_timestamp, quote
from services.common.statuses import (
    FAILED_GROUP,
    TASK_TRANSITIONS,
    TERMINAL,
    IllegalTransition,
    JobStatus,
    ScheduleState,
    schedule_transition,
    task_sources,
)
from services.scheduler import batch_rows, convert, metrics
from services.scheduler.batch_rows import Wanted
from services.scheduler.db.id_lists import chunked, in_ids
from services.scheduler.db.models import ATTEMPTS, TASKS, TaskRow
from services.scheduler.db.rows import Tracked
from services.scheduler.txn import Move, Txn

S = JobStatus
St = ScheduleState
# The column of a task's cluster name (characters).
MAX_CLUSTER_NAME = 128


def set_task_status(task: Tracked, new: JobStatus) -> bool:
    """The one way a single task's status changes; False for a repeat of the same status.

    Raises:
        IllegalTransition: `TASK_TRANSITIONS` forbids the move.
    """
    old = S(task.status)
    if old == new:
        return False
    if new not in TASK_TRANSITIONS[old]:
        raise IllegalTransition(f"task {task.task_id}: {old.name} -> {new.name} is not allowed")
    task.status = new
    return True


def set_task_statuses(
    txn: Txn,
    job_ids: Sequence[int],
    old: Iterable[JobStatus],
    new: JobStatus,
    *,
    task_id: int | None = None,
    **values: Any,
) -> list[tuple[int, int]]:
    """Moves the tasks of `job_ids` (only task `task_id`, when given) that are in `old` to
    `new`, in one conditional UPDATE.

    Returns the (job_id, task_id) of the tasks that moved.

    Raises:
        IllegalTransition: `TASK_TRANSITIONS` forbids one of the moves.
    """
    old = frozenset(old)
    forbidden = old - task_sources(new)
    if forbidden:
        names = ", ".join(sorted(s.name for s in forbidden))
        raise IllegalTransition(f"tasks cannot move from {names} to {new.name}")
    moved: list[tuple[int, int]] = []
    for chunk in chunked(list(job_ids)):
        query = update(TaskRow).where(
            in_ids(TASKS.c.job_id, values=chunk), TaskRow.status.in_(list(old))
        )
        if task_id is not None:
            query = query.where(TaskRow.task_id == task_id)
        rows = txn.conn.execute(
            query.values(status=new, **values).returning(TaskRow.job_id, TaskRow.task_id),
        )
        moved += [(int(j), int(t)) for j, t in rows.all()]
    return moved


# --- a replica's transition report ----------------------------------------------------------


def check(report: pb.TaskTransition) -> None:
    """A transition's fields in range (its texts are made storable apart).

    Raises:
        ValueError: naming the field.
    """
    try:
        S(report.status)
    except ValueError:
        raise ValueError(f"transition.status: {report.status} is not a status") from None
    counts = (
        ("task_id", report.task_id),
        ("attempt", report.attempt),
        ("recovery_count", report.recovery_count),
        ("restart_count", report.restart_count),
    )
    for name, count in counts:
        if count < 0:
            raise ValueError(f"transition.{name}: must not be negative")
    for name, stamp in (
        ("time", report.time),
        ("start_time", report.start_time),
        ("end_time", report.end_time),
    ):
        check_timestamp(stamp, f"transition.{name}")
    if len(report.cluster_name) > MAX_CLUSTER_NAME:
        raise ValueError(
            f"transition.cluster_name: at most {MAX_CLUSTER_NAME} characters, "
            f"got {quote(report.cluster_name)}"
        )


def wants(report: pb.TaskTransition, wanted: Wanted) -> None:
    """The rows the report touches: its job, its task, the next task when this one
    succeeds (the job moves on to it), and its attempt."""
    wanted.jobs.add(report.job_id)
    wanted.tasks.add((report.job_id, report.task_id))
    # No job has a task past MAX_TASKS (and task_id + 1 may overflow a column).
    if report.status == S.SUCCEEDED and report.task_id + 1 < MAX_TASKS:
        wanted.tasks.add((report.job_id, report.task_id + 1))
    if _touches_attempt(report):
        wanted.attempts.add((report.job_id, report.task_id, report.attempt))


def transition(txn: Txn, cid: str, report: pb.TaskTransition) -> None:
    """Applies one task report: the task, then the job's view of its current task.

    Raises:
        StaleReport: the epoch or controller is not the job's assignment.
        IllegalTransition, ValueError: the report breaks a rule.
    """
    new = S(report.status)
    job = batch_rows.held_job(txn, report.job_id, report.epoch, cid, applying=True)
    task = batch_rows.task(txn, job.id, report.task_id)
    if task is None:
        raise ValueError(f"job {job.id} has no task {report.task_id}")
    old_recoveries, old_restarts = task.recovery_count, task.restart_count
    changed = set_task_status(task, new)
    task.cluster_name = report.cluster_name or task.cluster_name
    task.region = report.region or task.region
    task.resources = report.resources or task.resources
    task.recovery_count = max(task.recovery_count, report.recovery_count)
    task.restart_count = max(task.restart_count, report.restart_count)
    if report.failure_reason:
        task.failure_reason = report.failure_reason
    if report.HasField("condition") or changed:
        # A condition describes the task as it is; a new status starts without one.
        task.condition = report.condition
        task.condition_time = txn.now if report.condition else None
    start = convert.from_timestamp(report.start_time)
    if start is not None:
        task.start_time = start
    elif new == S.RUNNING and task.start_time is None:
        task.start_time = txn.now
    if new in TERMINAL:
        task.end_time = convert.from_timestamp(report.end_time) or task.end_time or txn.now
    job.recovery_count += task.recovery_count - old_recoveries
    _record_attempt(txn, task, report, new)
    follow_current_task(txn, job, task)
    if new == S.RUNNING and job.start_time is None:
        job.start_time = task.start_time
    if report.release_slot and job.schedule_state == St.LAUNCHING:
        job.schedule_state = schedule_transition(St.LAUNCHING, St.ALIVE)
        job.wait_reason = ""
        txn.moves.append(Move(job.id, cid, cid, job.epoch, St.LAUNCHING, St.ALIVE))
    if changed or report.message:
        txn.event(job.id, task.task_id, new, job.schedule_state, report.message or new.name,
                  report.epoch)  # fmt: skip
    if changed:
        txn.after.append(
            functools.partial(
                metrics.task_changed,
                job.id,
                new,
                task.recovery_count - old_recoveries,
                task.restart_count - old_restarts,
            )
        )


def _record_attempt(txn: Txn, task: Tracked, report: pb.TaskTransition, new: JobStatus) -> None:
    """Keeps the attempt's row: opened when it runs, closed with its end and exit code."""
    if not _touches_attempt(report):
        return
    key = (task.job_id, task.task_id, report.attempt)
    attempt = batch_rows.attempt(txn, key)
    if attempt is None:
        if new != S.RUNNING and not report.HasField("exit_code"):
            return
        attempt = txn.track_new(
            ATTEMPTS,
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=report.attempt,
            cluster_name=report.cluster_name or task.cluster_name,
            region=report.region or task.region,
            start_time=txn.now,
            outcome="",
        )
        batch_rows.loaded(txn).attempts[key] = attempt
    if report.HasField("exit_code"):
        attempt.exit_code = report.exit_code
    if new != S.RUNNING and attempt.end_time is None and new not in (S.CANCELLING,):
        attempt.end_time = txn.now
        attempt.outcome = report.message or new.name


def _touches_attempt(report: pb.TaskTransition) -> bool:
    """Whether the report opens, closes or completes its attempt's row (CANCELLING alone
    changes nothing there: the attempt ends with the status after it)."""
    if report.attempt <= 0:
        return False
    return report.status != S.CANCELLING or report.HasField("exit_code")


def follow_current_task(txn: Txn, job: Tracked, task: Tracked) -> None:
    """A job shows its first unfinished (not SUCCEEDED) task's status."""
    status = S(task.status)
    if task.task_id == job.current_task and status == S.SUCCEEDED:
        if task.task_id + 1 < job.num_tasks:
            job.current_task = task.task_id + 1
            following = batch_rows.task(txn, job.id, job.current_task)
            job.status = S(following.status) if following is not None else S.PENDING
        else:
            job.status = S.SUCCEEDED
    elif task.task_id == job.current_task or (
        task.task_id < job.current_task and status != S.SUCCEEDED
    ):
        # A finished task only leaves SUCCEEDED for FAILED_CONTROLLER (a failed cleanup).
        job.current_task = task.task_id
        job.status = status
    if job.status in FAILED_GROUP and job.current_task == task.task_id:
        job.failure_reason = task.failure_reason
