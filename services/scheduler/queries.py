"""The scheduler's reads: jobs for the API, the queue for admission, counts for the counters.

Each read is a plain synchronous function of a connection, run whole in one read
transaction (`store.Store.read`) or inside a write transaction that needs it.
Jobs are read as plain rows and made into messages (`convert.py`), never through
ORM objects: these are hot paths.

The queue's order is admission's (contract §5): ALIVE_WAITING before WAITING,
each by priority, then submission; an index serves each such read without a
sort of the whole schedule state (`tests/scheduler/test_store.py`).
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, Select, bindparam, func, select

from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import convert
from services.scheduler.db.id_lists import ids_param, in_ids
from services.scheduler.db.models import ATTEMPTS, EVENTS, JOBS, SECRETS, TASKS, JobRow

S = JobStatus
St = ScheduleState
ALIVE_LIST = (St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING)


class Queued(NamedTuple):
    """What admission needs of a queued job."""

    id: int
    priority: int
    epoch: int
    controller_id: str | None
    schedule_state: ScheduleState


# The statements of the hot paths, built once with bound parameters: building a statement
# costs more than running it. Their columns are the tables' own, not the ORM's. Lists of
# ids are one JSON parameter each (`id_lists.in_ids`): one statement text whatever the
# list's length.
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
ORPHANS = _queue(J.controller_id.is_(None), J.schedule_state.in_(list(ALIVE_LIST)))
ALIVE_WAITING_ON = _queue(
    J.schedule_state == St.ALIVE_WAITING, J.controller_id.in_(bindparam("cids", expanding=True))
)
SELECT_JOBS = select(JOBS).where(in_ids(J.id, param=IDS))
SELECT_TASKS = select(TASKS).where(in_ids(TASKS.c.job_id, param=IDS))
SELECT_TASKS_NO_SPECS = select(*(c for c in TASKS.c if c.name != "spec")).where(
    in_ids(TASKS.c.job_id, param=IDS)
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


# --- jobs -----------------------------------------------------------------------------------


def jobs(conn: Connection, job_ids: Sequence[int], with_specs: bool = False) -> list[job_pb2.Job]:
    """Jobs with their tasks (and the tasks' specs `with_specs`)."""
    rows = conn.execute(SELECT_JOBS, {"ids": list(job_ids)}).all()
    return with_tasks(conn, rows, with_specs)


def job(conn: Connection, job_id: int, with_specs: bool = False) -> job_pb2.Job | None:
    """One job with its tasks and every task's attempts; None when there is no such job."""
    found = jobs(conn, [job_id], with_specs)
    if not found:
        return None
    attempts = conn.execute(JOB_ATTEMPTS, {"job_id": job_id}).all()
    for row in sorted(attempts, key=lambda a: (a.task_id, a.attempt)):
        if 0 <= row.task_id < len(found[0].tasks):
            found[0].tasks[row.task_id].attempts.append(convert.attempt_message(row))
    return found[0]


def with_tasks(conn: Connection, rows: Sequence[Row[Any]], with_specs: bool) -> list[job_pb2.Job]:
    """Rows of the jobs table as messages, with their tasks."""
    tasks: dict[int, list[Row[Any]]] = {}
    if rows:
        query = SELECT_TASKS if with_specs else SELECT_TASKS_NO_SPECS
        for task in conn.execute(query, {"ids": [j.id for j in rows]}).all():
            tasks.setdefault(task._mapping["job_id"], []).append(task)
    return [convert.job_message(j, tasks.get(j._mapping["id"], []), with_specs) for j in rows]


def list_jobs(
    conn: Connection,
    statuses: Sequence[JobStatus] = (),
    user: str = "",
    name: str = "",
    limit: int = 100,
    before_id: int = 0,
    job_ids: Sequence[int] = (),
) -> list[job_pb2.Job]:
    """Newest first; `before_id` continues a page; `job_ids`, when given, filters."""
    query = _list_query(bool(job_ids), bool(statuses), bool(user), bool(name), bool(before_id))
    params = {"limit": limit, "ids": list(job_ids), "statuses": list(statuses), "user": user,
              "name": name, "before_id": before_id}  # fmt: skip
    return with_tasks(conn, conn.execute(query, params).all(), with_specs=False)


def secrets_of(conn: Connection, job_ids: Sequence[int]) -> dict[int, list[pb.TaskSecrets]]:
    """The secrets of jobs that have any, per task: for their assignment only."""
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


def job_owners(conn: Connection, ids: Iterable[int]) -> dict[int, str]:
    """job_id -> user of the jobs that exist among `ids`."""
    rows = conn.execute(OWNERS, {"ids": list(ids)}).all()
    return {int(i): str(u) for i, u in rows}


# --- events ---------------------------------------------------------------------------------


def events_after(
    conn: Connection,
    after_id: int,
    job_ids: Iterable[int] = (),
    user: str = "",
    limit: int = 1000,
) -> list[job_pb2.JobEvent]:
    """Events after `after_id` in id order (of `job_ids`, of `user`'s jobs, when given)."""
    query = select(EVENTS).where(E.id > after_id).order_by(E.id).limit(limit)
    ids = list(job_ids)
    if ids:
        query = query.where(E.job_id.in_(ids))
    if user:
        query = query.where(E.job_id.in_(select(J.id).where(J.user == user)))
    return [convert.event_message(r) for r in conn.execute(query)]


def last_event_id(conn: Connection) -> int:
    return int(conn.scalar(select(func.max(E.id))) or 0)


# --- the queue ------------------------------------------------------------------------------


def queued_jobs(
    conn: Connection, state: ScheduleState, controller_id: str | None, limit: int
) -> list[Queued]:
    """Jobs in `state` (held by `controller_id`, when given) in admission order."""
    if controller_id is None:
        rows = conn.execute(QUEUED, {"state": state, "limit": limit})
    else:
        rows = conn.execute(QUEUED_HELD, {"state": state, "cid": controller_id, "limit": limit})
    return [Queued(*row) for row in rows.all()]


def orphans(conn: Connection, limit: int) -> list[Queued]:
    """Admitted jobs that no replica holds (their replica's lease expired)."""
    return [Queued(*row) for row in conn.execute(ORPHANS, {"limit": limit}).all()]


def ahead_of(conn: Connection, job_id: int, priority: int) -> int:
    """How many queued jobs rank ahead of this WAITING one (ALIVE_WAITING first, then
    higher priority, then earlier submission)."""
    ahead = (JobRow.priority > priority) | ((JobRow.priority == priority) & (JobRow.id < job_id))
    query = select(func.count()).where(
        (JobRow.schedule_state == St.ALIVE_WAITING)
        | ((JobRow.schedule_state == St.WAITING) & ahead)
    )
    return int(conn.scalar(query) or 0)


# --- counts and holdings --------------------------------------------------------------------


def status_counts(conn: Connection) -> dict[JobStatus, int]:
    """Jobs per status."""
    query = select(JobRow.status, func.count()).group_by(JobRow.status)
    return {S(s) if not isinstance(s, S) else s: int(n) for s, n in conn.execute(query).all()}


def recount(conn: Connection) -> Counter[tuple[str | None, ScheduleState]]:
    """Jobs per (replica, schedule state)."""
    query = select(JobRow.controller_id, JobRow.schedule_state, func.count()).group_by(
        JobRow.controller_id, JobRow.schedule_state
    )
    rows = conn.execute(query).all()
    return Counter({(c, St(s) if not isinstance(s, St) else s): int(n) for c, s, n in rows})


def held_by(conn: Connection, controller_id: str) -> dict[int, int]:
    """job_id -> epoch of the unfinished jobs assigned to a replica."""
    query = select(JobRow.id, JobRow.epoch).where(
        JobRow.controller_id == controller_id, JobRow.schedule_state != St.DONE
    )
    return {int(i): int(e) for i, e in conn.execute(query).all()}
