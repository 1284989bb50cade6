"""The scheduler's records: one door in (`Store.transaction`), one door out (the hooks).

Every write goes through `transaction(body)`: `body` is a plain synchronous
function of a `Txn` (its connection, its clock reading) that runs SQLAlchemy
Core statements, run whole in one transaction by the database (`db/`). A
transaction records the events it writes and the schedule-state moves it makes
(`Txn.event`, `Txn.moves`); exactly when it has committed, even if its caller
was cancelled meanwhile, the store publishes the events to watchers and hands
the moves to `on_moves`, the one place the admission counters follow. Nothing
else changes a counter, so counters and the database cannot drift apart by a
forgotten call; a transaction whose outcome is unknown (its COMMIT failed) has
the database call its `on_doubt`, and the counters are reconciled with a recount.

Invariants kept here, whatever the caller does:
- A schedule-state change is one conditional UPDATE (from-state and, for a
  replica's request, its epoch and controller in the WHERE clause); its row count
  is the answer. Never read-then-write.
- A task status only changes along `TASK_TRANSITIONS` (`set_task_status`, or a
  conditional bulk UPDATE from `task_sources`).
- Every change writes an event row in the same transaction, each task's status
  change its own (a job that ends writes one per task it ends, `end_events`). An
  assignment's event carries the new epoch; a replica's report carries the
  report's epoch; a move of a held job (a launch slot requested, granted or given
  back, a release) carries the job's epoch at the move. Only the scheduler's own
  events of jobs no replica holds carry 0.

Reports from replicas are applied in `reports.py`, cancels in `cancels.py`; both
use this module's transactions and helpers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Connection, Row, Select, Table, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.event_messages import SUBMITTED
from services.common.statuses import (
    TASK_TRANSITIONS,
    IllegalTransition,
    JobStatus,
    ScheduleState,
    schedule_transition,
    task_sources,
)
from services.scheduler import convert
from services.scheduler.db import Database
from services.scheduler.db.id_lists import ids_param, in_ids
from services.scheduler.db.models import (
    ATTEMPTS,
    EVENTS,
    JOBS,
    SECRETS,
    TASKS,
    JobRow,
    TaskRow,
)
from services.scheduler.db.rows import Tracked, write_back
from services.scheduler.events import EventBus
from services.scheduler.spec.parse import resources_summary

log = logging.getLogger(__name__)

T = TypeVar("T")
# Ids per `IN (...)` list (see `chunked`).
IN_CHUNK = 1000
# PostgreSQL plans by the statistics ANALYZE gathers. A table that grew since they were
# gathered is planned as if it were still small: a batch's idempotency keys were looked
# up by reading every job of the user (seconds per batch at 100,000 jobs). Autovacuum
# gathers them when it runs, if it runs; the store also does after the first
# ANALYZE_FIRST jobs it inserts, then each time that count grew ANALYZE_GROWTH times.
ANALYZE_FIRST = 1000
ANALYZE_GROWTH = 4
ANALYZE = "ANALYZE jobs, tasks, attempts, events"

S = JobStatus
St = ScheduleState
ALIVE_LIST = (St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING)


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
    # One map per task (may be empty); stored apart, only ever sent with an assignment.
    secrets: Sequence[dict[str, str]] = ()
    timeouts: job_pb2.JobTimeouts | None = None


@dataclasses.dataclass(frozen=True)
class Move:
    """A schedule-state change that happened, as the counters see it."""

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


# The statements of the hot paths (a submission, an admission pass, a report), built once
# with bound parameters: building a statement costs more than running it. Their columns
# are the tables' own, not the ORM's. Lists of ids are one JSON parameter each
# (`id_lists.in_ids`): one statement text whatever the list's length.
J = JOBS.c
E = EVENTS.c
IDS = ids_param("ids")


def _queue(*where: Any) -> Select[int, int, int, str | None, ScheduleState]:
    """Queued jobs in admission order: priority, then submission."""
    return (
        select(J.id, J.priority, J.epoch, J.controller_id, J.schedule_state)
        .where(*where)
        .order_by(J.priority.desc(), J.id)
        .limit(bindparam("limit"))
    )


QUEUED = _queue(J.schedule_state == bindparam("state"))
QUEUED_HELD = _queue(J.schedule_state == bindparam("state"), J.controller_id == bindparam("cid"))
INSERT_JOBS = insert(JOBS).returning(J.id, sort_by_parameter_order=True)
INSERT_TASKS = insert(TASKS)
INSERT_SECRETS = insert(SECRETS)
# Users first: the unique index on (user, key) serves the lookup.
KEYED_JOBS = select(J.id, J.user, J.idempotency_key).where(
    J.user.in_(bindparam("users", expanding=True)),
    J.idempotency_key.in_(bindparam("keys", expanding=True)),
)
INSERT_EVENTS = insert(EVENTS).returning(EVENTS.c.id, sort_by_parameter_order=True)
SELECT_JOBS = select(JOBS).where(in_ids(J.id, param=IDS))
SELECT_TASKS = select(TASKS).where(in_ids(TASKS.c.job_id, param=IDS))
SELECT_TASKS_NO_SPECS = select(*(c for c in TASKS.c if c.name != "spec")).where(
    in_ids(TASKS.c.job_id, param=IDS)
)


def _moves(*returning: Any) -> dict[tuple[bool, bool], Any]:
    """Schedule-state moves of many jobs, conditional UPDATEs (see the module's
    invariants), returning `returning`: by (assigning, held by a given replica)."""
    moving = update(JOBS).where(in_ids(J.id, param=IDS), J.schedule_state == bindparam("old"))
    plain = moving.values(schedule_state=bindparam("new"), wait_reason="").returning(*returning)
    # Assigning hands the jobs to a replica with the next epoch (whose reports are numbered
    # afresh); only jobs nobody holds.
    assign = (
        moving.where(J.controller_id.is_(None))
        .values(
            schedule_state=bindparam("new"),
            wait_reason="",
            controller_id=bindparam("to"),
            epoch=J.epoch + 1,
            report_seq=0,
        )
        .returning(*returning)
    )
    held = plain.where(J.controller_id == bindparam("cid"))
    return {(False, False): plain, (True, False): assign, (False, True): held}


MOVES = _moves(J.id, J.epoch, J.status, J.current_task)
# The same, returning the whole rows of the moved jobs (what their assignment sends).
MOVES_FETCHING = _moves(*JOBS.c)
MOVE_ONE = (
    update(JOBS)
    .where(
        J.id == bindparam("job_id"),
        J.schedule_state == bindparam("old"),
        J.epoch == bindparam("at_epoch"),
        J.controller_id == bindparam("cid"),
    )
    .values(schedule_state=bindparam("new"))
    .returning(J.status, J.current_task)
)
MOVE_ONE_WITH_REASON = MOVE_ONE.values(wait_reason=bindparam("reason"))
ORPHANS = _queue(J.controller_id.is_(None), J.schedule_state.in_(list(ALIVE_LIST)))
ALIVE_WAITING_ON = _queue(
    J.schedule_state == St.ALIVE_WAITING, J.controller_id.in_(bindparam("cids", expanding=True))
)
SELECT_SECRETS = select(SECRETS.c.job_id, SECRETS.c.data).where(in_ids(SECRETS.c.job_id, param=IDS))
JOB_ATTEMPTS = select(ATTEMPTS).where(ATTEMPTS.c.job_id == bindparam("job_id"))
OWNERS = select(J.id, J.user).where(in_ids(J.id, param=IDS))


@functools.cache
def _list_query(ids: bool, statuses: bool, user: bool, name: bool, before: bool) -> Select[Any]:
    """ListJobs' query (newest first) with the filters given, built once per combination
    (the logs service asks for jobs by id with every new job's first lines)."""
    query = select(JOBS).order_by(J.id.desc()).limit(bindparam("limit"))
    if ids:
        query = query.where(in_ids(J.id, param=IDS))
    if statuses:
        query = query.where(J.status.in_(bindparam("statuses", expanding=True)))
    if user:
        query = query.where(J.user == bindparam("user"))
    if name:
        query = query.where(J.name == bindparam("name"))
    if before:
        query = query.where(J.id < bindparam("before_id"))
    return query


class StaleReport(Exception):
    """A report whose epoch or controller is not the job's current assignment."""


@dataclasses.dataclass
class Txn:
    """One write transaction: its connection, its clock reading, what it wrote."""

    conn: Connection
    now: dt.datetime
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    moves: list[Move] = dataclasses.field(default_factory=list)
    # Run on the event loop once the transaction committed, in commit order (metrics,
    # messages to replicas that depend on the commit).
    after: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    # The events as written, with their ids (set as the transaction ends).
    published: list[job_pb2.JobEvent] = dataclasses.field(default_factory=list)
    # What a writer read up front for the rest of the transaction (e.g. a batch's rows).
    cache: dict[str, object] = dataclasses.field(default_factory=dict)
    # Rows read as plain values and changed in Python (`rows.py`): written back before a
    # statement that may read or move them, and before the commit.
    tracked: list[Tracked] = dataclasses.field(default_factory=list)

    def track(self, table: Table, values: dict[str, Any]) -> Tracked:
        """A row read in this transaction (`rows.values_of`), as a `Tracked` row it writes
        back."""
        tracked = Tracked(table, values)
        self.tracked.append(tracked)
        return tracked

    def track_new(self, table: Table, **values: Any) -> Tracked:
        """A row this transaction inserts (when it writes back)."""
        tracked = Tracked.new(table, **values)
        self.tracked.append(tracked)
        return tracked

    def write_back(self) -> None:
        """Writes the tracked rows' changes (and new rows) now."""
        write_back(self.conn, self.tracked)

    def event(
        self,
        job_id: int,
        task_id: int,
        status: JobStatus,
        schedule_state: ScheduleState,
        message: str,
        epoch: int = 0,
    ) -> None:
        self.events.append(
            {
                "job_id": job_id,
                "task_id": task_id,
                "status": status,
                "schedule_state": schedule_state,
                "time": self.now,
                "message": message,
                "epoch": epoch,
            }
        )

    def order_events(self, start: int, job_ids: Sequence[int]) -> None:
        """Puts the events written since `start` in the order of their jobs in `job_ids`
        (a job's own events keep theirs): moves grouped into one statement per replica
        are still logged in the order they were decided."""
        rank = {job_id: index for index, job_id in enumerate(job_ids)}
        self.events[start:] = sorted(
            self.events[start:], key=lambda e: rank.get(e["job_id"], len(rank))
        )


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


def end_events(
    txn: Txn,
    ended: Iterable[tuple[int, int, JobStatus]],
    ends: Iterable[tuple[int, int, JobStatus]],
    before: ScheduleState,
    message: str,
    epoch: int = 0,
) -> None:
    """The events of jobs that end in `txn` (contract §4: every change is an event).

    `ended`: (job_id, task_id, new status) of each task the end moved; `ends`: (job_id,
    the task the job shows, the job's status) of each job. Per job, in task order, an
    event for each task it moved other than the one it shows, with the job still in
    `before`; then its end, naming the task it shows: its one event in DONE, and its last.
    """
    moved: dict[int, list[tuple[int, JobStatus]]] = {}
    for job_id, task_id, status in ended:
        moved.setdefault(job_id, []).append((task_id, status))
    for job_id, shown, status in ends:
        for task_id, new in sorted(moved.get(job_id, ())):
            if task_id != shown:
                txn.event(job_id, task_id, new, before, message, epoch)
        txn.event(job_id, shown, status, St.DONE, message, epoch)


def end_unstarted(
    txn: Txn, job_ids: Sequence[int], first: JobStatus, message: str, **first_values: Any
) -> None:
    """Ends WAITING jobs (every task still PENDING) that the jobs table has made DONE: the
    first task becomes `first` (with `first_values`), the others CANCELLED, each with
    its event, then the job's end (`end_events`)."""
    ended: list[tuple[int, int, JobStatus]] = []
    if first != S.CANCELLED:
        moved = set_task_statuses(
            txn, job_ids, [S.PENDING], first, task_id=0, end_time=txn.now, **first_values
        )
        ended += [(job_id, task_id, first) for job_id, task_id in moved]
    moved = set_task_statuses(txn, job_ids, [S.PENDING], S.CANCELLED, end_time=txn.now)
    ended += [(job_id, task_id, S.CANCELLED) for job_id, task_id in moved]
    end_events(txn, ended, [(job_id, 0, first) for job_id in job_ids], St.WAITING, message)
    txn.moves += [Move(job_id, None, None, 0, St.WAITING, St.DONE) for job_id in job_ids]


def chunked(items: Sequence[T], size: int = IN_CHUNK) -> list[Sequence[T]]:
    """`items` in slices of at most `size`, for lists of ids in statements: a cancel or a
    release may name more jobs, and each statement's list stays bounded."""
    return [items[start : start + size] for start in range(0, len(items), size)]


class Store:
    def __init__(
        self, db: Database, bus: EventBus, clock: Callable[[], dt.datetime] = utcnow
    ) -> None:
        self.db = db
        self.bus = bus
        self.clock = clock
        # The hook: set by the scheduler app (the counters and admission follow moves).
        self.on_moves: Callable[[Sequence[Move]], None] = lambda moves: None
        # PostgreSQL: jobs inserted by this store, and when statistics are next gathered.
        self._inserted = 0
        self._analyze_at = ANALYZE_FIRST
        self.analyzing: asyncio.Task[None] | None = None

    # --- the one door in ------------------------------------------------------------------

    async def transaction(self, body: Callable[[Txn], T], client: bool = False) -> T:
        """Runs `body` in a write transaction; its events and moves are published exactly
        when it committed.

        `client`: a client waits for it (a submission, a cancel), so it goes before
        waiting background work.

        Raises:
            OutcomeUnknown: the COMMIT failed; the counters are reconciled.
        """

        def run(conn: Connection) -> tuple[Txn, T]:
            txn = Txn(conn, self.clock())
            value = body(txn)
            txn.write_back()
            txn.published = _insert_events(conn, txn.events)
            return txn, value

        _, value = await self.db.write(run, client=client, committed=self._committed)
        return value

    def _committed(self, outcome: tuple[Txn, object]) -> None:
        txn = outcome[0]
        self.bus.publish(txn.published)
        if txn.moves:
            self.on_moves(txn.moves)
        for call in txn.after:
            call()

    async def read(self, body: Callable[[Connection], T]) -> T:
        """Runs `body` in a read transaction."""
        return await self.db.read(body)

    # --- submission -----------------------------------------------------------------------

    async def submit(self, job: NewJob) -> tuple[int, bool]:
        """Stores a job with its tasks and first event; returns (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
        """Stores jobs in one transaction, all of them or none; (job_id, created) for each.

        A job whose (user, idempotency key) was seen before, in the database or
        earlier in the same call, is not stored again: its answer is the first id.
        """
        body = functools.partial(insert_jobs, jobs=jobs)
        try:
            answers = await self.transaction(body, client=True)
        except IntegrityError:
            # Another writer stored one of the keys meanwhile: its job is the answer now.
            answers = await self.transaction(body, client=True)
        self._grew(sum(created for _, created in answers))
        return answers

    def _grew(self, inserted: int) -> None:
        """Counts inserted jobs; on PostgreSQL, gathers statistics when they grew enough."""
        self._inserted += inserted
        if self.db.is_sqlite or self._inserted < self._analyze_at:
            return
        if self.analyzing is not None and not self.analyzing.done():
            return
        self._analyze_at = self._inserted * ANALYZE_GROWTH
        self.analyzing = asyncio.create_task(self._analyze(), name="analyze")

    async def _analyze(self) -> None:
        try:
            await self.db.maintenance(ANALYZE)
        except (SQLAlchemyError, OSError) as error:
            log.warning("gathering table statistics failed", extra={"error": str(error)})
            return
        log.info("table statistics gathered", extra={"jobs_inserted": self._inserted})

    # --- queries --------------------------------------------------------------------------

    async def get_job(self, job_id: int, with_specs: bool = False) -> job_pb2.Job | None:
        """One job with its tasks and every task's attempts."""
        return await self.db.read(functools.partial(job_with_attempts, job_id=job_id,
                                                    with_specs=with_specs))  # fmt: skip

    async def get_jobs(self, job_ids: Sequence[int], with_specs: bool = False) -> list[job_pb2.Job]:
        return await self.db.read(lambda conn: job_messages(conn, list(job_ids), with_specs))

    async def secrets(self, job_ids: Sequence[int]) -> dict[int, list[pb.TaskSecrets]]:
        """The secrets of jobs that have any, per task: for their assignment only."""
        if not job_ids:
            return {}
        return await self.db.read(lambda conn: secrets_of(conn, job_ids))

    async def list_jobs(
        self,
        statuses: Iterable[JobStatus] = (),
        user: str = "",
        name: str = "",
        limit: int = 100,
        before_id: int = 0,
        job_ids: Sequence[int] = (),
    ) -> list[job_pb2.Job]:
        """Newest first; `before_id` continues a page; `job_ids`, when given, filters."""
        statuses = list(statuses)
        query = _list_query(bool(job_ids), bool(statuses), bool(user), bool(name), bool(before_id))
        params = {"limit": limit, "ids": list(job_ids), "statuses": statuses, "user": user,
                  "name": name, "before_id": before_id}  # fmt: skip

        def read(conn: Connection) -> list[job_pb2.Job]:
            return _with_tasks(conn, conn.execute(query, params).all(), with_specs=False)

        return await self.db.read(read)

    async def events_after(
        self, after_id: int, job_ids: Iterable[int] = (), user: str = "", limit: int = 1000
    ) -> list[job_pb2.JobEvent]:
        query = select(EVENTS).where(E.id > after_id).order_by(E.id).limit(limit)
        job_ids = list(job_ids)
        if job_ids:
            query = query.where(E.job_id.in_(job_ids))
        if user:
            query = query.where(E.job_id.in_(select(J.id).where(J.user == user)))
        return await self.db.read(
            lambda conn: [convert.event_message(r) for r in conn.execute(query)]
        )

    async def last_event_id(self) -> int:
        return int(await self.db.read(lambda conn: conn.scalar(select(func.max(E.id)))) or 0)

    async def job_owners(self, ids: Iterable[int]) -> dict[int, str]:
        """job_id -> user of the jobs that exist among `ids`."""
        params = {"ids": list(ids)}
        rows = await self.db.read(lambda conn: conn.execute(OWNERS, params).all())
        return {int(i): str(u) for i, u in rows}

    # --- admission ------------------------------------------------------------------------

    async def queued(
        self, state: ScheduleState, controller_id: str | None, limit: int
    ) -> list[Queued]:
        """Jobs in `state` in admission order (priority, then submission)."""
        return await self.db.read(lambda conn: queued_jobs(conn, state, controller_id, limit))

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
        count: int | None = await self.db.read(lambda conn: conn.scalar(query))
        return count or 0

    async def orphans(self, limit: int) -> list[Queued]:
        """Admitted jobs that no replica holds (their replica's lease expired)."""
        params = {"limit": limit}
        rows = await self.db.read(lambda conn: conn.execute(ORPHANS, params).all())
        return [Queued(*row) for row in rows]

    async def move_many(
        self,
        job_ids: Sequence[int],
        old: ScheduleState,
        new: ScheduleState,
        *,
        controller_id: str | None = None,
        assign_to: str | None = None,
        message: str = "",
    ) -> list[Move]:
        """Moves many jobs from `old` to `new` in a transaction of their own (`move_many`)."""
        moves, _ = await self.transaction(
            functools.partial(
                move_many,
                job_ids=job_ids,
                old=old,
                new=new,
                controller_id=controller_id,
                assign_to=assign_to,
                message=message,
            )
        )
        return moves

    async def move(
        self,
        job_id: int,
        old: ScheduleState,
        new: ScheduleState,
        *,
        epoch: int,
        controller_id: str,
        wait_reason: str | None = None,
        message: str = "",
    ) -> Move | None:
        """Moves a replica's job from `old` to `new` iff it is there at that epoch."""
        return await self.transaction(
            lambda txn: move_held(txn, job_id, old, new, epoch, controller_id, wait_reason, message)
        )

    async def status_counts(self) -> dict[JobStatus, int]:
        """Jobs per status, straight from the database."""
        query = select(JobRow.status, func.count()).group_by(JobRow.status)
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        return {S(s) if not isinstance(s, S) else s: int(n) for s, n in rows}

    async def recount(self) -> Counter[tuple[str | None, ScheduleState]]:
        """Jobs per (replica, schedule state), straight from the database."""
        query = select(JobRow.controller_id, JobRow.schedule_state, func.count()).group_by(
            JobRow.controller_id, JobRow.schedule_state
        )
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        return Counter({(c, St(s) if not isinstance(s, St) else s): int(n) for c, s, n in rows})

    async def held_by(self, controller_id: str) -> dict[int, int]:
        """job_id -> epoch of the unfinished jobs assigned to a replica."""
        query = select(JobRow.id, JobRow.epoch).where(
            JobRow.controller_id == controller_id, JobRow.schedule_state != St.DONE
        )
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        return {int(i): int(e) for i, e in rows}

    async def assignment(self, job_id: int) -> tuple[str | None, int] | None:
        """(controller_id, epoch) of a job, or None when it does not exist."""
        query = select(JobRow.controller_id, JobRow.epoch).where(JobRow.id == job_id)
        row = await self.db.read(lambda conn: conn.execute(query).first())
        return None if row is None else (row[0], int(row[1]))


# --- transaction bodies and the reads they share -------------------------------------------


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


def queued_jobs(
    conn: Connection, state: ScheduleState, controller_id: str | None, limit: int
) -> list[Queued]:
    """Jobs in `state` (held by `controller_id`, when given) in admission order."""
    if controller_id is None:
        rows = conn.execute(QUEUED, {"state": state, "limit": limit})
    else:
        rows = conn.execute(QUEUED_HELD, {"state": state, "cid": controller_id, "limit": limit})
    return [Queued(*row) for row in rows.all()]


def secrets_of(conn: Connection, job_ids: Sequence[int]) -> dict[int, list[pb.TaskSecrets]]:
    """The secrets of jobs that have any, per task."""
    if not job_ids:
        return {}
    rows = conn.execute(SELECT_SECRETS, {"ids": list(job_ids)}).all()
    return {
        int(job_id): [
            pb.TaskSecrets(task_id=task_id, secrets=values)
            for task_id, values in enumerate(json.loads(data))
            if values
        ]
        for job_id, data in rows
    }


def move_many(
    txn: Txn,
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

    Only jobs still in `old` (and held by `controller_id`, when given; by nobody when
    assigning) move; `assign_to` hands them to that replica with the next epoch.
    With `fetch`, the moved jobs (with their task specs, and the cancel flag as
    committed with the move) are read in the same transaction.
    """
    if not job_ids:
        return [], []
    schedule_transition(old, new)
    params = {"ids": list(job_ids), "old": old, "new": new}
    if assign_to is not None:
        params["to"] = assign_to
    elif controller_id is not None:
        params["cid"] = controller_id
    held = assign_to is None and controller_id is not None
    query = (MOVES_FETCHING if fetch else MOVES)[(assign_to is not None, held)]
    moves: list[Move] = []
    # In the order asked for (a database returns an UPDATE's rows in any order).
    rank = {job_id: index for index, job_id in enumerate(job_ids)}
    rows = sorted(
        txn.conn.execute(query, params).all(),
        key=lambda row: rank.get(row.id, len(rank)),
    )
    for row in rows:
        epoch = row.epoch
        # A held job's event carries its epoch (an assignment's, the new one), so the log
        # tells who held what and on whose behalf each move was made.
        held_by = assign_to or controller_id
        txn.event(row.id, row.current_task, row.status, new, message or new.name,
                  epoch if held_by else 0)  # fmt: skip
        moves.append(Move(int(row.id), controller_id, assign_to or controller_id, epoch, old, new))
    txn.moves += moves
    jobs: list[job_pb2.Job] = []
    if fetch and rows:
        # The rows as the UPDATE left them; their tasks with their specs.
        jobs = _with_tasks(txn.conn, rows, with_specs=True)
    return moves, jobs


def move_held(
    txn: Txn,
    job_id: int,
    old: ScheduleState,
    new: ScheduleState,
    epoch: int,
    controller_id: str,
    wait_reason: str | None = None,
    message: str = "",
) -> Move | None:
    """Moves a replica's job from `old` to `new` within `txn`, iff it is there at that epoch."""
    schedule_transition(old, new)
    params = {"job_id": job_id, "old": old, "at_epoch": epoch, "cid": controller_id, "new": new}
    query = MOVE_ONE
    if wait_reason is not None:
        query, params["reason"] = MOVE_ONE_WITH_REASON, wait_reason
    row = txn.conn.execute(query, params).first()
    if row is None:
        return None
    txn.event(job_id, row[1], row[0], new, message or new.name, epoch)
    move = Move(job_id, controller_id, controller_id, epoch, old, new)
    txn.moves.append(move)
    return move


def job_messages(
    conn: Connection, job_ids: list[int], with_specs: bool = True
) -> list[job_pb2.Job]:
    """Jobs with their tasks, read as plain rows (no ORM objects: this is a hot path)."""
    jobs = conn.execute(SELECT_JOBS, {"ids": job_ids}).all()
    return _with_tasks(conn, jobs, with_specs)


def job_with_attempts(conn: Connection, job_id: int, with_specs: bool) -> job_pb2.Job | None:
    """One job with its tasks and every task's attempts."""
    jobs = job_messages(conn, [job_id], with_specs)
    if not jobs:
        return None
    job = jobs[0]
    attempts = conn.execute(JOB_ATTEMPTS, {"job_id": job_id}).all()
    for row in sorted(attempts, key=lambda a: (a.task_id, a.attempt)):
        if 0 <= row.task_id < len(job.tasks):
            job.tasks[row.task_id].attempts.append(convert.attempt_message(row))
    return job


def _with_tasks(conn: Connection, jobs: Sequence[Row[Any]], with_specs: bool) -> list[job_pb2.Job]:
    tasks: dict[int, list[Row[Any]]] = {}
    if jobs:
        query = SELECT_TASKS if with_specs else SELECT_TASKS_NO_SPECS
        for task in conn.execute(query, {"ids": [j.id for j in jobs]}).all():
            tasks.setdefault(task._mapping["job_id"], []).append(task)
    return [convert.job_message(j, tasks.get(j._mapping["id"], []), with_specs) for j in jobs]


def _insert_events(conn: Connection, events: list[dict[str, Any]]) -> list[job_pb2.JobEvent]:
    if not events:
        return []
    ids = conn.scalars(INSERT_EVENTS, events).all()
    return [
        convert.event_message(convert.NewEvent(i, **values))
        for i, values in zip(ids, events, strict=True)
    ]


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
