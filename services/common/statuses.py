"""Task statuses and schedule states, mirroring the proto enums, with their groups.

The groups are named frozensets; a test checks that they cover the enums
exactly. `TASK_TRANSITIONS` and `SCHEDULE_TRANSITIONS` are the allowed moves;
the scheduler's store refuses anything else, so a buggy or stale replica cannot
drag a job backwards.
"""

from __future__ import annotations

import enum

from managedjobs.v1 import job_pb2


class JobStatus(enum.IntEnum):
    """Status of a task (contract §4); a job shows its current task's."""

    PENDING = job_pb2.JOB_STATUS_PENDING
    STARTING = job_pb2.JOB_STATUS_STARTING
    RUNNING = job_pb2.JOB_STATUS_RUNNING
    RECOVERING = job_pb2.JOB_STATUS_RECOVERING
    CANCELLING = job_pb2.JOB_STATUS_CANCELLING
    SUCCEEDED = job_pb2.JOB_STATUS_SUCCEEDED
    CANCELLED = job_pb2.JOB_STATUS_CANCELLED
    FAILED = job_pb2.JOB_STATUS_FAILED
    FAILED_SETUP = job_pb2.JOB_STATUS_FAILED_SETUP
    FAILED_PRECHECKS = job_pb2.JOB_STATUS_FAILED_PRECHECKS
    FAILED_NO_RESOURCE = job_pb2.JOB_STATUS_FAILED_NO_RESOURCE
    FAILED_CONTROLLER = job_pb2.JOB_STATUS_FAILED_CONTROLLER

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class ScheduleState(enum.IntEnum):
    """Admission state of a job (contract §5)."""

    INACTIVE = job_pb2.SCHEDULE_STATE_INACTIVE
    WAITING = job_pb2.SCHEDULE_STATE_WAITING
    LAUNCHING = job_pb2.SCHEDULE_STATE_LAUNCHING
    ALIVE = job_pb2.SCHEDULE_STATE_ALIVE
    ALIVE_WAITING = job_pb2.SCHEDULE_STATE_ALIVE_WAITING
    DONE = job_pb2.SCHEDULE_STATE_DONE


S = JobStatus

FAILED_GROUP = frozenset(
    {S.FAILED, S.FAILED_SETUP, S.FAILED_PRECHECKS, S.FAILED_NO_RESOURCE, S.FAILED_CONTROLLER}
)
TERMINAL = frozenset({S.SUCCEEDED, S.CANCELLED}) | FAILED_GROUP
USER_FAILURES = frozenset({S.FAILED, S.FAILED_SETUP})
# A cluster may exist while the task is in one of these.
ACTIVE = frozenset({S.STARTING, S.RUNNING, S.RECOVERING, S.CANCELLING})
NOT_STARTED = frozenset({S.PENDING})

TASK_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # FAILED_NO_RESOURCE: the job's max_pending ran out before it could start.
    S.PENDING: frozenset(
        {S.STARTING, S.CANCELLING, S.CANCELLED, S.FAILED_NO_RESOURCE, S.FAILED_CONTROLLER}
    ),
    S.STARTING: frozenset(
        {S.RUNNING, S.RECOVERING, S.CANCELLING, S.SUCCEEDED}
        | frozenset({S.FAILED_PRECHECKS, S.FAILED_NO_RESOURCE, S.FAILED_CONTROLLER})
    ),
    S.RUNNING: frozenset({S.RECOVERING, S.CANCELLING, S.SUCCEEDED}) | FAILED_GROUP,
    # FAILED from RECOVERING: max_duration ran out while the task was being relaunched.
    S.RECOVERING: frozenset({S.RUNNING, S.CANCELLING, S.FAILED})
    | frozenset({S.FAILED_PRECHECKS, S.FAILED_NO_RESOURCE, S.FAILED_CONTROLLER}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED_CONTROLLER}),
    # A terminal status only ever changes to FAILED_CONTROLLER, when cleanup fails.
    **{status: frozenset({S.FAILED_CONTROLLER}) for status in TERMINAL - {S.FAILED_CONTROLLER}},
    S.FAILED_CONTROLLER: frozenset(),
}

St = ScheduleState
SCHEDULE_TRANSITIONS: dict[ScheduleState, frozenset[ScheduleState]] = {
    St.INACTIVE: frozenset({St.WAITING, St.DONE}),
    St.WAITING: frozenset({St.LAUNCHING, St.DONE}),
    # A launch finished (ALIVE) or backed off (ALIVE, asking again later).
    St.LAUNCHING: frozenset({St.ALIVE, St.ALIVE_WAITING, St.DONE}),
    St.ALIVE: frozenset({St.ALIVE_WAITING, St.LAUNCHING, St.DONE}),
    St.ALIVE_WAITING: frozenset({St.LAUNCHING, St.ALIVE, St.DONE}),
    St.DONE: frozenset(),
}
# Jobs counted against the job limit.
ALIVE_STATES = frozenset({St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING})


class IllegalTransition(ValueError):
    """A move the transition tables forbid."""


def schedule_transition(old: ScheduleState, new: ScheduleState) -> ScheduleState:
    """Returns `new` if a job may move from `old` to it (staying put is allowed), else raises."""
    if old != new and new not in SCHEDULE_TRANSITIONS[old]:
        raise IllegalTransition(f"schedule state {old.name} -> {new.name} is not allowed")
    return new


def task_sources(new: JobStatus) -> frozenset[JobStatus]:
    """The statuses from which a task may move to `new` (for conditional bulk updates)."""
    return frozenset(old for old, allowed in TASK_TRANSITIONS.items() if new in allowed)


def task_transition_allowed(old: JobStatus, new: JobStatus) -> bool:
    """Whether a task may move from `old` to `new` (a repeat of the same status is a no-op)."""
    return old == new or new in TASK_TRANSITIONS[old]
