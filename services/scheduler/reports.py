"""What replicas report, applied to the database (contract §9).

A replica's reports (task transitions, launch-slot requests and releases, a
finished lifecycle, handed-back jobs) are applied in batches: one transaction
for many reports, in the order they arrived, so a burst of reports from many
jobs costs one commit. Each report is judged on its own inside the batch:

- a report whose epoch or controller is not the job's current assignment is
  refused as STALE (the replica must stop acting for the job, and is told so);
- a report that breaks a rule (a transition `TASK_TRANSITIONS` forbids, a task
  that does not exist, a field out of range: an unknown status, a negative count,
  a time outside 1970-9999) is refused as INVALID (the replica ends the job
  FAILED_CONTROLLER rather than pretend it was moved away);
- a report about a job applied before (its number, `seq`, is not
  above the job's `report_seq`: the replica sent it again on a new stream, its
  ack lost with the old one) is acknowledged as a replay and not applied twice;
- anything else is applied, and the job keeps its number in the same transaction.
  Nothing is written for a refused report: every field is checked (`checked`)
  before the first write.

Texts a report carries (messages, reasons, a region) are made storable rather than
refused (cut to their bounds, a NUL character replaced): a long message is no
reason to fail a job, nor to fail the batch it came in.

Every status change costs O(1) in the length of the chain: the job row keeps the
index of its current task, so a transition reads and writes the job, the task,
and at most the next task. A batch reads every row its reports touch in four
queries up front (`_prefetch`), as plain values (`rows.Tracked`, not ORM objects),
and writes back what changed with one UPDATE per table and set of changed columns,
each run once for all its rows, so its cost in round trips to the database does
not grow with its size.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, select, update

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.bounds import MAX_TASKS, check_timestamp, quote
from services.common.errors import bound
from services.common.event_messages import HANDED_BACK, RELEASED
from services.common.statuses import (
    FAILED_GROUP,
    TERMINAL,
    IllegalTransition,
    JobStatus,
    ScheduleState,
    schedule_transition,
)
from services.common.test_switches import EPOCH_CHECK_AT_REPORT, disabled
from services.scheduler import convert, metrics
from services.scheduler.db.id_lists import ids_param, in_ids
from services.scheduler.db.models import ATTEMPTS, JOBS, TASKS, JobRow
from services.scheduler.db.rows import Tracked, values_of
from services.scheduler.store import (
    IDS,
    Move,
    StaleReport,
    Store,
    Txn,
    chunked,
    end_events,
    move_held,
    set_task_status,
    set_task_statuses,
)

S = JobStatus
St = ScheduleState
NO_FINAL_STATUS = "the lifecycle ended without a final status"
# Bytes kept of each text of a report (a message, a reason, a condition).
MAX_REPORT_TEXT = 16 * 1024
# The columns of a task's cluster name and region (characters).
MAX_CLUSTER_NAME = 128
MAX_REGION = 64

# A batch's reads, built once (see the store's statements). Each key query also names
# the job ids: SQLite answers a row-value IN alone with a scan of the whole table, and
# with the job ids through the primary key.
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
# The reports about one job, whose numbers the job keeps (a replay of one is not applied).
NUMBERED = frozenset({"transition", "launch_slot_request", "launch_slot_release", "job_finished"})


class Refusal(enum.IntEnum):
    NONE = pb.REPORT_REFUSAL_UNSPECIFIED
    STALE = pb.REPORT_REFUSAL_STALE_EPOCH
    INVALID = pb.REPORT_REFUSAL_INVALID


@dataclasses.dataclass
class Applied:
    """The outcome of a batch: an ack per report, and what to tell the replica after commit."""

    acks: list[pb.ReportAck] = dataclasses.field(default_factory=list)
    # (job_id, epoch): a repeated slot request of a job that holds its slot: grant again.
    grants: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (job_id, epoch): stale reports; the replica must stop acting for these.
    revokes: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class Reports:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.refused_stale = 0
        self.refused_invalid = 0
        self.replayed = 0

    async def apply(
        self, controller_id: str, requests: Sequence[pb.ConnectControllerRequest]
    ) -> Applied:
        """Applies a replica's reports, in order, in one transaction."""
        return await self.store.transaction(
            functools.partial(self._apply, controller_id=controller_id, requests=requests)
        )

    def _apply(
        self, txn: Txn, controller_id: str, requests: Sequence[pb.ConnectControllerRequest]
    ) -> Applied:
        applied = Applied()
        _prefetch(txn, requests)
        for request in requests:
            kind = request.WhichOneof("message") or "empty"
            if kind != "transition":
                # Its statements read or move rows earlier reports changed.
                txn.write_back()
            job = _numbered_job(txn, controller_id, request)
            if job is not None and 0 < request.seq <= job.report_seq:
                txn.after.append(functools.partial(self._counted, kind, Refusal.NONE, True))
                reason = f"a replay: report {request.seq} of job {job.id} was applied before"
                applied.acks.append(
                    pb.ReportAck(ack_seq=request.seq, accepted=True, reason=reason, replay=True)
                )
                continue
            refusal, reason = self._one(txn, controller_id, request, applied)
            if refusal == Refusal.STALE:
                applied.revokes.append(_job_of(request))
            elif refusal == Refusal.NONE and job is not None:
                job.report_seq = request.seq
            txn.after.append(functools.partial(self._counted, kind, refusal))
            applied.acks.append(
                pb.ReportAck(
                    ack_seq=request.seq,
                    accepted=refusal == Refusal.NONE,
                    reason=reason,
                    refusal=int(refusal),  # type: ignore[arg-type]
                )
            )
        return applied

    def _counted(self, kind: str, refusal: Refusal, replay: bool = False) -> None:
        """Counts a report once its batch committed (on the event loop)."""
        if replay:
            self.replayed += 1
            metrics.replayed(kind)
        if refusal == Refusal.STALE:
            self.refused_stale += 1
        elif refusal == Refusal.INVALID:
            self.refused_invalid += 1
        metrics.reported(kind, "" if refusal == Refusal.NONE else refusal.name.lower())

    def _one(
        self, txn: Txn, cid: str, request: pb.ConnectControllerRequest, applied: Applied
    ) -> tuple[Refusal, str]:
        kind = request.WhichOneof("message")
        try:
            if request.seq <= 0:
                raise ValueError(f"seq: a report is numbered from 1, got {request.seq}")
            request = checked(request)
            if kind == "transition":
                transition(txn, cid, request.transition)
            elif kind == "launch_slot_request":
                r = request.launch_slot_request
                reason = r.reason or "waiting for a launch slot"
                move = move_held(
                    txn, r.job_id, St.ALIVE, St.ALIVE_WAITING, r.epoch, cid, reason,
                    "launch slot requested",
                )  # fmt: skip
                if move is None and _current(txn, r.job_id, r.epoch, cid) == St.LAUNCHING:
                    # Already holds a slot (a repeated request): grant again.
                    applied.grants.append((r.job_id, r.epoch))
            elif kind == "launch_slot_release":
                r2 = request.launch_slot_release
                move = move_held(
                    txn, r2.job_id, St.LAUNCHING, St.ALIVE, r2.epoch, cid, r2.wait_reason,
                    r2.wait_reason or "launched",
                )  # fmt: skip
                if move is None:
                    # A repeat is harmless; a stale epoch is not.
                    _current(txn, r2.job_id, r2.epoch, cid)
            elif kind == "job_finished":
                r3 = request.job_finished
                finish(txn, cid, r3.job_id, r3.epoch, r3.failure_reason)
            elif kind == "job_handback":
                pairs = [(h.job_id, h.epoch) for h in request.job_handback.jobs]
                release(txn, cid, pairs=pairs, reason=HANDED_BACK.format(cid))
            else:
                return Refusal.INVALID, f"a {kind or 'empty'} message is not a report"
        except StaleReport as stale:
            return Refusal.STALE, str(stale)
        except (IllegalTransition, ValueError) as bad:
            return Refusal.INVALID, str(bad)
        return Refusal.NONE, ""

    async def release_replica(
        self,
        controller_id: str,
        job_ids: Iterable[int] | None = None,
        reason: str = "",
        pairs: Sequence[tuple[int, int]] | None = None,
    ) -> list[Move]:
        """Takes jobs (all, by default; or these ids, or these (id, epoch) pairs) away from
        a replica whose lease ended."""

        def body(txn: Txn) -> list[Move]:
            release(txn, controller_id, job_ids=job_ids, pairs=pairs, reason=reason or RELEASED)
            return txn.moves

        return await self.store.transaction(body)


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


