"""A task of a job as its lifecycle sees it, and the one way its status changes.

`TaskState` is the lifecycle's own view of one task (its status, recovery and
restart counts, cluster, first start), mirrored to the scheduler by reports.
Every status goes through `TaskState.transition`, which refuses any move that
`TASK_TRANSITIONS` forbids, notes the move in the job's lifecycle log and
reports it. `TaskState.condition` reports a visible condition of a running
task without a status change (e.g. "unreachable since T").
"""

from __future__ import annotations

import dataclasses

from managedjobs.v1 import job_pb2
from services.backends import Backend, ClusterHandle, cluster_name
from services.common.statuses import TASK_TRANSITIONS, IllegalTransition, JobStatus
from services.controller.host import JobHost
from services.controller.messages import TaskReport


class TaskState:
    """One task of the job, mirrored to the scheduler by reports."""

    def __init__(self, job_id: int, task: job_pb2.Task, host: JobHost) -> None:
        self.job_id = job_id
        self.task = task
        self.task_id = task.task_id
        self.host = host
        self.status = JobStatus(task.status)
        self.recovery_count = task.recovery_count
        self.restart_count = task.restart_count
        self.handle: ClusterHandle | None = None
        self.region = task.region
        # The current cluster was verified gone: no second teardown.
        self.gone = False
        # When the task first started (Unix seconds): max_duration counts from here.
        self.first_start: float | None = (
            task.start_time.ToNanoseconds() / 1e9 if task.HasField("start_time") else None
        )
        # The reclaim deadline of the last preemption notice passed on to the task.
        self.notice_passed: float | None = None
        # Since when (event-loop time) the backend could not tell anything of the cluster.
        self.unreachable_since: float | None = None
        self.unreachable_timeout: float | None = None

    @property
    def attempt(self) -> int:
        """The number of the cluster the task runs on: 1, then one more per recovery or restart."""
        return 1 + self.recovery_count + self.restart_count

    def last_cluster(self, backend: Backend) -> ClusterHandle:
        """The task's cluster as last known, found by name (from another process if need be)."""
        if self.handle is not None:
            return self.handle
        handle = backend.handle_for(cluster_name(self.job_id, self.task_id))
        return dataclasses.replace(handle, region=handle.region or self.region)

    async def transition(
        self,
        status: JobStatus,
        message: str = "",
        *,
        failure_reason: str = "",
        attempt: int | None = None,
        exit_code: int | None = None,
        end_time: float | None = None,
    ) -> None:
        """Moves the task to `status`, logs it and reports it (about the current attempt
        unless `attempt` says another).

        Raises:
            IllegalTransition: `TASK_TRANSITIONS` does not allow the move (a bug here).
        """
        old = self.status
        if status == old or status not in TASK_TRANSITIONS[old]:
            raise IllegalTransition(
                f"job {self.job_id} task {self.task_id}: {old.name} -> {status.name} is not allowed"
            )
        self.status = status
        self.host.note(
            f"task {self.task_id}: {status.name}"
            + (f" ({message})" if message else "")
            + f" [was {old.name}]"
        )
        report = dataclasses.replace(
            self._report(status, message),
            failure_reason=failure_reason,
            attempt=self.attempt if attempt is None else attempt,
            exit_code=exit_code,
            end_time=end_time,
        )
        await self.host.report(report)

    async def condition(self, message: str, condition: str) -> None:
        """A visible condition of the running task (no status change): set or cleared ("")."""
        self.host.note(f"task {self.task_id}: {message}")
        report = dataclasses.replace(self._report(self.status, message), condition=condition)
        await self.host.report(report)

    def _report(self, status: JobStatus, message: str) -> TaskReport:
        """A report of the task with what every report of it carries."""
        return TaskReport(
            task_id=self.task_id,
            status=status,
            message=message,
            cluster_name=self.handle.cluster_name if self.handle else "",
            region=self.region,
            resources=self.task.resources,
            recovery_count=self.recovery_count,
            restart_count=self.restart_count,
        )


__all__ = ["TaskState"]
