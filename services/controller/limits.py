"""A job's time limits as its lifecycle applies them (contract §18).

- `max_pending` (the job's) counts from its submission and applies only until the
  job first starts: launching stops at its deadline, even while waiting for a
  launch slot.
- `max_duration` (a task's, and the job's) counts from when the task, or the job,
  first started, across recoveries and restarts; starts are Unix seconds, so a
  job resumed by another replica keeps its count.
- The grace period is how long a stopped task has between SIGTERM and SIGKILL.
"""

from __future__ import annotations

from managedjobs.v1 import job_pb2
from services.controller.config import LifecycleConfig
from services.controller.launching import Deadline
from services.controller.tasks import TaskState


class Limits:
    """The time limits of one job and its tasks."""

    def __init__(self, job: job_pb2.Job, config: LifecycleConfig) -> None:
        self.job = job
        self.config = config
        # When the job first started (Unix seconds), if it has: max_pending no longer applies.
        self.job_start: float | None = (
            job.start_time.ToNanoseconds() / 1e9 if job.HasField("start_time") else None
        )

    def started(self, state: TaskState) -> None:
        """The task runs: the first time, its max_duration (and the job's) starts counting."""
        now = self.config.clock()
        state.first_start = state.first_start or now
        self.job_start = self.job_start or now

    def grace(self, state: TaskState) -> float:
        """Seconds between SIGTERM and SIGKILL when the task is stopped (contract §18)."""
        spec = state.task.spec
        if spec.HasField("grace_period_seconds"):
            return spec.grace_period_seconds
        return self.config.grace_period

    def pending_deadline(self) -> Deadline | None:
        """While the job never started: when its max_pending runs out (monotonic seconds)."""
        timeouts = self.job.timeouts
        if self.job_start is not None or not timeouts.HasField("max_pending_seconds"):
            return None
        submitted = self.job.submit_time.ToNanoseconds() / 1e9
        left = submitted + timeouts.max_pending_seconds - self.config.clock()
        label = f"max_pending of {timeouts.max_pending_seconds:g}s"
        return Deadline(self.config.monotonic() + left, label)

    def duration_left(self, state: TaskState) -> tuple[float, str] | None:
        """Seconds until the task's or the job's max_duration runs out, and which one."""
        now = self.config.clock()
        limits: list[tuple[float, str]] = []
        spec = state.task.spec
        if spec.HasField("max_duration_seconds") and state.first_start is not None:
            limit = spec.max_duration_seconds
            limits.append((state.first_start + limit - now, f"max_duration of {limit:g}s"))
        timeouts = self.job.timeouts
        if timeouts.HasField("max_duration_seconds") and self.job_start is not None:
            limit = timeouts.max_duration_seconds
            limits.append((self.job_start + limit - now, f"the job's max_duration of {limit:g}s"))
        return min(limits) if limits else None


__all__ = ["Limits"]
