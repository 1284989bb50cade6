"""The messages of a replica's stream, as the controller sends and reads them (contract §9).

- A report is one of the proto messages in `Report`; `request` puts it in its
  `ConnectControllerRequest` by its type, the one place that knows which field of
  the envelope each kind goes in.
- An instruction from the scheduler (an assignment, a launch slot's grant, a
  cancel, a revoke) goes to the replica's handler for it in `Instructions`; the
  link dispatches every message of the stream by its oneof's name
  (`services/controller/link.py`). `unbatched` opens the scheduler's batches.
- A refused report's answer becomes one of the `Rejected` errors (`refusal`):
  `MovedAway` (the job is not this replica's at this epoch any more) or `Refused`
  (the report broke a rule).
- `TaskReport` is what a lifecycle reports of one task; its runner makes it the
  `TaskTransition` that goes on the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import assert_never

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus

Report = (
    pb.ControllerHeartbeat
    | pb.TaskTransition
    | pb.LaunchSlotRequest
    | pb.LaunchSlotRelease
    | pb.JobFinished
    | pb.JobHandback
    | pb.ControllerDraining
)


def request(report: Report) -> pb.ConnectControllerRequest:
    """The request envelope that carries `report` (not numbered yet)."""
    match report:
        case pb.ControllerHeartbeat():
            return pb.ConnectControllerRequest(heartbeat=report)
        case pb.TaskTransition():
            return pb.ConnectControllerRequest(transition=report)
        case pb.LaunchSlotRequest():
            return pb.ConnectControllerRequest(launch_slot_request=report)
        case pb.LaunchSlotRelease():
            return pb.ConnectControllerRequest(launch_slot_release=report)
        case pb.JobFinished():
            return pb.ConnectControllerRequest(job_finished=report)
        case pb.JobHandback():
            return pb.ConnectControllerRequest(job_handback=report)
        case pb.ControllerDraining():
            return pb.ConnectControllerRequest(draining=report)
    assert_never(report)


@dataclasses.dataclass(frozen=True, slots=True)
class Instructions:
    """What the replica does with each instruction from the scheduler."""

    assignment: Callable[[pb.JobAssignment], None]
    launch_slot_grant: Callable[[pb.LaunchSlotGrant], None]
    cancel: Callable[[pb.JobCancel], None]
    revoke: Callable[[pb.JobRevoke], None]


def unbatched(
    response: pb.ConnectControllerResponse,
) -> Sequence[pb.ConnectControllerResponse]:
    """The messages a response from the scheduler carries: itself, or its batch's."""
    if response.HasField("batch"):
        return response.batch.messages
    return (response,)


class Rejected(Exception):
    """The scheduler refused a request."""


class MovedAway(Rejected):
    """The job is not this replica's at this epoch any more: stop acting for it, silently."""


class Refused(Rejected):
    """The report broke a rule: the job must end FAILED_CONTROLLER, cleaned up."""


class LeaseLost(MovedAway):
    """This replica's lease ran out: it must not act for any job."""


def refusal(ack: pb.ReportAck) -> Rejected:
    """What a refused request's answer (accepted=false) means for the job."""
    if ack.refusal == pb.REPORT_REFUSAL_STALE_EPOCH:
        return MovedAway(ack.reason)
    return Refused(ack.reason or "refused")


@dataclasses.dataclass(frozen=True, slots=True)
class TaskReport:
    """A task's change as its lifecycle reports it (`TaskState` makes every one)."""

    task_id: int
    status: JobStatus
    message: str = ""
    failure_reason: str = ""
    cluster_name: str = ""
    region: str = ""
    resources: str = ""
    recovery_count: int = 0
    restart_count: int = 0
    # The attempt the report is about (0: not said).
    attempt: int = 0
    # The task's visible condition from now on ("" clears it); None: the report is not one.
    condition: str | None = None
    # The exit code of the attempt's run, once known.
    exit_code: int | None = None
    # When the task ended (Unix seconds), once it has.
    end_time: float | None = None

    def transition(self, job_id: int, epoch: int, now: float) -> pb.TaskTransition:
        """The report as it goes on the stream, made at `now` (Unix seconds)."""
        transition = pb.TaskTransition(
            job_id=job_id,
            epoch=epoch,
            task_id=self.task_id,
            status=int(self.status),  # type: ignore[arg-type]
            message=self.message,
            failure_reason=self.failure_reason,
            cluster_name=self.cluster_name,
            region=self.region,
            resources=self.resources,
            recovery_count=self.recovery_count,
            restart_count=self.restart_count,
            attempt=self.attempt,
        )
        if self.condition is not None:
            transition.condition = self.condition
        if self.exit_code is not None:
            transition.exit_code = self.exit_code
        transition.time.FromSeconds(int(now))
        if self.end_time:
            transition.end_time.FromNanoseconds(int(self.end_time * 1e9))
        return transition


__all__ = [
    "Instructions",
    "LeaseLost",
    "MovedAway",
    "Refused",
    "Rejected",
    "Report",
    "TaskReport",
    "refusal",
    "request",
    "unbatched",
]
