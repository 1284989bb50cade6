"""Everything the scheduler reads and writes, one transaction per operation.

Invariants kept here, whatever the caller does:
- A schedule-state change is one conditional UPDATE (from-states and, for a
  replica's request, its epoch in the WHERE clause); its row count is the answer.
- A report from a replica is applied only when its epoch and controller match
  the job's current assignment, and only along `TASK_TRANSITIONS`.
- Every change writes an event row in the same transaction, published to
  watchers after the commit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Row, Select, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from managedjobs.v1 import job_pb2, scheduler_service_pb2
from services.common.statuses import (
    TERMINAL,
    IllegalTransition,
    JobStatus,
    ScheduleState,
    schedule_transition,
    task_transition_allowed,
)
from services.scheduler import convert
from services.scheduler.db import Database
from services.scheduler.events import EventBus
from services.scheduler.models import EVENTS, JOBS, TASKS, EventRow, JobRow, TaskRow
from services.scheduler.spec import resources_summary

S = JobStatus
St = ScheduleState


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclasses.dataclass(frozen=True)
class NewJob:
    name: str
    user: str
    priority: int
    pool: str
    idempotency_key: str
    tasks: Sequence[job_pb2.TaskSpec]


@dataclasses.dataclass(frozen=True)
class Move:
    """The outcome of a schedule-state change that happened."""

    job_id: int
    old_controller: str | None
    new_controller: str | None
    epoch: int
    old: ScheduleState
    new: ScheduleState


class Queued(NamedTuple):
    """What admission needs of a queued job."""

    id: int
    priority: int
    epoch: int
    controller_id: str | None
    schedule_state: ScheduleState


QUEUED_COLUMNS = (
    JobRow.id,
    JobRow.priority,
    JobRow.epoch,
    JobRow.controller_id,
    JobRow.schedule_state,
)


class StaleReport(Exception):
    """A report whose epoch or controller is not the job's current assignment."""


def job_status(tasks: Sequence[TaskRow]) -> tuple[JobStatus, int]:
    """A job shows its first unfinished (not SUCCEEDED) task's status, and that task's index."""
    for task in sorted(tasks, key=lambda t: t.task_id):
        if task.status != S.SUCCEEDED:
            return task.status, task.task_id
    return S.SUCCEEDED, len(tasks) - 1


