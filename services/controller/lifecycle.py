"""The lifecycle of one job (SPEC §6), run as one asyncio task on a replica.

For each task in order: skip what already finished (resume), launch under a
launch slot, report RUNNING and give the slot back, then watch. The watch tells
preemption apart from a crash of the user's code: a task that failed is looked
at again after a grace period, and only a cluster that is still healthy means
the code failed (restart while restarts remain, else FAILED or FAILED_SETUP).
A cluster that is not up, or whose task cannot be read, was preempted: tear it
down, RECOVERING, relaunch through the task's strategy, RUNNING again.

The lifecycle never concludes anything while the backend is unreachable, and
it reports every change through `JobHost`, whose reports fail with `Rejected`
once this replica no longer holds the job, which ends the lifecycle at once.
Cleanup (cancelling what never ran, terminating and verifying every cluster)
is `JobLifecycle.cleanup`, run by the replica after the main path, whether it
ended, failed or was cancelled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    BackendError,
    ClusterHandle,
    ClusterStatus,
    PrecheckError,
    TaskRequest,
    TaskStatus,
)
from services.common.statuses import ACTIVE, TERMINAL, JobStatus
from services.controller.config import LifecycleConfig
from services.controller.strategies import NoResources, Slot, Strategy, strategy_for

log = logging.getLogger(__name__)
S = JobStatus


class JobHost(Protocol):
    """What a lifecycle needs from its replica."""

    job_id: int
    epoch: int

    @property
    def slot(self) -> Slot:
        """The job's launch slot."""

    async def report(
        self, task_id: int, status: JobStatus, message: str = "", **fields: Any
    ) -> None:
        """Reports a task change; raises once the replica no longer holds the job."""

    def note(self, message: str) -> None:
        """Appends a line to the job's lifecycle log."""

    async def fetch_logs(self, task_id: int, handle: ClusterHandle) -> None:
        """Has the logs service copy the task's logs off the cluster."""

    async def cluster_changed(self, cluster_name: str, timeout: float) -> None:
        """Returns when the backend pushes news of the cluster, or after `timeout`."""


class CleanupFailed(Exception):
    pass


def cluster_name(job_id: int, task_id: int) -> str:
    return f"mj-{job_id}-{task_id}"


def task_request(job_id: int, epoch: int, task: job_pb2.Task) -> TaskRequest:
    spec = task.spec
    r = spec.resources
    return TaskRequest(
        job_id=job_id,
        task_id=task.task_id,
        epoch=epoch,
        cluster_name=cluster_name(job_id, task.task_id),
        num_nodes=spec.num_nodes or 1,
        setup=spec.setup,
        run=spec.run,
        workdir=spec.workdir,
        envs=dict(spec.envs),
        cloud=r.cloud,
        region=r.region,
        zone=r.zone,
        cpus=r.cpus,
        memory=r.memory,
        accelerators=r.accelerators,
        use_spot=r.use_spot,
        sim=json.loads(spec.sim_json) if spec.sim_json else {},
    )


class TaskState:
    """The lifecycle's own view of one task, mirrored to the scheduler by reports."""

    def __init__(self, task: job_pb2.Task) -> None:
        self.task = task
        self.status = S(task.status)
        self.recovery_count = task.recovery_count
        self.restart_count = task.restart_count
        self.handle: ClusterHandle | None = None
        self.region = task.region


