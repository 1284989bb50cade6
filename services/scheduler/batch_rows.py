"""The rows a batch of reports shares: read up front, once, as plain values.

A batch reads every row its reports touch in four queries (`prefetch`): the jobs
(locked, FOR UPDATE on PostgreSQL), the tasks and attempts the reports name, and
the unfinished tasks of each job a report finishes. Each row is one `Tracked`
copy for the whole batch (`Loaded`), whichever query read it, so a later report
sees what an earlier one changed; a key looked up and absent is known absent.
A row no query read up front is read (and kept) when first asked for. The batch
writes back what changed with one UPDATE per table and set of changed columns
(`rows.py`), so its round trips to the database do not grow with its size.

Whether a replica holds a job is judged here too (`held_job`, `current`): a
report whose epoch or controller is not the job's assignment is `StaleReport`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import bindparam, select

from services.common.statuses import TERMINAL, ScheduleState
from services.common.test_switches import EPOCH_CHECK_AT_REPORT, disabled
from services.scheduler.db.id_lists import ids_param, in_ids
from services.scheduler.db.models import ATTEMPTS, JOBS, TASKS
from services.scheduler.db.rows import Tracked, values_of
from services.scheduler.queries import IDS
from services.scheduler.txn import Txn

St = ScheduleState

# Built once (see the queries' statements). Each key query also names the job ids: SQLite
# answers a row-value IN alone with a scan of the whole table, and with the job ids
# through the primary key.
KEYS = ids_param("keys")
T, A = TASKS.c, ATTEMPTS.c
LOAD_JOBS = select(JOBS).where(in_ids(JOBS.c.id, param=IDS)).with_for_update()
LOAD_TASKS = select(TASKS).where(
    in_ids(T.job_id, param=IDS), in_ids(T.job_id, T.task_id, param=KEYS)
)
LOAD_ATTEMPTS = select(ATTEMPTS).where(
    in_ids(A.job_id, param=IDS), in_ids(A.job_id, A.task_id, A.attempt, param=KEYS)
)
# The jobs' tasks not in a terminal status, locked.
UNFINISHED_TASKS = (
    select(TASKS)
    .where(in_ids(T.job_id, param=IDS), T.status.not_in(list(TERMINAL)))
    .with_for_update()
)
ASSIGNMENT = select(JOBS.c.controller_id, JOBS.c.epoch, JOBS.c.schedule_state).where(
    JOBS.c.id == bindparam("job_id")
)


class StaleReport(Exception):
    """A report whose epoch or controller is not the job's current assignment."""


@dataclasses.dataclass
class Wanted:
    """The keys of the rows a batch's reports touch, to read up front."""

    jobs: set[int] = dataclasses.field(default_factory=set)
    # Jobs a report finishes: their unfinished tasks too.
    finished: set[int] = dataclasses.field(default_factory=set)
    tasks: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    attempts: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Loaded:
    """Rows a batch read, by key (one `Tracked` per row, whichever query read it); a key
    looked up and absent is known absent."""

    txn: Txn
    jobs: dict[int, Tracked | None] = dataclasses.field(default_factory=dict)
    tasks: dict[tuple[int, int], Tracked | None] = dataclasses.field(default_factory=dict)
    attempts: dict[tuple[int, int, int], Tracked | None] = dataclasses.field(default_factory=dict)
    # The tasks not finished in the database, of each job a JobFinished names.
    unfinished: dict[int, list[Tracked]] = dataclasses.field(default_factory=dict)

    def task(self, values: dict[str, Any]) -> Tracked:
        """The batch's one copy of a task row read (the first read of it)."""
        key = (values["job_id"], values["task_id"])
        task = self.tasks.get(key)
        if task is None:
            task = self.tasks[key] = self.txn.track(TASKS, values)
        return task


def loaded(txn: Txn) -> Loaded:
    """The rows `txn` has read for its reports so far."""
    found = txn.cache.get("reports")
    if not isinstance(found, Loaded):
        found = txn.cache["reports"] = Loaded(txn)
    return found


