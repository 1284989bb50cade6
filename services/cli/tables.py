"""Jobs, events and scheduler state as rows of text: pure functions, no I/O, no clock.

Each function takes `now` (seconds since the epoch) instead of reading the
clock, so a test can pin every cell. Layout follows `sky jobs queue`: a job with
one task is one row; a chain is a row for the job and an indented `↳` row per
task. Durations read like SkyPilot's (`1h 2m 5s`, `2 mins ago`); `-` stands
for "not applicable" or "not yet". A deadline (contract §18) counts from its own
start (submission, the job's start, a task's first start) and shows the time
left, or how it went once its clock stopped.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from google.protobuf import timestamp_pb2

from managedjobs.v1 import job_pb2, scheduler_service_pb2
from services.common.statuses import FAILED_GROUP

NONE = "-"
TASK_ARROW = " ↳"
TASK_HEADERS = [
    "ID",
    "NAME",
    "STATUS",
    "REGION",
    "CLUSTER",
    "RESOURCES",
    "#RECOVERIES",
    "#RESTARTS",
    "FAILURE REASON",
]
ATTEMPT_HEADERS = [
    "TASK",
    "ATTEMPT",
    "CLUSTER",
    "REGION",
    "STARTED",
    "ENDED",
    "EXIT CODE",
    "OUTCOME",
]
REPLICA_HEADERS = [
    "REPLICA",
    "ADDRESS",
    "CONNECTED",
    "DRAINING",
    "LAUNCHING",
    "ALIVE",
    "MAX LAUNCHES",
    "MAX JOBS",
    "LEASE EXPIRES",
]
_UNITS = (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1))
_AGO_UNITS = (
    ("year", 365 * 86_400),
    ("month", 30 * 86_400),
    ("week", 7 * 86_400),
    ("day", 86_400),
    ("hr", 3_600),
    ("min", 60),
)


def status_name(status: int) -> str:
    """`JOB_STATUS_RUNNING` -> `RUNNING`; an unknown number stays a number."""
    try:
        return job_pb2.JobStatus.Name(status).removeprefix("JOB_STATUS_")  # type: ignore[arg-type]
    except ValueError:
        return str(status)


def schedule_state_name(state: int) -> str:
    """`SCHEDULE_STATE_ALIVE` -> `ALIVE`; an unknown number stays a number."""
    try:
        return job_pb2.ScheduleState.Name(state).removeprefix("SCHEDULE_STATE_")  # type: ignore[arg-type]
    except ValueError:
        return str(state)


def seconds(timestamp: timestamp_pb2.Timestamp) -> float | None:
    """Seconds since the epoch, or None for an unset timestamp."""
    if not timestamp.seconds and not timestamp.nanos:
        return None
    return timestamp.seconds + timestamp.nanos / 1e9


def format_duration(length: float) -> str:
    """`3725` -> `1h 2m 5s`; zero units are left out and anything under a second is `< 1s`."""
    if length < 1:
        return "< 1s"
    left = int(length)
    parts = []
    for unit, size in _UNITS:
        count, left = divmod(left, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts)


def format_ago(then: float | None, now: float) -> str:
    """How long ago `then` was: `just now`, `a few secs ago`, `1 min ago`, `3 hrs ago`."""
    if then is None:
        return NONE
    elapsed = now - then
    if elapsed < 1:
        return "just now"
    if elapsed < 10:
        return "a few secs ago"
    for unit, size in _AGO_UNITS:
        if elapsed >= size:
            count = int(elapsed // size)
            return f"{count} {unit}{'' if count == 1 else 's'} ago"
    return f"{int(elapsed)} secs ago"


def span(start: float | None, end: float | None, now: float) -> str:
    """The duration from `start` to `end`, or to `now` while there is no end."""
    if start is None:
        return NONE
    return format_duration((now if end is None else end) - start)


def format_time(value: float | None) -> str:
    """A local wall-clock time for people, e.g. `2024-05-01 14:03:09 CEST`."""
    if value is None:
        return NONE
    return dt.datetime.fromtimestamp(value).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_event_time(timestamp: timestamp_pb2.Timestamp) -> str:
    """An event's time in UTC to the millisecond, e.g. `2024-05-01T12:03:09.125Z`."""
    value = seconds(timestamp)
    if value is None:
        return NONE
    moment = dt.datetime.fromtimestamp(value, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def or_none(text: str) -> str:
    return text or NONE


def failure_reason(job: job_pb2.Job) -> str:
    """The job's failure reason, else that of its first failed task."""
    if job.failure_reason:
        return job.failure_reason
    for task in job.tasks:
        if task.status in FAILED_GROUP and task.failure_reason:
            return task.failure_reason
    return ""


def outcome_line(job: job_pb2.Job) -> str:
    """`Job 3 SUCCEEDED`, or `Job 3 FAILED: <reason>`."""
    line = f"Job {job.job_id} {status_name(job.status)}"
    reason = failure_reason(job) if job.status != job_pb2.JOB_STATUS_SUCCEEDED else ""
    return f"{line}: {reason}" if reason else line


def queue_headers(show_user: bool) -> list[str]:
    headers = ["ID", "TASK", "NAME", "RESOURCES", "SUBMITTED", "TOT. DURATION", "JOB DURATION"]
    return _with_user([*headers, "#RECOVERIES", "STATUS"], "USER" if show_user else None)


def queue_table(jobs: Iterable[job_pb2.Job], now: float, show_user: bool) -> list[list[str]]:
    """The rows of `mj queue` under `queue_headers(show_user)`, in the order of `jobs`
    (taken one by one, as they arrive)."""
    rows: list[list[str]] = []
    for job in jobs:
        submitted = seconds(job.submit_time)
        ago = format_ago(submitted, now)
        chain = len(job.tasks) > 1
        only = job.tasks[0] if len(job.tasks) == 1 else job_pb2.Task()
        job_row = [
            str(job.job_id),
            "" if chain else NONE,
            or_none(job.name or only.name),
            NONE if chain else or_none(only.resources),
            ago,
            span(submitted, seconds(job.end_time), now),
            span(seconds(job.start_time), seconds(job.end_time), now),
            str(job.recovery_count),
            status_name(job.status),
        ]
        rows.append(_with_user(job_row, job.user if show_user else None))
        for task in job.tasks if chain else ():
            end = seconds(task.end_time)
            task_row = [
                TASK_ARROW,
                str(task.task_id),
                or_none(task.name),
                or_none(task.resources),
                ago,
                span(submitted, end, now),
                span(seconds(task.start_time), end, now),
                str(task.recovery_count),
                status_name(task.status),
            ]
            rows.append(_with_user(task_row, "" if show_user else None))
    return rows


def _with_user(row: list[str], user: str | None) -> list[str]:
    """Puts the USER cell after NAME when the table has that column."""
    return row if user is None else [*row[:3], user, *row[3:]]


def job_fields(job: job_pb2.Job, now: float) -> list[tuple[str, str]]:
    """The label/value pairs of `mj status`."""
    submitted = seconds(job.submit_time)
    return [
        ("Job", str(job.job_id)),
        ("Name", or_none(job.name)),
        ("User", or_none(job.user)),
        ("Priority", str(job.priority)),
        ("Status", status_name(job.status)),
        ("Schedule state", schedule_state_name(job.schedule_state)),
        ("Controller", or_none(job.controller_id)),
        ("Submitted", f"{format_time(submitted)} ({format_ago(submitted, now)})"),
        ("Started", format_time(seconds(job.start_time))),
        ("Ended", format_time(seconds(job.end_time))),
        ("Duration", span(seconds(job.start_time), seconds(job.end_time), now)),
        ("Recoveries", str(job.recovery_count)),
        ("Failure reason", or_none(job.failure_reason)),
        ("Wait reason", or_none(job.wait_reason)),
        ("Condition", _condition(job)),
    ]


def _condition(job: job_pb2.Job) -> str:
    """The current task's condition (e.g. its cluster is unreachable), or `NONE`."""
    current = next((t for t in job.tasks if t.task_id == job.current_task_id), None)
    if current is None or not current.condition:
        return NONE
    prefix = f"task {current.task_id}: " if len(job.tasks) > 1 else ""
    return prefix + current.condition


def task_table(job: job_pb2.Job) -> list[list[str]]:
    """The rows of the task table of `mj status`, under `TASK_HEADERS`."""
    return [
        [
            str(task.task_id),
            or_none(task.name),
            status_name(task.status),
            or_none(task.region),
            or_none(task.cluster_name),
            or_none(task.resources),
            str(task.recovery_count),
            str(task.restart_count),
            or_none(task.failure_reason),
        ]
        for task in job.tasks
    ]


def attempt_table(job: job_pb2.Job) -> list[list[str]]:
    """Every attempt of every task (`mj status`), under `ATTEMPT_HEADERS`."""
    return [
        [
            str(task.task_id),
            str(attempt.attempt),
            or_none(attempt.cluster_name),
            or_none(attempt.region),
            format_time(seconds(attempt.start_time)),
            format_time(seconds(attempt.end_time)),
            str(attempt.exit_code) if attempt.HasField("exit_code") else NONE,
            or_none(" ".join(attempt.outcome.split())),
        ]
        for task in job.tasks
        for attempt in sorted(task.attempts, key=lambda a: a.attempt)
    ]


def countdown(limit: float, start: float | None, end: float | None, now: float) -> str:
    """A deadline `limit` seconds after `start`: how much is left, or how it went.

    `end` is when the clock stopped (the thing measured ended): `ran 5m`. Before
    `start` nothing is counting: `not started`.
    """
    if start is None:
        return "not started"
    if end is not None:
        return f"ran {format_duration(end - start)}"
    left = start + limit - now
    if left >= 0:
        return f"{format_duration(left)} left"
    return f"over by {format_duration(-left)}"


def deadline_fields(job: job_pb2.Job, now: float) -> list[tuple[str, str]]:
    """The job's own deadlines (contract §18) for `mj status`, each with the time left."""
    fields = []
    timeouts = job.timeouts
    submitted = seconds(job.submit_time)
    started = seconds(job.start_time)
    ended = seconds(job.end_time)
    if timeouts.HasField("max_pending_seconds"):
        limit = timeouts.max_pending_seconds
        if started is not None and submitted is not None:
            state = f"met: started after {format_duration(started - submitted)}"
        elif ended is not None:
            state = "never started"
        else:
            state = countdown(limit, submitted, None, now)
        fields.append(("Max pending", f"{format_duration(limit)} from submission ({state})"))
    if timeouts.HasField("max_duration_seconds"):
        limit = timeouts.max_duration_seconds
        state = countdown(limit, started, ended, now)
        fields.append(("Max duration", f"{format_duration(limit)} from the job's start ({state})"))
    return fields


def task_notes(job: job_pb2.Job, now: float) -> list[str]:
    """Per task, what `mj status` says below the task table: its condition (e.g. its
    cluster is unreachable, and for how long) and its max_duration with the time left."""
    notes = []
    for task in job.tasks:
        if task.condition:
            since = seconds(task.condition_time)
            lasting = f" (for {format_duration(now - since)})" if since is not None else ""
            notes.append(f"Task {task.task_id}: {' '.join(task.condition.split())}{lasting}")
        if task.HasField("max_duration_seconds"):
            limit = task.max_duration_seconds
            state = countdown(limit, seconds(task.start_time), seconds(task.end_time), now)
            notes.append(
                f"Task {task.task_id}: max duration {format_duration(limit)} "
                f"from its first start ({state})"
            )
    return notes


def event_line(event: job_pb2.JobEvent) -> str:
    """One line of `mj watch`."""
    message = " ".join(event.message.split())
    return (
        f"{event.event_id} {format_event_time(event.time)} job {event.job_id} "
        f"task {event.task_id} {status_name(event.status)} "
        f"{schedule_state_name(event.schedule_state)} {message}"
    ).rstrip()


def _limit(value: int) -> str:
    return str(value) if value > 0 else "no limit"


def state_fields(state: scheduler_service_pb2.GetSchedulerStateResponse) -> list[tuple[str, str]]:
    """The label/value pairs of `mj ops state`; a zero global limit means none is set."""
    limits = state.global_limits
    return [
        ("Global launch limit", _limit(limits.max_launches)),
        ("Global job limit", _limit(limits.max_jobs)),
        ("Launching", str(state.launching)),
        ("Alive", str(state.alive)),
        ("Waiting", str(state.waiting)),
        ("Alive waiting", str(state.alive_waiting)),
        ("Queue depth", str(state.waiting + state.alive_waiting)),
        ("Replicas", str(len(state.replicas))),
    ]


def replica_table(
    state: scheduler_service_pb2.GetSchedulerStateResponse, now: float
) -> list[list[str]]:
    """The replicas of `mj ops state`, under `REPLICA_HEADERS`."""
    rows = []
    for replica in state.replicas:
        expires = seconds(replica.lease_expire_time)
        if expires is None:
            lease = NONE
        elif expires >= now:
            lease = f"in {format_duration(expires - now)}"
        else:
            lease = f"{format_duration(now - expires)} ago"
        rows.append(
            [
                replica.controller_id,
                or_none(replica.address),
                "yes" if replica.connected else "no",
                "yes" if replica.draining else "no",
                str(replica.launching),
                str(replica.alive),
                _limit(replica.capacity.max_launches),
                _limit(replica.capacity.max_jobs),
                lease,
            ]
        )
    return rows