class JobLifecycle:
    def __init__(
        self, job: job_pb2.Job, host: JobHost, backend: Backend, config: LifecycleConfig
    ) -> None:
        self.job = job
        self.host = host
        self.backend = backend
        self.config = config
        self.tasks = [TaskState(t) for t in sorted(job.tasks, key=lambda t: t.task_id)]

    # --- reporting -------------------------------------------------------------------------

    async def _set(
        self, state: TaskState, status: JobStatus, message: str = "", **extra: Any
    ) -> None:
        state.status = status
        handle = state.handle
        self.host.note(
            f"task {state.task.task_id}: {status.name}" + (f" ({message})" if message else "")
        )
        await self.host.report(
            state.task.task_id,
            status,
            message,
            cluster_name=handle.cluster_name if handle else "",
            region=state.region,
            resources=state.task.resources,
            recovery_count=state.recovery_count,
            restart_count=state.restart_count,
            **extra,
        )

    # --- the main path ---------------------------------------------------------------------

    async def run(self) -> None:
        for state in self.tasks:
            if state.status == S.SUCCEEDED:
                continue
            if state.status in TERMINAL:
                return
            if await self._run_task(state) != S.SUCCEEDED:
                return

    async def _run_task(self, state: TaskState) -> JobStatus:
        request = task_request(self.job.job_id, self.host.epoch, state.task)
        strategy = strategy_for(
            state.task.spec, self.backend, self.host.slot, self.config, self.host.note
        )
        try:
            if state.status == S.PENDING:
                await self._set(state, S.STARTING, f"resources {state.task.resources}")
                if not state.task.spec.run:
                    await self.host.slot.release()
                    await self._set(
                        state, S.SUCCEEDED, "nothing to run", end_time=self.config.clock()
                    )
                    return S.SUCCEEDED
                await self._launched(state, await strategy.launch(request))
            elif state.status == S.RUNNING:
                state.handle = self.backend.handle_for(request.cluster_name)
                self.host.note(
                    f"task {state.task.task_id}: resumed; watching {request.cluster_name}"
                )
            else:
                # STARTING or RECOVERING when resumed: the cluster's state is unknown.
                await self._recover(state, strategy, request, "resumed on another replica")
            return await self._watch(state, strategy, request)
        except PrecheckError as error:
            await self.host.slot.release()
            await self._set(state, S.FAILED_PRECHECKS, str(error), failure_reason=str(error))
        except NoResources as error:
            await self.host.slot.release()
            await self._set(state, S.FAILED_NO_RESOURCE, str(error), failure_reason=str(error))
        return state.status

    async def _launched(self, state: TaskState, handle: ClusterHandle, message: str = "") -> None:
        state.handle = handle
        state.region = handle.region
        await self._set(state, S.RUNNING, message or f"running on {handle.cluster_name}")
        await self.host.slot.release()

    async def _recover(
        self, state: TaskState, strategy: Strategy, request: TaskRequest, why: str
    ) -> None:
        lost = state.handle or self.backend.handle_for(request.cluster_name)
        lost = ClusterHandle(
            lost.cluster_name, lost.backend, lost.region or state.region, lost.zone, lost.data
        )
        if state.status != S.RECOVERING:
            await self._set(state, S.RECOVERING, why)
        await self._terminate(lost)
        state.recovery_count += 1
        handle = await strategy.recover(request, lost)
        await self._launched(
            state, handle, f"recovered on {handle.cluster_name} in {handle.region or '-'}"
        )

    async def _watch(self, state: TaskState, strategy: Strategy, request: TaskRequest) -> JobStatus:
        restarts_allowed = state.task.spec.resources.max_restarts_on_errors
        while True:
            assert state.handle is not None
            handle = state.handle
            await self.host.cluster_changed(handle.cluster_name, self.config.poll_interval)
            if not await self._reachable():
                continue
            cluster = await self.backend.cluster_status(handle)
            status = await self.backend.task_status(handle) if cluster == ClusterStatus.UP else None
            if status is None or cluster != ClusterStatus.UP:
                self.host.note(f"cluster {handle.cluster_name} is {cluster.value}: preempted")
                await self._recover(state, strategy, request, f"cluster {handle.cluster_name} lost")
                continue
            if status == TaskStatus.SUCCEEDED:
                end = await self.backend.task_end_time(handle) or self.config.clock()
                await self._set(state, S.SUCCEEDED, end_time=end)
                await self.host.fetch_logs(state.task.task_id, handle)
                await self._terminate(handle)
                return S.SUCCEEDED
            if status in (TaskStatus.FAILED, TaskStatus.FAILED_SETUP):
                # A preempted node can look like failed user code; look again after a grace period.
                await self.config.sleep(self.config.grace_seconds)
                if await self.backend.cluster_status(handle) != ClusterStatus.UP:
                    self.host.note(f"task failed while {handle.cluster_name} went down: preempted")
                    await self._recover(
                        state, strategy, request, f"cluster {handle.cluster_name} lost"
                    )
                    continue
                what = "setup" if status == TaskStatus.FAILED_SETUP else "run"
                await self.host.fetch_logs(state.task.task_id, handle)
                if state.restart_count < restarts_allowed:
                    state.restart_count += 1
                    reason = (
                        f"user {what} failed; restart {state.restart_count} of {restarts_allowed}"
                    )
                    await self._set(state, S.RECOVERING, reason)
                    await self._terminate(handle)
                    handle = await strategy.launch(request)
                    await self._launched(state, handle, f"restarted on {handle.cluster_name}")
                    continue
                final = S.FAILED_SETUP if status == TaskStatus.FAILED_SETUP else S.FAILED
                reason = f"user {what} exited non-zero"
                end = await self.backend.task_end_time(handle) or self.config.clock()
                await self._set(state, final, reason, failure_reason=reason, end_time=end)
                await self._terminate(handle)
                return final
            if status not in (TaskStatus.PENDING, TaskStatus.SETTING_UP, TaskStatus.RUNNING):
                reason = f"unknown task status {status!r}"
                await self._set(state, S.FAILED_CONTROLLER, reason, failure_reason=reason)
                return S.FAILED_CONTROLLER

    async def _reachable(self) -> bool:
        try:
            if await self.backend.reachable():
                return True
        except BackendError:
            pass
        self.host.note("backend unreachable; concluding nothing")
        return False

    # --- cleanup ---------------------------------------------------------------------------

    async def _terminate(self, handle: ClusterHandle) -> None:
        for attempt in range(1, self.config.terminate_attempts + 1):
            try:
                await self.backend.terminate(handle)
                if not await self.backend.cluster_exists(handle.cluster_name):
                    return
            except BackendError as error:
                self.host.note(
                    f"terminate {handle.cluster_name} failed (attempt {attempt}): {error}"
                )
            await self.config.sleep(min(1.0 * attempt, 5.0))
        raise CleanupFailed(f"cluster {handle.cluster_name} could not be terminated")

    async def cleanup(self, cancelled: bool) -> None:
        """Ends every unfinished task and removes every cluster of the job.

        With `cancelled`, a task in flight goes CANCELLING then CANCELLED; tasks
        that never ran end CANCELLED either way (after a failure, or a cancel).
        A cleanup that fails ends the task FAILED_CONTROLLER.
        """
        for state in self.tasks:
            if cancelled and state.status in ACTIVE - {S.CANCELLING}:
                await self._set(state, S.CANCELLING, "cancel requested")
        failure = ""
        for name in self._cluster_names():
            try:
                await self._terminate(self.backend.handle_for(name))
            except (CleanupFailed, BackendError) as error:
                failure = str(error)
        for state in self.tasks:
            if failure and state.status not in TERMINAL | {S.PENDING}:
                await self._set(state, S.FAILED_CONTROLLER, failure, failure_reason=failure)
            elif state.status == S.CANCELLING or (state.status == S.PENDING):
                await self._set(
                    state,
                    S.CANCELLED,
                    "cancelled" if cancelled else "an earlier task did not succeed",
                )
            elif state.status in ACTIVE:
                reason = "the lifecycle stopped before the task finished"
                await self._set(state, S.FAILED_CONTROLLER, reason, failure_reason=reason)
        if failure:
            last = next((s for s in reversed(self.tasks) if s.status in TERMINAL), None)
            if last is not None and last.status != S.FAILED_CONTROLLER:
                await self._set(last, S.FAILED_CONTROLLER, failure, failure_reason=failure)

    def _cluster_names(self) -> Iterable[str]:
        for state in self.tasks:
            if state.task.spec.run or state.handle is not None:
                yield cluster_name(self.job.job_id, state.task.task_id)


__all__ = ["JobHost", "JobLifecycle", "cluster_name", "task_request"]