def prefetch(txn: Txn, wanted: Wanted) -> None:
    """Loads the jobs, tasks and attempts `wanted`, locking the jobs.

    Later reads of these keys in the transaction need no round trip, found or not.
    """
    job_ids = wanted.jobs | wanted.finished
    if not job_ids:
        return
    conn = txn.conn
    rows = loaded(txn)
    jobs_in = sorted(job_ids)
    found_jobs = values_of(conn.execute(LOAD_JOBS, {"ids": jobs_in}))
    rows.jobs.update(dict.fromkeys(job_ids))
    rows.jobs.update((job["id"], txn.track(JOBS, job)) for job in found_jobs)
    if wanted.tasks:
        params = {"ids": jobs_in, "keys": sorted(wanted.tasks)}
        rows.tasks.update(dict.fromkeys(wanted.tasks))
        for row in values_of(conn.execute(LOAD_TASKS, params)):
            rows.task(row)
    if wanted.attempts:
        params = {"ids": jobs_in, "keys": sorted(wanted.attempts)}
        rows.attempts.update(dict.fromkeys(wanted.attempts))
        for row in values_of(conn.execute(LOAD_ATTEMPTS, params)):
            key = (row["job_id"], row["task_id"], row["attempt"])
            rows.attempts[key] = txn.track(ATTEMPTS, row)
    if wanted.finished:
        unfinished: dict[int, list[Tracked]] = {job_id: [] for job_id in wanted.finished}
        params = {"ids": sorted(wanted.finished)}
        for row in values_of(conn.execute(UNFINISHED_TASKS, params)):
            unfinished[row["job_id"]].append(rows.task(row))
        rows.unfinished.update(unfinished)


def current(txn: Txn, job_id: int, epoch: int, cid: str) -> ScheduleState:
    """The job's schedule state, if it is assigned to `cid` at `epoch`.

    Raises:
        StaleReport: it is not.
    """
    row = (txn.conn.execute(ASSIGNMENT, {"job_id": job_id})).first()
    if row is None or row[0] != cid or int(row[1]) != epoch:
        raise StaleReport(f"job {job_id}: epoch {epoch} is not current")
    return St(row[2])


def held_job(txn: Txn, job_id: int, epoch: int, cid: str, applying: bool = False) -> Tracked:
    """The job, if `cid` holds it at `epoch` (`applying` a report: whatever its epoch, under
    the test-only switch that turns that check off).

    Raises:
        StaleReport: it does not.
    """
    # Locked by `prefetch` (FOR UPDATE on PostgreSQL) when the batch read it.
    rows = loaded(txn)
    if job_id in rows.jobs:
        job = rows.jobs[job_id]
    else:
        found = values_of(txn.conn.execute(LOAD_JOBS, {"ids": [job_id]}))
        job = rows.jobs[job_id] = txn.track(JOBS, found[0]) if found else None
    unchecked = applying and disabled(EPOCH_CHECK_AT_REPORT)
    if job is None or (not unchecked and (job.epoch != epoch or job.controller_id != cid)):
        raise StaleReport(f"job {job_id}: epoch {epoch} is not current")
    return job


def task(txn: Txn, job_id: int, task_id: int) -> Tracked | None:
    """A task of the batch's, locked; None when the job has no such task."""
    rows = loaded(txn)
    key = (job_id, task_id)
    if key not in rows.tasks:
        params = {"ids": [job_id], "keys": [key]}
        found = values_of(txn.conn.execute(LOAD_TASKS.with_for_update(), params))
        rows.tasks[key] = rows.task(found[0]) if found else None
    return rows.tasks[key]


def attempt(txn: Txn, key: tuple[int, int, int]) -> Tracked | None:
    """An attempt's row (job, task, attempt) of the batch's; None when there is none yet."""
    rows = loaded(txn)
    if key not in rows.attempts:
        params = {"ids": [key[0]], "keys": [key]}
        found = values_of(txn.conn.execute(LOAD_ATTEMPTS, params))
        rows.attempts[key] = txn.track(ATTEMPTS, found[0]) if found else None
    return rows.attempts[key]


def unfinished_tasks(txn: Txn, job_id: int) -> list[Tracked]:
    """The tasks of the job not finished in the database (those finished earlier in the
    batch included: the query saw the stored status)."""
    rows = loaded(txn)
    if job_id in rows.unfinished:
        return rows.unfinished[job_id]
    found = values_of(txn.conn.execute(UNFINISHED_TASKS, {"ids": [job_id]}))
    return [rows.task(row) for row in found]
