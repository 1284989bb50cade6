"""A controller replica: its jobs, what the scheduler tells it of them, its drain.

`Replica.runners` maps job id to its `JobRunner` (`runner.py`); the replica is
the one place that starts, cancels and reaps them, following the scheduler's
instructions on the stream (its handlers in `Instructions`): an assignment
starts a runner, a cancel interrupts its main path (the cleanup still runs), a
revoke or a lost lease stops it at once. It says hello with the jobs it holds,
hands every job back when it drains, and answers `GetControllerState`.

A cancel can reach the replica before the assignment it belongs to (both are
sent by the scheduler as soon as they commit, from different transactions): the
replica remembers such a cancel by (job, epoch) and applies it when the
assignment arrives, so no cancel is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

import grpc

from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import controller_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import Backend
from services.common.channels import ClientSecurity
from services.common.errors import rpc_errors
from services.common.test_switches import CANCEL_ON_ASSIGNMENT, disabled
from services.controller import metrics
from services.controller.config import LifecycleConfig
from services.controller.fencing import LeaseGuard
from services.controller.joblog import LogsClient
from services.controller.link import Link
from services.controller.messages import Instructions, Rejected
from services.controller.metrics import MeteredBackend
from services.controller.runner import JobRunner, handback
from services.controller.watch import ClusterWatch

# Cancels remembered for assignments not yet arrived; the oldest are forgotten past this.
EARLY_CANCELS = 10_000
HANDBACK_TIMEOUT = 5.0
# How long a drain waits for its jobs' last lifecycle lines to be stored.
LINES_TIMEOUT = 3.0


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
    ) -> None:
        self.controller_id = controller_id
        self.address = address
        self.capacity = capacity
        self.logs = logs
        self.config = config
        self.runners: dict[int, JobRunner] = {}
        self.draining = False
        instructions = Instructions(
            assignment=self._assign,
            launch_slot_grant=self._granted,
            cancel=self._cancel,
            revoke=self._revoke,
        )
        self.link = Link(scheduler_address, self.hello, instructions, self.on_lease_lost, security)
        self.metered = MeteredBackend(backend)
        self.backend: Backend = LeaseGuard(
            self.metered, self.link.lease.wait, lambda: self.draining
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
            "mj_replica_lease_seconds_left": max(0.0, self.link.lease.left()),
        }

    def hello(self) -> pb.ControllerHello:
        return pb.ControllerHello(
            controller_id=self.controller_id,
            address=self.address,
            capacity=self.capacity,
            held_jobs=[pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in self.runners.values()],
            regions=list(self.backend.regions() or ()),
        )

    def _held(self, job_id: int, epoch: int) -> JobRunner | None:
        """The runner of this job at this epoch, if this replica runs it."""
        runner = self.runners.get(job_id)
        return runner if runner is not None and runner.epoch == epoch else None

    def _granted(self, grant: pb.LaunchSlotGrant) -> None:
        if runner := self._held(grant.job_id, grant.epoch):
            runner.slot.granted()

    def _cancel(self, cancel: pb.JobCancel) -> None:
        runner = self.runners.get(cancel.job_id)
        if runner is None or runner.epoch < cancel.epoch:
            self._remember_cancel(cancel.job_id, cancel.epoch)
        elif runner.epoch == cancel.epoch:
            runner.note("cancel requested")
            runner.request_cancel()

    def _revoke(self, revoke: pb.JobRevoke) -> None:
        if runner := self._held(revoke.job_id, revoke.epoch):
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
            self.link.outbox.notify(handback(job.job_id, assignment.epoch))
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
        for runner in list(self.runners.values()):
            runner.note("lease lost: stopping")
            runner.stop()

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
        self.link.outbox.notify(pb.ControllerDraining())
        runners = list(self.runners.values())
        if not runners:
            return
        for runner in runners:
            runner.note(self._handed_back_line)
        await self.logs.shipped(timeout=LINES_TIMEOUT)
        jobs = [pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in runners]
        returned = self.link.outbox.post(pb.JobHandback(jobs=jobs))
        deadline = asyncio.get_running_loop().time() + HANDBACK_TIMEOUT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.link.outbox.written(), HANDBACK_TIMEOUT)
        for runner in runners:
            runner.stop()
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        with contextlib.suppress(Rejected, TimeoutError):
            await asyncio.wait_for(returned, remaining)
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
        if self.link.lease.last_renewal:
            wall = time.time() - (time.monotonic() - self.link.lease.last_renewal)
            response.lease_renew_time.FromNanoseconds(int(wall * 1e9))
        return response
