"""Status groups and transition tables cover the enums exactly and mirror the protos."""

from __future__ import annotations

from managedjobs.v1 import job_pb2
from services.common import statuses as st
from services.common.statuses import JobStatus, ScheduleState


def test_job_status_mirrors_the_proto_enum() -> None:
    proto = {
        v.name.removeprefix("JOB_STATUS_"): v.number for v in job_pb2.JobStatus.DESCRIPTOR.values
    }
    proto.pop("UNSPECIFIED")
    assert {s.name: s.value for s in JobStatus} == proto


def test_schedule_state_mirrors_the_proto_enum() -> None:
    values = job_pb2.ScheduleState.DESCRIPTOR.values
    proto = {v.name.removeprefix("SCHEDULE_STATE_"): v.number for v in values}
    proto.pop("UNSPECIFIED")
    assert {s.name: s.value for s in ScheduleState} == proto


def test_groups_partition_the_statuses() -> None:
    groups = [st.TERMINAL, st.ACTIVE, st.NOT_STARTED]
    assert frozenset().union(*groups) == frozenset(JobStatus)
    assert sum(len(g) for g in groups) == len(JobStatus)
    assert st.USER_FAILURES <= st.FAILED_GROUP <= st.TERMINAL


def test_transition_tables_cover_every_state() -> None:
    assert set(st.TASK_TRANSITIONS) == set(JobStatus)
    assert set(st.SCHEDULE_TRANSITIONS) == set(ScheduleState)


def test_terminal_statuses_only_move_to_failed_controller() -> None:
    for status in st.TERMINAL:
        allowed = st.TASK_TRANSITIONS[status]
        assert allowed <= {JobStatus.FAILED_CONTROLLER}
    assert not st.TASK_TRANSITIONS[JobStatus.FAILED_CONTROLLER]
    assert st.task_transition_allowed(JobStatus.SUCCEEDED, JobStatus.FAILED_CONTROLLER)
    assert not st.task_transition_allowed(JobStatus.SUCCEEDED, JobStatus.RUNNING)


def test_every_non_terminal_status_can_reach_a_terminal_one() -> None:
    for start in JobStatus:
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in st.TASK_TRANSITIONS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen & st.TERMINAL, start
