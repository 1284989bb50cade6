"""A controller replica: holds job lifecycles as asyncio tasks and answers the scheduler.

`Replica.runners` maps job id to its `JobRunner`; the replica is the one place
that starts, cancels and reaps them. A runner runs the lifecycle's main path as
an inner task, so that a cancel request can cancel just that task and still run
the cleanup, while a revoke (the job moved away, or this replica lost its lease)
cancels the runner itself: it stops at once and reports nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import controller_service_pb2_grpc, job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import Backend, ClusterHandle
from services.common.channels import ClientSecurity
from services.common.errors import rpc_errors
from services.common.statuses import JobStatus
from services.controller.config import LifecycleConfig
from services.controller.fencing import LeaseGuard
from services.controller.joblog import LogsClient
from services.controller.lifecycle import CancelRequest, JobLifecycle, cluster_name, run_job
from services.controller.link import Link, Rejected
from services.controller.watch import ClusterWatch

log = logging.getLogger(__name__)


class LaunchSlot:
    """This job's launch slot: requested from the scheduler, granted on the stream."""

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

    def __init__(self, replica: Replica, job: job_pb2.Job, epoch: int, granted: bool) -> None:
        self.replica = replica
        self.job = job
        self.job_id = job.job_id
        self.epoch = epoch
        self.slot = LaunchSlot(self, granted)
        self.cancel = CancelRequest(job.cancel_requested)
        self.lifecycle = JobLifecycle(job, self, replica.backend, replica.config)
        self.clusters = [cluster_name(job.job_id, t.task_id) for t in job.tasks]
        for name in self.clusters:
            replica.watch.track(name)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._main(), name=f"job-{self.job_id}")

    async def _main(self) -> None:
        try:
            await run_job(self.lifecycle, self.cancel, stop_on=(Rejected,))
            self.note("done")
            # The lifecycle log is complete by the time anyone sees the job DONE.
            await self.replica.logs.flush()
            await self.replica.link.call(
                job_finished=pb.JobFinished(job_id=self.job_id, epoch=self.epoch)
            )
        except Rejected as error:
            self.note(f"stopped: the scheduler no longer assigns this job here ({error})")
        finally:
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
        transition.time.FromSeconds(int(time.time()))
        if fields.get("end_time"):
            transition.end_time.FromNanoseconds(int(fields["end_time"] * 1e9))
        await self.replica.link.call(transition=transition)

    def note(self, message: str) -> None:
        self.replica.logs.note(self.job_id, message)

    async def fetch_logs(self, task_id: int, handle: ClusterHandle) -> None:
        if not await self.replica.logs.fetch(self.job_id, task_id, self.epoch, handle):
            self.note(f"task {task_id}: logs could not be saved before teardown")

    async def cluster_changed(self, cluster_name: str, timeout: float) -> None:
        await self.replica.watch.wait(cluster_name, timeout)

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
    ) -> None:
        self.controller_id = controller_id
        self.address = address
        self.capacity = capacity
        self.logs = logs
        self.config = config
        self.watch = ClusterWatch()
        self.runners: dict[int, JobRunner] = {}
        self.draining = False
        self.link = Link(
            scheduler_address, self.hello, self.on_message, self.on_lease_lost, security
        )
        self.backend: Backend = LeaseGuard(backend, self.link.lease_valid)
        self._link_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.logs.start()
        self.watch.start(self.backend)
        self._link_task = asyncio.create_task(self.link.run(), name="scheduler-link")

    def hello(self) -> pb.ControllerHello:
        return pb.ControllerHello(
            controller_id=self.controller_id,
            address=self.address,
            capacity=self.capacity,
            held_jobs=[pb.HeldJob(job_id=r.job_id, epoch=r.epoch) for r in self.runners.values()],
        )

    async def on_message(self, message: pb.ConnectControllerResponse) -> None:
        kind = message.WhichOneof("message")
        if kind == "assignment":
            self._assign(message.assignment)
            return
        inner = getattr(message, kind) if kind else None
        runner = self.runners.get(getattr(inner, "job_id", 0))
        if runner is None or runner.epoch != getattr(inner, "epoch", -1):
            return
        if kind == "launch_slot_grant":
            runner.slot.granted()
        elif kind == "cancel":
            runner.note("cancel requested")
            runner.request_cancel()
        elif kind == "revoke":
            runner.note("revoked: the job moved to another replica")
            runner.stop()

    def _assign(self, assignment: pb.JobAssignment) -> None:
        job = assignment.job
        current = self.runners.get(job.job_id)
        if current is not None:
            if current.epoch >= assignment.epoch:
                return
            current.stop()
        runner = JobRunner(self, job, assignment.epoch, assignment.launch_granted)
        self.runners[job.job_id] = runner
        runner.note(f"assigned to {self.controller_id} (epoch {assignment.epoch})")
        runner.start()

    def forget(self, runner: JobRunner) -> None:
        if self.runners.get(runner.job_id) is runner:
            del self.runners[runner.job_id]
        for name in runner.clusters:
            self.watch.forget(name)

    async def on_lease_lost(self) -> None:
        for runner in list(self.runners.values()):
            runner.note("lease lost: stopping")
            runner.stop()

    async def drain(self) -> None:
        """Stops taking jobs and hands every job back, unfailed, for another replica."""
        self.draining = True
        self.link.notify(draining=pb.ControllerDraining())
        runners = list(self.runners.values())
        for runner in runners:
            runner.note(f"handed back: {self.controller_id} is draining")
            runner.stop()
        tasks = [r.task for r in runners if r.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for runner in runners:
            with contextlib.suppress(Rejected, TimeoutError):
                await asyncio.wait_for(
                    self.link.call(
                        job_handback=pb.JobHandback(job_id=runner.job_id, epoch=runner.epoch)
                    ),
                    timeout=5,
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
