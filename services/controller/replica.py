"""A controller replica: holds job lifecycles as asyncio tasks and answers the scheduler.

`Replica.runners` maps job id to its `JobRunner`; the replica is the one place
that starts, cancels and reaps them. A runner runs the lifecycle's main path as
an inner task, so that a cancel request can cancel just that task and still run
the cleanup, while a revoke (the job moved away, or this replica lost its lease)
cancels the runner itself: it stops at once and reports nothing more.

A cancel can reach the replica before the assignment it belongs to (both are
sent by the scheduler as soon as they commit, from different transactions): the
replica remembers such a cancel by (job, epoch) and applies it when the
assignment arrives, so no cancel is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import controller_service_pb2_grpc, job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import Backend, ClusterHandle
from services.common.channels import ClientSecurity
from services.common.errors import rpc_errors
from services.common.statuses import JobStatus
from services.common.test_switches import CANCEL_ON_ASSIGNMENT, disabled
from services.controller import metrics
from services.controller.cleanup import CancelRequest, run_job
from services.controller.config import LifecycleConfig
from services.controller.fencing import LeaseGuard
from services.controller.host import Watcher
from services.controller.joblog import LogsClient
from services.controller.lifecycle import JobLifecycle
from services.controller.link import LeaseLost, Link, MovedAway, Rejected
from services.controller.metrics import MeteredBackend
from services.controller.watch import ClusterWatch, News

log = logging.getLogger(__name__)

# Cancels remembered for assignments not yet arrived; the oldest are forgotten past this.
EARLY_CANCELS = 10_000
HANDBACK_TIMEOUT = 5.0
# How long a drain waits for its jobs' last lifecycle lines to be stored.
LINES_TIMEOUT = 3.0


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
        await r.replica.link.call(
            launch_slot_request=pb.LaunchSlotRequest(job_id=r.job_id, epoch=r.epoch, reason=reason)
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
        await r.replica.link.call(
            launch_slot_release=pb.LaunchSlotRelease(
                job_id=r.job_id, epoch=r.epoch, wait_reason=wait_reason
            )
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
        self._unchecked: list[asyncio.Future[pb.ReportAck]] = []
        self.lifecycle = JobLifecycle(job, self, replica.backend, replica.config, by_task)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._main(), name=f"job-{self.job_id}")

    async def _main(self) -> None:
        try:
            reason = await run_job(self.lifecycle, self.cancel)
            self.note("done" + (f" ({reason})" if reason else ""))
            # The lifecycle log is complete by the time anyone sees the job DONE (bounded).
            await self.replica.logs.shipped(self.job_id)
            await self.replica.link.call(
                job_finished=pb.JobFinished(
                    job_id=self.job_id, epoch=self.epoch, failure_reason=reason
                )
            )
        except LeaseLost as error:
            self.note(f"stopped: this replica's lease ran out ({error}); handing the job back")
            # The scheduler may still count the lease (it renews on receipt, this replica
            # from the send): tell it, or the job would stay assigned to no one running it.
            self.replica.hand_back([self])
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

    async def report(
        self, task_id: int, status: JobStatus, message: str = "", **fields: Any
    ) -> None:
        transition = pb.TaskTransition(
            job_id=self.job_id,
            epoch=self.epoch,
            task_id=task_id,
            status=int(status),  # type: ignore[arg-type]
            message=message,
            failure_reason=fields.get("failure_reason", ""),
            cluster_name=fields.get("cluster_name", ""),
            region=fields.get("region", ""),
            resources=fields.get("resources", ""),
            recovery_count=fields.get("recovery_count", 0),
            restart_count=fields.get("restart_count", 0),
        )
        if "condition" in fields:
            transition.condition = fields["condition"]
        transition.attempt = fields.get("attempt", 0)
        if fields.get("exit_code") is not None:
            transition.exit_code = fields["exit_code"]
        transition.time.FromSeconds(int(time.time()))
        if fields.get("end_time"):
            transition.end_time.FromNanoseconds(int(fields["end_time"] * 1e9))
        if status == JobStatus.RUNNING and self.slot.held:
            # Launched: the slot goes back with this report.
            transition.release_slot = True
            self.slot.held = False
        answer = self.replica.link.post(transition=transition)
        metrics.transition(status)
        if status == JobStatus.STARTING:
            # Nothing waits on the scheduler's answer to STARTING (the launch is fenced by
            # the lease and the epoch): it is checked with the next report, a round trip
            # saved on every launch.
            self._unchecked.append(answer)
            return
        await self._checked(answer)

    async def _checked(self, answer: asyncio.Future[pb.ReportAck]) -> None:
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


class Replica(controller_service_pb2_grpc.ControllerServiceServicer):
    def __init__(
        self,
        controller_id: str,
        address: str,
        capacity: pb.Capacity,
        backend: Backend,
        logs: LogsClient,
        config: LifecycleConfig,
        scheduler_address: str,
        security: ClientSecurity | None = None,
        reconnect_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`reconnect_sleep` sleeps between attempts to reach the scheduler (tests make it
        short)."""
        self.controller_id = controller_id
        self.address = address
        self.capacity = capacity
        self.logs = logs
        self.config = config
        self.runners: dict[int, JobRunner] = {}
        self.draining = False
        self.link = Link(
            scheduler_address,
            self.hello,
            self.on_message,
            self.on_lease_lost,
            security,
            reconnect_sleep=reconnect_sleep,
        )
        self.metered = MeteredBackend(backend)
        self.backend: Backend = LeaseGuard(
            self.metered, self.link.wait_lease, lambda: self.draining
        )
        self.watch = ClusterWatch(self.backend, config.poll_interval)
        self._early_cancels: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._link_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        metrics.watch_replica(self.gauges)
        self.logs.start()
        self.watch.start()
        self._link_task = asyncio.create_task(self.link.run(), name="scheduler-link")

    def gauges(self) -> dict[str, float]:
        return {
            "mj_replica_held_jobs": len(self.runners),
            "mj_replica_held_launch_slots": sum(r.slot.held for r in self.runners.values()),
            "mj_replica_watched_clusters": self.watch.watched,
            "mj_replica_lease_seconds_left": max(0.0, self.link.lease_left()),
        }

    def hello(self) -> pb.ControllerHello:
        return pb.ControllerHello(
            controller_id=self.controller_id,
            address=self.address,
            capacity=self.capacity,
            held_jobs=[pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in self.runners.values()],
            regions=list(self.backend.regions() or ()),
        )

    async def on_message(self, message: pb.ConnectControllerResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "assignment":
            self._assign(message.assignment)
            return
        inner = getattr(message, kind) if kind else None
        job_id, epoch = getattr(inner, "job_id", 0), getattr(inner, "epoch", -1)
        runner = self.runners.get(job_id)
        if kind == "cancel" and (runner is None or runner.epoch < epoch):
            self._remember_cancel(job_id, epoch)
            return
        if runner is None or runner.epoch != epoch:
            return
        if kind == "launch_slot_grant":
            runner.slot.granted()
        elif kind == "cancel":
            runner.note("cancel requested")
            runner.request_cancel()
        elif kind == "revoke":
            runner.note("revoked: the job moved to another replica")
            runner.stop()

    def _remember_cancel(self, job_id: int, epoch: int) -> None:
        self._early_cancels[job_id] = epoch
        self._early_cancels.move_to_end(job_id)
        while len(self._early_cancels) > EARLY_CANCELS:
            self._early_cancels.popitem(last=False)

    def _assign(self, assignment: pb.JobAssignment) -> None:
        job = assignment.job
        if self.draining:
            # Sent before the scheduler knew of the drain: straight back, never started.
            self.logs.note(job.job_id, assignment.epoch, self._handed_back_line)
            held = pb.HeldJob(job_id=job.job_id, epoch=assignment.epoch)
            self.link.notify(job_handback=pb.JobHandback(jobs=[held]))
            return
        current = self.runners.get(job.job_id)
        if current is not None:
            if current.epoch >= assignment.epoch:
                return
            current.stop()
        if disabled(CANCEL_ON_ASSIGNMENT):
            job.cancel_requested = False
        elif self._early_cancels.get(job.job_id) == assignment.epoch:
            del self._early_cancels[job.job_id]
            job.cancel_requested = True
        runner = JobRunner(
            self, job, assignment.epoch, assignment.launch_granted, assignment.secrets
        )
        self.runners[job.job_id] = runner
        runner.note(f"assigned to {self.controller_id} (epoch {assignment.epoch})")
        runner.start()

    def forget(self, runner: JobRunner) -> None:
        if self.runners.get(runner.job_id) is runner:
            del self.runners[runner.job_id]

    async def on_lease_lost(self) -> None:
        runners = list(self.runners.values())
        for runner in runners:
            runner.note("lease lost: stopping")
            runner.stop()
        # Handed back once they have unwound: a launch a runner gave up is rolled back
        # (terminated, with the runner's epoch) first, so that nothing it does lands after
        # the scheduler took the job back.
        await asyncio.gather(
            *(r.task for r in runners if r.task is not None), return_exceptions=True
        )
        self.hand_back(runners)

    def hand_back(self, runners: Sequence[JobRunner]) -> None:
        """Gives the jobs of stopped runners back to the scheduler: on this stream, or on
        the next one if it is down.

        The next stream's hello may already be on its way, announcing these jobs (the
        lease can run out while it is), and the scheduler would keep them assigned to
        this replica, run by no one. The handback goes after that hello and frees them
        either way; a job the scheduler no longer assigns here at that epoch is left
        alone.
        """
        if not runners:
            return
        jobs = [pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in runners]
        answer = self.link.post(job_handback=pb.JobHandback(jobs=jobs))
        # Nothing waits for it: a refusal has nothing left to undo.
        answer.add_done_callback(lambda done: done.cancelled() or done.exception())

    @property
    def _handed_back_line(self) -> str:
        return f"handed back: {self.controller_id} is draining"

    async def drain(self) -> None:
        """Stops taking jobs and hands every job back, unfailed, for another replica.

        From the first line on, the backend guard refuses every call that would change
        anything, so the runners may go on while the drain works:
        1. each job's lifecycle log says it was handed back, and the lines are shipped
           (at most `LINES_TIMEOUT` seconds): once the scheduler has the jobs back, the
           logs service takes no more lines of them from this replica;
        2. the jobs go back in one message, waited for at most `HANDBACK_TIMEOUT`
           seconds (past that, the lease expiry moves them);
        3. once that message is written, every runner stops. Tens of thousands of
           them take seconds to unwind and would hold the message back behind them in
           the event loop; written first, the scheduler's work on it overlaps theirs.
        The drain ends once the answer came and every runner has unwound.
        """
        self.draining = True
        self.link.notify(draining=pb.ControllerDraining())
        runners = list(self.runners.values())
        if not runners:
            return
        for runner in runners:
            runner.note(self._handed_back_line)
        await self.logs.shipped(timeout=LINES_TIMEOUT)
        jobs = [pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in runners]
        handback = self.link.post(job_handback=pb.JobHandback(jobs=jobs))
        deadline = asyncio.get_running_loop().time() + HANDBACK_TIMEOUT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.link.written(), HANDBACK_TIMEOUT)
        for runner in runners:
            runner.stop()
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        with contextlib.suppress(Rejected, TimeoutError):
            await asyncio.wait_for(handback, remaining)
        await asyncio.gather(
            *(r.task for r in runners if r.task is not None), return_exceptions=True
        )

    async def close(self) -> None:
        for runner in list(self.runners.values()):
            runner.stop()
        if self._link_task is not None:
            self._link_task.cancel()
            await asyncio.gather(self._link_task, return_exceptions=True)
        await self.watch.close()
        await self.logs.close()
        await self.backend.close()

    @rpc_errors
    async def GetControllerState(
        self, request: cpb.GetControllerStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> cpb.GetControllerStateResponse:
        response = cpb.GetControllerStateResponse(
            controller_id=self.controller_id,
            jobs=[r.state() for r in sorted(self.runners.values(), key=lambda r: r.job_id)],
            launching=sum(r.slot.held for r in self.runners.values()),
            capacity=self.capacity,
            connected=self.link.connected.is_set(),
            draining=self.draining,
        )
        if self.link.last_renewal:
            wall = time.time() - (time.monotonic() - self.link.last_renewal)
            response.lease_renew_time.FromNanoseconds(int(wall * 1e9))
        return response
