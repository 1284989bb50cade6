"""The messages of a replica's stream, as the controller sends them (contract §9).

`TaskReport` is what a lifecycle reports of one task; its runner makes it the
`TaskTransition` that goes on the stream.
"""

from __future__ import annotations

import dataclasses

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus


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


__all__ = ["TaskReport"]