def _loaded(txn: Txn) -> Loaded:
    loaded = txn.cache.get("reports")
    if not isinstance(loaded, Loaded):
        loaded = txn.cache["reports"] = Loaded(txn)
    return loaded


def _prefetch(txn: Txn, requests: Sequence[pb.ConnectControllerRequest]) -> None:
    """Loads the jobs, tasks and attempts the batch's reports touch, locking the jobs.

    Later reads of these keys in the transaction need no round trip, found or not.
    """
    job_ids: set[int] = set()
    finished_ids: set[int] = set()
    task_keys: set[tuple[int, int]] = set()
    attempt_keys: set[tuple[int, int, int]] = set()
    for request in requests:
        kind = request.WhichOneof("message")
        if kind == "transition":
            t = request.transition
            job_ids.add(t.job_id)
            # The task, and the next one when this one succeeds (the job moves on to
            # it); no job has a task past MAX_TASKS (and task_id + 1 may overflow a column).
            task_keys.add((t.job_id, t.task_id))
            if t.status == S.SUCCEEDED and t.task_id + 1 < MAX_TASKS:
                task_keys.add((t.job_id, t.task_id + 1))
            if _touches_attempt(t):
                attempt_keys.add((t.job_id, t.task_id, t.attempt))
        elif kind == "job_finished":
            finished_ids.add(request.job_finished.job_id)
        elif kind in NUMBERED:
            job_ids.add(_job_of(request)[0])
    job_ids |= finished_ids
    if not job_ids:
        return
    conn = txn.conn
    loaded = _loaded(txn)
    jobs_in = sorted(job_ids)
    found_jobs = values_of(conn.execute(LOAD_JOBS, {"ids": jobs_in}))
    loaded.jobs.update(dict.fromkeys(job_ids))
    loaded.jobs.update((job["id"], txn.track(JOBS, job)) for job in found_jobs)
    if task_keys:
        params = {"ids": jobs_in, "keys": sorted(task_keys)}
        loaded.tasks.update(dict.fromkeys(task_keys))
        for row in values_of(conn.execute(LOAD_TASKS, params)):
            loaded.task(row)
    if attempt_keys:
        params = {"ids": jobs_in, "keys": sorted(attempt_keys)}
        loaded.attempts.update(dict.fromkeys(attempt_keys))
        for row in values_of(conn.execute(LOAD_ATTEMPTS, params)):
            key = (row["job_id"], row["task_id"], row["attempt"])
            loaded.attempts[key] = txn.track(ATTEMPTS, row)
    if finished_ids:
        unfinished: dict[int, list[Tracked]] = {job_id: [] for job_id in finished_ids}
        params = {"ids": sorted(finished_ids)}
        for row in values_of(conn.execute(UNFINISHED_TASKS, params)):
            unfinished[row["job_id"]].append(loaded.task(row))
        loaded.unfinished.update(unfinished)


