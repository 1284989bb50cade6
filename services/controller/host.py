"""What a job's lifecycle needs from the replica that runs it (`runner.py` is one).

A lifecycle never talks to the scheduler, the logs service or the cluster watch
itself: it reports, notes, fetches logs and watches through its host, so one
replica runs many lifecycles over one stream and one watch, and a test runs a
lifecycle with a recording host (harness/lifecycle_harness.py).
"""

from __future__ import annotations

from typing import Protocol

from services.backends import ClusterHandle
from services.controller.launching import Slot
from services.controller.messages import TaskReport
from services.controller.watch import News


class Watcher(Protocol):
    """News of one cluster (services/controller/watch.py)."""

    notice_deadline: float | None

    async def next(self, timeout: float | None) -> News | None:
        """The next news, or None after `timeout` seconds without any."""

    def close(self) -> None:
        """Stops the news."""


class JobHost(Protocol):
    """What a lifecycle needs from its replica."""

    job_id: int
    epoch: int

    @property
    def slot(self) -> Slot:
        """The job's launch slot."""

    async def report(self, report: TaskReport) -> None:
        """Reports a task change.

        Raises:
            MovedAway: the replica no longer holds the job.
            Refused: the scheduler refused the report (a broken rule).
        """

    def note(self, message: str) -> None:
        """Appends a line to the job's lifecycle log (`mj logs --controller`)."""

    async def fetch_logs(self, task_id: int, handle: ClusterHandle, attempt: int) -> None:
        """Has the logs service copy an attempt's logs off its cluster."""

    def watch(self, handle: ClusterHandle) -> Watcher:
        """Starts news of a cluster."""

    async def look(self, handle: ClusterHandle) -> News:
        """One observation of the cluster now (batched with other jobs' looks)."""


__all__ = ["JobHost", "Watcher"]