class Store:
    def __init__(
        self, db: Database, bus: EventBus, clock: Callable[[], dt.datetime] = utcnow
    ) -> None:
        self.db = db
        self.bus = bus
        self.clock = clock

    # --- submission and queries -------------------------------------------------------

    async def submit(self, job: NewJob) -> tuple[int, bool]:
        """Stores a job with its tasks and first event; returns (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
        """Stores jobs in one transaction (group commit); (job_id, created) for each.

        A job whose (user, idempotency key) was seen before, in the database or
        earlier in the same batch, is not stored again: its answer is the first id.
        """
        try:
            return await self._submit_many(jobs)
        except IntegrityError:
            if len(jobs) == 1:
                raise
            # Another writer took a key meanwhile: redo one by one, each re-checking.
            return [(await self._submit_many([job]))[0] for job in jobs]

    async def _submit_many(self, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
        now = self.clock()
        answers: list[tuple[int, bool] | None] = [None] * len(jobs)
        keys = {job.idempotency_key for job in jobs if job.idempotency_key}
        async with self.db.write() as session:
            existing: dict[tuple[str, str], int] = {}
            if keys:
                rows = await session.execute(
                    select(JobRow.id, JobRow.user, JobRow.idempotency_key).where(
                        JobRow.idempotency_key.in_(keys)
                    )
                )
                existing = {(u, k or ""): int(i) for i, u, k in rows.all()}
            fresh: list[int] = []
            repeats: list[tuple[int, int]] = []
            first_in_batch: dict[tuple[str, str], int] = {}
            for index, job in enumerate(jobs):
                key = (job.user, job.idempotency_key)
                if job.idempotency_key and key in existing:
                    answers[index] = (existing[key], False)
                elif job.idempotency_key and key in first_in_batch:
                    repeats.append((index, first_in_batch[key]))
                else:
                    if job.idempotency_key:
                        first_in_batch[key] = index
                    fresh.append(index)
            events: list[job_pb2.JobEvent] = []
            if fresh:
                state = schedule_transition(St.INACTIVE, St.WAITING)
                ids = (
                    await session.scalars(
                        insert(JOBS).returning(JobRow.id, sort_by_parameter_order=True),
                        [_job_values(jobs[i], state, now) for i in fresh],
                    )
                ).all()
                await session.execute(
                    insert(TASKS),
                    [
                        _task_values(job_id, task_id, spec)
                        for job_id, i in zip(ids, fresh, strict=True)
                        for task_id, spec in enumerate(jobs[i].tasks)
                    ],
                )
                event_values = [
                    {
                        "job_id": job_id,
                        "task_id": 0,
                        "status": S.PENDING,
                        "schedule_state": state,
                        "time": now,
                        "message": "submitted",
                        "epoch": 0,
                    }
                    for job_id in ids
                ]
                event_ids = (
                    await session.scalars(
                        insert(EVENTS).returning(EventRow.id, sort_by_parameter_order=True),
                        event_values,
                    )
                ).all()
                for event_id, values in zip(event_ids, event_values, strict=True):
                    events.append(convert.event_message(EventRow(id=event_id, **values)))
                for job_id, i in zip(ids, fresh, strict=True):
                    answers[i] = (int(job_id), True)
        for index, first in repeats:
            first_answer = answers[first]
            assert first_answer is not None
            answers[index] = (first_answer[0], False)
        self.bus.publish(events)
        return [a for a in answers if a is not None]

    async def _by_key(self, user: str, key: str) -> int | None:
        async with self.db.read() as session:
            found = await session.scalar(
                select(JobRow.id).where(JobRow.user == user, JobRow.idempotency_key == key)
            )
            return int(found) if found is not None else None

    async def get_job(self, job_id: int, with_specs: bool = False) -> job_pb2.Job | None:
        async with self.db.read() as session:
            row = await session.get(JobRow, job_id)
            if row is None:
                return None
            tasks = await self._tasks(session, [job_id])
            return convert.job_message(row, tasks.get(job_id, []), with_specs)

    async def list_jobs(
        self,
        statuses: Iterable[JobStatus] = (),
        user: str = "",
        name: str = "",
        limit: int = 100,
        before_id: int = 0,
    ) -> list[job_pb2.Job]:
        """Newest first; `before_id` continues a page."""
        query = select(JobRow).order_by(JobRow.id.desc()).limit(limit)
        statuses = list(statuses)
        if statuses:
            query = query.where(JobRow.status.in_(statuses))
        if user:
            query = query.where(JobRow.user == user)
        if name:
            query = query.where(JobRow.name == name)
        if before_id:
            query = query.where(JobRow.id < before_id)
        async with self.db.read() as session:
            rows = list(await session.scalars(query))
            tasks = await self._tasks(session, [r.id for r in rows])
            return [convert.job_message(r, tasks.get(r.id, [])) for r in rows]

    async def _tasks(self, session: AsyncSession, job_ids: list[int]) -> dict[int, list[TaskRow]]:
        out: dict[int, list[TaskRow]] = {}
        if not job_ids:
            return out
        for task in await session.scalars(select(TaskRow).where(TaskRow.job_id.in_(job_ids))):
            out.setdefault(task.job_id, []).append(task)
        return out

    async def events_after(
        self, after_id: int, job_ids: Iterable[int] = (), limit: int = 1000
    ) -> list[job_pb2.JobEvent]:
        query = select(EventRow).where(EventRow.id > after_id).order_by(EventRow.id).limit(limit)
        job_ids = list(job_ids)
        if job_ids:
            query = query.where(EventRow.job_id.in_(job_ids))
        async with self.db.read() as session:
            return [convert.event_message(r) for r in await session.scalars(query)]

    async def job_ids(
        self, ids: Iterable[int] = (), name: str = "", user: str = "", active_only: bool = False
    ) -> list[tuple[int, str]]:
        """(job_id, user) of the jobs matching ids, a name, or a user."""
        query = select(JobRow.id, JobRow.user).order_by(JobRow.id)
        ids = list(ids)
        if ids:
            query = query.where(JobRow.id.in_(ids))
        if name:
            query = query.where(JobRow.name == name)
        if user:
            query = query.where(JobRow.user == user)
        if active_only:
            query = query.where(JobRow.schedule_state != St.DONE)
        async with self.db.read() as session:
            return [(int(i), str(u)) for i, u in (await session.execute(query)).all()]

    # --- admission ----------------------------------------------------------------------

    async def queued(
        self, state: ScheduleState, controller_id: str | None, limit: int
    ) -> list[Queued]:
        """Jobs in `state` in admission order (priority, then submission)."""
        query = select(*QUEUED_COLUMNS).where(JobRow.schedule_state == state)
        if controller_id is not None:
            query = query.where(JobRow.controller_id == controller_id)
        return await self._queued(query, limit)

    async def _queued(
        self, query: Select[int, int, int, str | None, ScheduleState], limit: int
    ) -> list[Queued]:
        query = query.order_by(JobRow.priority.desc(), JobRow.id).limit(limit)
        async with self.db.read() as session:
            return [Queued(*row) for row in (await session.execute(query)).all()]

    async def ahead_of(self, job_id: int, priority: int) -> int:
        """How many queued jobs rank ahead of this WAITING one (ALIVE_WAITING first, then
        higher priority, then earlier submission)."""
        query = select(func.count()).where(
            (JobRow.schedule_state == St.ALIVE_WAITING)
            | (
                (JobRow.schedule_state == St.WAITING)
                & (
                    (JobRow.priority > priority)
                    | ((JobRow.priority == priority) & (JobRow.id < job_id))
                )
            )
        )
        async with self.db.read() as session:
            return int(await session.scalar(query) or 0)

    async def orphans(self, limit: int) -> list[Queued]:
        """Admitted jobs that no replica holds (their replica's lease expired)."""
        query = select(*QUEUED_COLUMNS).where(
            JobRow.controller_id.is_(None), JobRow.schedule_state.in_(list(ALIVE_LIST))
        )
        return await self._queued(query, limit)

    async def move(
        self,
        job_id: int,
        old: Iterable[ScheduleState],
        new: ScheduleState,
        *,
        epoch: int | None = None,
        controller_id: str | None = None,
        assign_to: str | None = None,
        wait_reason: str | None = None,
        message: str = "",
    ) -> Move | None:
        """Moves a job's schedule state iff it is in `old` (and at `epoch` of `controller_id`).

        `assign_to` hands the job to that replica with the next epoch.
        """
        old = [state for state in old if _allowed(state, new)]
        now = self.clock()
        values: dict[str, object] = {"schedule_state": new}
        if wait_reason is not None:
            values["wait_reason"] = wait_reason
        if assign_to is not None:
            values["controller_id"] = assign_to
            values["epoch"] = JobRow.epoch + 1
        if new == St.DONE:
            values["end_time"] = now
            values["wait_reason"] = ""
        query = update(JobRow).where(JobRow.id == job_id, JobRow.schedule_state.in_(old))
        if epoch is not None:
            query = query.where(JobRow.epoch == epoch)
        if controller_id is not None:
            query = query.where(JobRow.controller_id == controller_id)
        async with self.db.write() as session:
            prior = (
                await session.execute(
                    select(JobRow.schedule_state, JobRow.controller_id).where(JobRow.id == job_id)
                )
            ).first()
            result = await session.execute(
                query.values(**values).returning(JobRow.controller_id, JobRow.epoch)
            )
            changed = result.first()
            if changed is None or prior is None:
                return None
            row = await session.get(JobRow, job_id)
            assert row is not None
            event = self._event(session, row, row.current_task, message or f"{new.name}", now)
            await session.flush()
        self.bus.publish([convert.event_message(event)])
        return Move(job_id, prior[1], changed[0], int(changed[1]), prior[0], new)

    async def move_many(
        self,
        job_ids: Sequence[int],
        old: ScheduleState,
        new: ScheduleState,
        *,
        controller_id: str | None = None,
        assign_to: str | None = None,
        message: str = "",
        fetch: bool = False,
    ) -> tuple[list[Move], list[job_pb2.Job]]:
        """Moves many jobs from `old` to `new` in one conditional UPDATE (admission batches).

        Only jobs still in `old` (and held by `controller_id`, when given) move;
        `assign_to` hands them to that replica with the next epoch. With `fetch`,
        the moved jobs (with their task specs) are read in the same transaction.
        """
        if not job_ids:
            return [], []
        schedule_transition(old, new)
        now = self.clock()
        values: dict[str, object] = {"schedule_state": new, "wait_reason": ""}
        if assign_to is not None:
            values["controller_id"] = assign_to
            values["epoch"] = JobRow.epoch + 1
        query = update(JobRow).where(JobRow.id.in_(list(job_ids)), JobRow.schedule_state == old)
        if controller_id is not None:
            query = query.where(JobRow.controller_id == controller_id)
        query = query.values(**values).returning(
            JobRow.id, JobRow.epoch, JobRow.status, JobRow.current_task
        )
        async with self.db.write() as session:
            rows = (
                await session.execute(query, execution_options={"synchronize_session": False})
            ).all()
            event_values = [
                {
                    "job_id": job_id,
                    "task_id": task,
                    "status": status,
                    "schedule_state": new,
                    "time": now,
                    "message": message or new.name,
                    "epoch": 0,
                }
                for job_id, _, status, task in rows
            ]
            event_ids = (
                (
                    await session.scalars(
                        insert(EVENTS).returning(EventRow.id, sort_by_parameter_order=True),
                        event_values,
                    )
                ).all()
                if rows
                else []
            )
            jobs: list[job_pb2.Job] = []
            if fetch and rows:
                moved = [int(r[0]) for r in rows]
                jobs = await self._job_messages(session, moved)
        self.bus.publish(
            convert.event_message(EventRow(id=i, **v))
            for i, v in zip(event_ids, event_values, strict=True)
        )
        moves = [
            Move(int(job_id), controller_id, assign_to or controller_id, int(epoch), old, new)
            for job_id, epoch, _, _ in rows
        ]
        return moves, jobs

    async def get_jobs(self, job_ids: Sequence[int], with_specs: bool = False) -> list[job_pb2.Job]:
        async with self.db.read() as session:
            return await self._job_messages(session, list(job_ids), with_specs)

    async def _job_messages(
        self, session: AsyncSession, job_ids: list[int], with_specs: bool = True
    ) -> list[job_pb2.Job]:
        """Jobs with their tasks, read as plain rows (no ORM objects: this is a hot path)."""
        jobs = (await session.execute(select(JOBS).where(JobRow.id.in_(job_ids)))).all()
        tasks: dict[int, list[Row[Any]]] = {}
        query = select(TASKS).where(TaskRow.job_id.in_(job_ids))
        for task in (await session.execute(query)).all():
            tasks.setdefault(task.job_id, []).append(task)
        return [convert.job_message(j, tasks.get(j.id, []), with_specs) for j in jobs]

    async def release_replica(
        self, controller_id: str, job_ids: Iterable[int] | None = None, reason: str = ""
    ) -> list[Move]:
        """Takes jobs (all, by default) away from a replica whose lease expired (SPEC §9).

        Launch slots are freed (LAUNCHING becomes ALIVE); a task that was
        STARTING goes to RECOVERING, since its cluster's state is unknown.
        """
        now = self.clock()
        moves: list[Move] = []
        events: list[EventRow] = []
        async with self.db.write() as session:
            query = select(JobRow).where(
                JobRow.controller_id == controller_id, JobRow.schedule_state != St.DONE
            )
            if job_ids is not None:
                query = query.where(JobRow.id.in_(list(job_ids)))
            rows = list(await session.scalars(query))
            tasks = await self._tasks(session, [r.id for r in rows])
            for row in rows:
                prior = row.schedule_state
                row.controller_id = None
                if row.schedule_state == St.LAUNCHING:
                    row.schedule_state = schedule_transition(row.schedule_state, St.ALIVE)
                for task in tasks.get(row.id, []):
                    if task.status == S.STARTING:
                        task.status = S.RECOVERING
                row.status, row.current_task = job_status(tasks.get(row.id, []))
                events.append(
                    self._event(session, row, row.current_task, reason or "released", now)
                )
                moves.append(
                    Move(row.id, controller_id, None, row.epoch, prior, row.schedule_state)
                )
            await session.flush()
        self.bus.publish(convert.event_message(e) for e in events)
        return moves

    async def recount(self) -> Counter[tuple[str | None, ScheduleState]]:
        """Jobs per (replica, schedule state), straight from the database."""
        query = select(JobRow.controller_id, JobRow.schedule_state, func.count()).group_by(
            JobRow.controller_id, JobRow.schedule_state
        )
        async with self.db.read() as session:
            rows = (await session.execute(query)).all()
        return Counter({(c, St(s) if not isinstance(s, St) else s): int(n) for c, s, n in rows})

    async def held_by(self, controller_id: str) -> dict[int, int]:
        """job_id -> epoch of the unfinished jobs assigned to a replica."""
        query = select(JobRow.id, JobRow.epoch).where(
            JobRow.controller_id == controller_id, JobRow.schedule_state != St.DONE
        )
        async with self.db.read() as session:
            return {int(i): int(e) for i, e in (await session.execute(query)).all()}

    async def assignment(self, job_id: int) -> tuple[str | None, int] | None:
        """(controller_id, epoch) of a job, or None when it does not exist."""
        async with self.db.read() as session:
            row = (
                await session.execute(
                    select(JobRow.controller_id, JobRow.epoch).where(JobRow.id == job_id)
                )
            ).first()
        return None if row is None else (row[0], int(row[1]))

    async def check_epoch(self, job_id: int, epoch: int, controller_id: str) -> None:
        """Raises StaleReport unless the job is assigned to `controller_id` at `epoch`."""
        if await self.assignment(job_id) != (controller_id, epoch):
            raise StaleReport(f"job {job_id}: epoch {epoch} is not current")

    # --- reports from replicas ----------------------------------------------------------

    async def apply_transition(
        self, report: scheduler_service_pb2.TaskTransition, controller_id: str
    ) -> None:
        """Applies a replica's task report.

        Raises:
            StaleReport: the epoch or controller is not the job's assignment.
            ValueError: the transition is not allowed or names an unknown task.
        """
        now = self.clock()
        new = S(report.status)
        async with self.db.write() as session:
            job = await session.get(JobRow, report.job_id, with_for_update=True)
            if job is None or job.epoch != report.epoch or job.controller_id != controller_id:
                raise StaleReport(f"job {report.job_id}: epoch {report.epoch} is not current")
            tasks = (await self._tasks(session, [job.id])).get(job.id, [])
            by_id = {t.task_id: t for t in tasks}
            task = by_id.get(report.task_id)
            if task is None:
                raise ValueError(f"job {job.id} has no task {report.task_id}")
            if not task_transition_allowed(task.status, new):
                raise ValueError(
                    f"job {job.id} task {task.task_id}: {task.status.name} -> {new.name} "
                    "is not allowed"
                )
            changed = task.status != new
            task.status = new
            task.cluster_name = report.cluster_name or task.cluster_name
            task.region = report.region or task.region
            task.resources = report.resources or task.resources
            task.recovery_count = max(task.recovery_count, report.recovery_count)
            task.restart_count = max(task.restart_count, report.restart_count)
            if report.failure_reason:
                task.failure_reason = report.failure_reason
            start = convert.from_timestamp(report.start_time)
            if start is not None:
                task.start_time = start
            elif new == S.RUNNING and task.start_time is None:
                task.start_time = now
            if new in TERMINAL:
                task.end_time = convert.from_timestamp(report.end_time) or task.end_time or now
            job.status, job.current_task = job_status(tasks)
            job.recovery_count = sum(t.recovery_count for t in tasks)
            if job.status in TERMINAL - {S.SUCCEEDED, S.CANCELLED}:
                job.failure_reason = by_id[job.current_task].failure_reason
            if new == S.RUNNING and job.start_time is None:
                job.start_time = task.start_time
            event = None
            if changed or report.message:
                message = report.message or new.name
                event = self._event(session, job, task.task_id, message, now, status=new)
                event.epoch = report.epoch
            await session.flush()
        if event is not None:
            self.bus.publish([convert.event_message(event)])

    async def request_cancel(self, job_ids: Sequence[int]) -> list[tuple[int, str | None, int]]:
        """Marks jobs for cancellation; returns (job_id, controller_id, epoch) of those not done."""
        now = self.clock()
        out: list[tuple[int, str | None, int]] = []
        events: list[EventRow] = []
        async with self.db.write() as session:
            rows = await session.scalars(
                select(JobRow).where(JobRow.id.in_(job_ids), JobRow.schedule_state != St.DONE)
            )
            for row in rows:
                if not row.cancel_requested:
                    row.cancel_requested = True
                    events.append(
                        self._event(session, row, row.current_task, "cancel requested", now)
                    )
                out.append((row.id, row.controller_id, row.epoch))
            await session.flush()
        self.bus.publish(convert.event_message(e) for e in events)
        return out

    async def cancel_unstarted(self, job_id: int) -> bool:
        """Cancels a job no replica holds yet, at once: every task CANCELLED, job DONE."""
        now = self.clock()
        async with self.db.write() as session:
            result = await session.execute(
                update(JobRow)
                .where(
                    JobRow.id == job_id,
                    JobRow.schedule_state.in_([St.INACTIVE, St.WAITING]),
                )
                .values(
                    schedule_state=St.DONE,
                    status=S.CANCELLED,
                    end_time=now,
                    wait_reason="",
                    cancel_requested=True,
                )
                .returning(JobRow.id)
            )
            if result.first() is None:
                return False
            await session.execute(
                update(TaskRow)
                .where(TaskRow.job_id == job_id)
                .values(status=S.CANCELLED, end_time=now)
            )
            row = await session.get(JobRow, job_id)
            assert row is not None
            event = self._event(session, row, row.current_task, "cancelled before start", now)
            await session.flush()
        self.bus.publish([convert.event_message(event)])
        return True

    async def finish(self, job_id: int, epoch: int, controller_id: str) -> Move | None:
        """The replica finished the lifecycle: the job is DONE.

        A task the lifecycle left unfinished would break "every job ends in one
        terminal status", so it is closed here: CANCELLED if a cancel was
        requested, else FAILED_CONTROLLER.
        """
        now = self.clock()
        async with self.db.write() as session:
            job = await session.get(JobRow, job_id, with_for_update=True)
            if job is None or job.epoch != epoch or job.controller_id != controller_id:
                raise StaleReport(f"job {job_id}: epoch {epoch} is not current")
            if job.schedule_state == St.DONE:
                return None
            tasks = (await self._tasks(session, [job_id])).get(job_id, [])
            for task in tasks:
                if task.status not in TERMINAL:
                    task.status = S.CANCELLED if job.cancel_requested else S.FAILED_CONTROLLER
                    task.end_time = now
                    if task.status == S.FAILED_CONTROLLER:
                        task.failure_reason = "the lifecycle ended without a final status"
            prior = job.schedule_state
            job.status, job.current_task = job_status(tasks)
            job.schedule_state = schedule_transition(job.schedule_state, St.DONE)
            job.end_time = now
            job.wait_reason = ""
            event = self._event(session, job, job.current_task, "done", now)
            event.epoch = epoch
            await session.flush()
        self.bus.publish([convert.event_message(event)])
        return Move(job_id, controller_id, controller_id, epoch, prior, St.DONE)

    def _event(
        self,
        session: AsyncSession,
        job: JobRow,
        task_id: int,
        message: str,
        now: dt.datetime,
        status: JobStatus | None = None,
    ) -> EventRow:
        event = EventRow(
            job_id=job.id,
            task_id=task_id,
            status=status if status is not None else job.status,
            schedule_state=job.schedule_state,
            time=now,
            message=message,
            epoch=0,
        )
        session.add(event)
        return event


ALIVE_LIST = (St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING)


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
    }


def _allowed(old: ScheduleState, new: ScheduleState) -> bool:
    try:
        schedule_transition(old, new)
    except IllegalTransition:
        return False
    return True