def checked(request: pb.ConnectControllerRequest) -> pb.ConnectControllerRequest:
    """The report as it may be stored, once every field is in range.

    Texts are made storable rather than refused: a NUL character (no database text
    holds one) becomes U+FFFD, a region is cut to its column, any other text to
    `MAX_REPORT_TEXT` bytes. A cluster name is a name, not a text: a longer one than
    its column is refused.

    Raises:
        ValueError: a field out of range, named (the report is refused as INVALID).
    """
    kind = request.WhichOneof("message")
    if kind == "transition":
        report = request.transition
        try:
            S(report.status)
        except ValueError:
            raise ValueError(f"transition.status: {report.status} is not a status") from None
        for name in ("task_id", "attempt", "recovery_count", "restart_count"):
            if getattr(report, name) < 0:
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
    inner = getattr(request, kind) if kind else None
    changes: dict[str, str] = {}
    for field, value in inner.ListFields() if inner is not None else ():
        if isinstance(value, str):
            stored = _storable(field.name, value)
            if stored != value:
                changes[field.name] = stored
    if not changes:
        return request
    cut = pb.ConnectControllerRequest()
    cut.CopyFrom(request)
    for name, value in changes.items():
        setattr(getattr(cut, kind or ""), name, value)
    return cut


def _storable(name: str, text: str) -> str:
    text = text.replace("\x00", "\ufffd")
    if name == "region":
        return text[:MAX_REGION]
    return bound(text, MAX_REPORT_TEXT)


