"""One job on this replica: its lifecycle's task, its launch slot and its reports.

A `JobRunner` is the `JobHost` of its job's lifecycle (`host.py`): it runs the
lifecycle's main path as an inner task (`cleanup.run_job`), so that a cancel
request can cancel just that task and still run the cleanup, while `stop` (the
job moved away, or this replica lost its lease) cancels the runner itself: it
stops at once and reports nothing more. Its reports go on the replica's stream
in order; the answer to STARTING is checked with the next report, so a launch
does not wait a round trip for it. A `LaunchSlot` asks for the job's launch
slot and gives it back, the release of a launch that ended in RUNNING riding
on that report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import ClusterHandle
from services.common.statuses import JobStatus
from services.controller import metrics
from services.controller.cleanup import CancelRequest, run_job
from services.controller.host import Watcher
from services.controller.lifecycle import JobLifecycle
from services.controller.messages import LeaseLost, MovedAway, Rejected, TaskReport
from services.controller.outbox import Answer
from services.controller.watch import News

if TYPE_CHECKING:
    from services.controller.replica import Replica

log = logging.getLogger(__name__)


def handback(job_id: int, epoch: int) -> pb.JobHandback:
    """One job given back to the scheduler, unfailed."""
    return pb.JobHandback(jobs=[pb.HeldJob(job_id=job_id, epoch=epoch)])


class LaunchSlot:
    """This job's launch slot: requested from the scheduler, granted on the stream.

    A launch that ends in RUNNING gives the slot back with that report
    (`release_slot`), so a launch costs no extra round trip.
    """

    def __init__(self, runner: JobRunner, held: bool) -> None:
        self._runner = runner
        self.held = held
        self._grant: asyncio.Future[None] | None = None

    async def acquire(self, reason: str) -> None:
        if self.held:
            return
        self._grant = asyncio.get_running_loop().create_future()
        r = self._runner
        await r.replica.link.outbox.call(
            pb.LaunchSlotRequest(job_id=r.job_id, epoch=r.epoch, reason=reason)
        )
        await self._grant
        self.held = True

    def granted(self) -> None:
        if self._grant is not None and not self._grant.done():
            self._grant.set_result(None)

    async def release(self, wait_reason: str = "") -> None:
        if not self.held:
            return
        self.held = False
        r = self._runner
        await r.replica.link.outbox.call(
            pb.LaunchSlotRelease(job_id=r.job_id, epoch=r.epoch, wait_reason=wait_reason)
        )


class JobRunner:
    """One job on this replica (the `JobHost` of its lifecycle)."""

    def __init__(
        self,
        replica: Replica,
        job: job_pb2.Job,
        epoch: int,
        granted: bool,
        secrets: Sequence[pb.TaskSecrets] = (),
    ) -> None:
        self.replica = replica
        self.job = job
        self.job_id = job.job_id
        self.epoch = epoch
        self.slot = LaunchSlot(self, granted)
        self.cancel = CancelRequest(job.cancel_requested)
        by_task = {s.task_id: dict(s.secrets) for s in secrets}
        # Answers to reports sent without waiting, checked with the next report.
        self._unchecked: list[Answer] = []
        self.lifecycle = JobLifecycle(job, self, replica.backend, replica.config, by_task)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._main(), name=f"job-{self.job_id}")

    async def _main(self) -> None:
        outbox = self.replica.link.outbox
        try:
            reason = await run_job(self.lifecycle, self.cancel)
            self.note("done" + (f" ({reason})" if reason else ""))
            # The lifecycle log is complete by the time anyone sees the job DONE (bounded).
            await self.replica.logs.shipped(self.job_id)
            await outbox.call(
                pb.JobFinished(job_id=self.job_id, epoch=self.epoch, failure_reason=reason)
            )
        except LeaseLost as error:
            self.note(f"stopped: this replica's lease ran out ({error}); handing the job back")
            # The scheduler may still count the lease (it renews on receipt, this replica
            # from the send): tell it, or the job would stay assigned to no one running
            # it. At a stale epoch the handback is refused, harmlessly.
            outbox.notify(handback(self.job_id, self.epoch))
        except MovedAway as error:
            self.note(f"stopped: the scheduler no longer assigns this job here ({error})")
        except Rejected as error:
            log.error("job finish refused", extra={"job_id": self.job_id, "reason": str(error)})
        finally:
            for answer in self._unchecked:
                answer.cancel()
            self.replica.forget(self)

    def request_cancel(self) -> None:
        self.cancel.set()

    def stop(self) -> None:
        """Stops acting for the job at once, reporting nothing (run_job stops its main path)."""
        if self.task is not None:
            self.task.cancel()

    # --- JobHost ---------------------------------------------------------------------------

    async def report(self, report: TaskReport) -> None:
        status = report.status
        transition = report.transition(self.job_id, self.epoch, time.time())
        if status == JobStatus.RUNNING and self.slot.held:
            # Launched: the slot goes back with this report.
            transition.release_slot = True
            self.slot.held = False
        answer = self.replica.link.outbox.post(transition)
        metrics.transition(status)
        if status == JobStatus.STARTING:
            # Nothing waits on the scheduler's answer to STARTING (the launch is fenced by
            # the lease and the epoch): it is checked with the next report, a round trip
            # saved on every launch.
            self._unchecked.append(answer)
            return
        await self._checked(answer)

    async def _checked(self, answer: Answer) -> None:
        """Awaits this answer and every earlier one not yet checked, in order."""
        pending, self._unchecked = [*self._unchecked, answer], []
        for earlier in pending:
            await earlier

    def note(self, message: str) -> None:
        self.replica.logs.note(self.job_id, self.epoch, message)

    async def fetch_logs(self, task_id: int, handle: ClusterHandle, attempt: int) -> None:
        if not await self.replica.logs.fetch(self.job_id, task_id, self.epoch, handle, attempt):
            self.note(f"task {task_id}: logs could not be saved before teardown")

    def watch(self, handle: ClusterHandle) -> Watcher:
        return self.replica.watch.watch(handle)

    async def look(self, handle: ClusterHandle) -> News:
        return await self.replica.watch.look(handle)

    def state(self) -> cpb.ControllerJob:
        current = next(
            (t for t in self.lifecycle.tasks if not t.status.terminal), self.lifecycle.tasks[-1]
        )
        return cpb.ControllerJob(
            job_id=self.job_id,
            epoch=self.epoch,
            task_id=current.task.task_id,
            status=int(current.status),  # type: ignore[arg-type]
            launching=self.slot.held,
        )


__all__ = ["JobRunner", "LaunchSlot", "handback"]