def _current(txn: Txn, job_id: int, epoch: int, cid: str) -> ScheduleState:
    """The job's schedule state, if it is assigned to `cid` at `epoch`.

    Raises:
        StaleReport: it is not.
    """
    row = (txn.conn.execute(ASSIGNMENT, {"job_id": job_id})).first()
    if row is None or row[0] != cid or int(row[1]) != epoch:
        raise StaleReport(f"job {job_id}: epoch {epoch} is not current")
    return St(row[2])


def _held_job(txn: Txn, job_id: int, epoch: int, cid: str, applying: bool = False) -> Tracked:
    """The job, if `cid` holds it at `epoch` (`applying` a report: whatever its epoch, under
    the test-only switch that turns that check off).

    Raises:
        StaleReport: it does not.
    """
    # Locked by `_prefetch` (FOR UPDATE on PostgreSQL) when the batch read it.
    loaded = _loaded(txn)
    if job_id in loaded.jobs:
        job = loaded.jobs[job_id]
    else:
        rows = values_of(txn.conn.execute(LOAD_JOBS, {"ids": [job_id]}))
        job = loaded.jobs[job_id] = txn.track(JOBS, rows[0]) if rows else None
    unchecked = applying and disabled(EPOCH_CHECK_AT_REPORT)
    if job is None or (not unchecked and (job.epoch != epoch or job.controller_id != cid)):
        raise StaleReport(f"job {job_id}: epoch {epoch} is not current")
    return job


def _numbered_job(txn: Txn, cid: str, request: pb.ConnectControllerRequest) -> Tracked | None:
    """The job a report is about and keeps the number of, when the replica holds it (a
    report about a job it does not hold is refused as stale)."""
    if request.WhichOneof("message") not in NUMBERED:
        return None
    job_id, epoch = _job_of(request)
    try:
        return _held_job(txn, job_id, epoch, cid)
    except StaleReport:
        return None


def _task(txn: Txn, job_id: int, task_id: int) -> Tracked | None:
    loaded = _loaded(txn)
    key = (job_id, task_id)
    if key not in loaded.tasks:
        params = {"ids": [job_id], "keys": [key]}
        rows = values_of(txn.conn.execute(LOAD_TASKS.with_for_update(), params))
        loaded.tasks[key] = loaded.task(rows[0]) if rows else None
    return loaded.tasks[key]


def transition(txn: Txn, cid: str, report: pb.TaskTransition) -> None:
    """Applies one task report: the task, then the job's view of its current task.

    Raises:
        StaleReport: the epoch or controller is not the job's assignment.
        IllegalTransition, ValueError: the report breaks a rule.
    """
    new = S(report.status)
    job = _held_job(txn, report.job_id, report.epoch, cid, applying=True)
    task = _task(txn, job.id, report.task_id)
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
    _follow_current_task(txn, job, task)
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
    loaded = _loaded(txn)
    if key not in loaded.attempts:
        params = {"ids": [key[0]], "keys": [key]}
        rows = values_of(txn.conn.execute(LOAD_ATTEMPTS, params))
        loaded.attempts[key] = txn.track(ATTEMPTS, rows[0]) if rows else None
    attempt = loaded.attempts[key]
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
        loaded.attempts[key] = attempt
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


def _follow_current_task(txn: Txn, job: Tracked, task: Tracked) -> None:
    """A job shows its first unfinished (not SUCCEEDED) task's status."""
    status = S(task.status)
    if task.task_id == job.current_task and status == S.SUCCEEDED:
        if task.task_id + 1 < job.num_tasks:
            job.current_task = task.task_id + 1
            following = _task(txn, job.id, job.current_task)
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


def finish(txn: Txn, cid: str, job_id: int, epoch: int, reason: str = "") -> None:
    """The replica finished the lifecycle: the job is DONE.

    A task the lifecycle left unfinished would break "every job ends in one
    terminal status", so it is closed here, along `TASK_TRANSITIONS`: a task being
    cancelled, and tasks after the current one, end CANCELLED; the current task
    and any other in flight end FAILED_CONTROLLER with the reason (with no reason,
    a current task that never started ends CANCELLED too). Each task closed here has
    an event of its own (`end_events`).
    """
    job = _held_job(txn, job_id, epoch, cid, applying=True)
    if job.schedule_state == St.DONE:
        return
    loaded = _loaded(txn)
    if job_id in loaded.unfinished:
        unfinished = loaded.unfinished[job_id]
    else:
        rows = values_of(txn.conn.execute(UNFINISHED_TASKS, {"ids": [job_id]}))
        unfinished = [loaded.task(row) for row in rows]
    ended: list[tuple[int, int, JobStatus]] = []
    for task in sorted(unfinished, key=lambda t: t.task_id):
        if task.status in TERMINAL:
            continue  # finished earlier in this batch (the query saw the stored status)
        never_started = task.status == S.PENDING
        if task.status == S.CANCELLING or (
            never_started and not (reason and task.task_id == job.current_task)
        ):
            set_task_status(task, S.CANCELLED)
        else:
            set_task_status(task, S.FAILED_CONTROLLER)
            task.failure_reason = reason or NO_FINAL_STATUS
        task.end_time = txn.now
        ended.append((job_id, task.task_id, S(task.status)))
        _follow_current_task(txn, job, task)
    prior = St(job.schedule_state)
    job.schedule_state = schedule_transition(prior, St.DONE)
    job.end_time = txn.now
    job.wait_reason = ""
    end_events(txn, ended, [(job_id, job.current_task, S(job.status))], prior, "done", epoch)
    txn.moves.append(Move(job_id, cid, cid, epoch, prior, St.DONE))


def release(
    txn: Txn,
    cid: str,
    *,
    job_ids: Iterable[int] | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
    reason: str,
) -> None:
    """Takes a replica's unfinished jobs away from it (all, some ids, or (id, epoch) pairs).

    Launch slots are freed (LAUNCHING becomes ALIVE); a task that was STARTING goes
    to RECOVERING, since its cluster's state is unknown (contract §9). Conditional
    UPDATEs only: a job already moved on is left alone.
    """
    # Ids go in chunks (`chunked`): each statement's list stays bounded.
    scopes: list[list[Any]] = [[]]
    if job_ids is not None:
        scopes = [[in_ids(JOBS.c.id, values=chunk)] for chunk in chunked(list(job_ids))]
    if pairs is not None:
        scopes = [
            [
                in_ids(JOBS.c.id, values=[job_id for job_id, _ in chunk]),
                in_ids(JOBS.c.id, JOBS.c.epoch, values=chunk),
            ]
            for chunk in chunked(list(pairs))
        ]
    released: list[tuple[int, int, ScheduleState, ScheduleState, JobStatus, int]] = []
    for scope in scopes:
        where = [JobRow.controller_id == cid, *scope]
        for old, new in ((St.LAUNCHING, St.ALIVE), (St.ALIVE, St.ALIVE), (St.ALIVE_WAITING,) * 2):
            rows = (
                txn.conn.execute(
                    update(JobRow)
                    .where(*where, JobRow.schedule_state == old)
                    .values(controller_id=None, schedule_state=schedule_transition(old, new))
                    .returning(JobRow.id, JobRow.epoch, JobRow.status, JobRow.current_task),
                )
            ).all()
            released += [(int(i), int(e), old, new, S(s), int(t)) for i, e, s, t in rows]
    if not released:
        return
    ids = [r[0] for r in released]
    moved = set_task_statuses(txn, ids, [S.STARTING], S.RECOVERING)
    recovering = {job_id for job_id, _ in moved}
    for chunk in chunked(sorted(recovering)):
        txn.conn.execute(
            update(JobRow)
            .where(in_ids(JOBS.c.id, values=chunk), JobRow.status == S.STARTING)
            .values(status=S.RECOVERING),
        )
    for job_id, epoch, old, new, status, task in released:
        shown = S.RECOVERING if job_id in recovering and status == S.STARTING else status
        txn.event(job_id, task, shown, new, reason, epoch)
        txn.moves.append(Move(job_id, cid, None, epoch, old, new))


def _job_of(request: pb.ConnectControllerRequest) -> tuple[int, int]:
    kind = request.WhichOneof("message")
    inner = getattr(request, kind) if kind else None
    return int(getattr(inner, "job_id", 0)), int(getattr(inner, "epoch", 0))
