"""The lifecycle of one job (SPEC §6, §8), run as one asyncio task on a replica.

For each task in order: skip what already finished (resume); a task without
`run` goes STARTING then SUCCEEDED at once; otherwise STARTING (with its
resources), launch under the job's launch slot through the task's strategy
(strategies.py), report RUNNING and give the slot back, then watch.

Watching looks at the cluster at once (a resumed job may have missed news), then
each time the backend pushes news of it, or every `poll_interval` when it
cannot push. Nothing is concluded while the backend is unreachable.
- Task SUCCEEDED: mark SUCCEEDED first (the user sees it at once), then have
  the logs copied off the cluster, then tear the cluster down.
- User code failed: a node being preempted can look like crashed code, so wait
  a grace period and ask whether the cluster is still healthy. Unhealthy is a
  preemption; healthy means restart while `max_restarts_on_errors` allows, else
  FAILED or FAILED_SETUP with the reason (logs copied first).
- Cluster not UP, or its task unreadable: preempted. Tear it down, RECOVERING,
  relaunch through the strategy (under a grant), RUNNING with recovery_count + 1.
- Any other task status is one we do not understand: FAILED_CONTROLLER.

Every status goes through `JobLifecycle.transition`, which refuses any move that
`TASK_TRANSITIONS` forbids: a bug fails loudly instead of dragging a job
backwards. Reports go through `JobHost`, whose reports fail once this replica no
longer holds the job, which ends the lifecycle at once.

`run_job` runs the main path as its own task and then, whatever happened, the
cleanup (`JobLifecycle.cleanup`): a cancel interrupts the main path wherever it
waits (for a grant, a launch, a backoff, a poll); the cleanup cancels what never
ran, terminates every cluster of the job and verifies it is gone, and leaves
each task in exactly one terminal status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, Protocol

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    PrecheckError,
    TaskRequest,
    TaskStatus,
)
from services.common.statuses import (
    ACTIVE,
    TASK_TRANSITIONS,
    TERMINAL,
    IllegalTransition,
    JobStatus,
)
from services.controller.config import LifecycleConfig
from services.controller.strategies import NoResources, Slot, Strategy, strategy_for

log = logging.getLogger(__name__)
S = JobStatus

# Task statuses a running task may report while we keep watching it.
_IN_PROGRESS = frozenset({TaskStatus.PENDING, TaskStatus.SETTING_UP, TaskStatus.RUNNING})
_USER_FAILED = frozenset({TaskStatus.FAILED, TaskStatus.FAILED_SETUP})


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
        """Appends a line to the job's lifecycle log (`mj logs --controller`)."""

    async def fetch_logs(self, task_id: int, handle: ClusterHandle) -> None:
        """Has the logs service copy the task's logs off the cluster."""

    async def cluster_changed(self, cluster_name: str, timeout: float) -> None:
        """Returns when the backend pushes news of the cluster, or after `timeout`."""


class CleanupFailed(Exception):
    """A cluster could not be terminated: resources may have leaked (FAILED_CONTROLLER)."""


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
        self.task_id = task.task_id
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

    @property
    def cancelling(self) -> bool:
        """Whether the job is to be finished as cancelled without running anything more.

        True when a cancel was requested before this replica took the job, or when a
        previous holder died while cancelling it (a task left CANCELLING).
        """
        return self.job.cancel_requested or any(s.status == S.CANCELLING for s in self.tasks)

    # --- the one way a status changes ------------------------------------------------------

    async def transition(
        self, state: TaskState, status: JobStatus, message: str = "", **extra: Any
    ) -> None:
        """Moves a task to `status`, logs it and reports it.

        Raises:
            IllegalTransition: `TASK_TRANSITIONS` does not allow the move (a bug here).
        """
        old = state.status
        if status == old or status not in TASK_TRANSITIONS[old]:
            raise IllegalTransition(
                f"job {self.job.job_id} task {state.task_id}: {old.name} -> {status.name} "
                "is not allowed"
            )
        state.status = status
        handle = state.handle
        self.host.note(
            f"task {state.task_id}: {status.name}"
            + (f" ({message})" if message else "")
            + f" [was {old.name}]"
        )
        await self.host.report(
            state.task_id,
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
        """Runs the tasks in order until one does not succeed.

        Raises:
            asyncio.CancelledError: a previous holder was cancelling the job; the
                caller's cleanup finishes the cancel (as seed 000 does).
        """
        for state in self.tasks:
            if state.status == S.CANCELLING:
                self.host.note(f"task {state.task_id}: was being cancelled; finishing the cancel")
                raise asyncio.CancelledError()
            if state.status == S.SUCCEEDED:
                self.host.note(f"task {state.task_id}: already SUCCEEDED; skipped")
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
                await self.transition(state, S.STARTING, f"resources {state.task.resources}")
                if not state.task.spec.run:
                    await self.transition(
                        state, S.SUCCEEDED, "nothing to run", end_time=self.config.clock()
                    )
                    # A grant that came with the assignment is not needed for this task.
                    await self.host.slot.release()
                    return S.SUCCEEDED
                handle = await strategy.launch(request)
                await self._launched(state, handle, "launched")
            elif state.status == S.RUNNING:
                state.handle = self._last_handle(state)
                self.host.note(
                    f"task {state.task_id}: resumed; watching {request.cluster_name} "
                    f"in {state.region or '-'}"
                )
                await self.host.slot.release()
            else:
                # STARTING or RECOVERING when resumed: what became of the cluster is unknown.
                await self._recover(
                    state, strategy, request, "resumed: the cluster's state is unknown"
                )
            return await self._watch(state, strategy, request)
        except PrecheckError as error:
            await self.host.slot.release()
            reason = f"precheck failed: {error}"
            await self.transition(state, S.FAILED_PRECHECKS, reason, failure_reason=reason)
        except NoResources as error:
            await self.host.slot.release()
            reason = f"no resources: {error}"
            await self.transition(state, S.FAILED_NO_RESOURCE, reason, failure_reason=reason)
        return state.status

    def _last_handle(self, state: TaskState) -> ClusterHandle:
        """The task's cluster as last known, found by name (from another process if need be)."""
        if state.handle is not None:
            return state.handle
        handle = self.backend.handle_for(cluster_name(self.job.job_id, state.task_id))
        return dataclasses.replace(handle, region=handle.region or state.region)

    async def _launched(self, state: TaskState, handle: ClusterHandle, what: str) -> None:
        state.handle = handle
        state.region = handle.region
        where = handle.region or "-"
        await self.transition(state, S.RUNNING, f"{what} on {handle.cluster_name} in {where}")
        await self.host.slot.release()

    async def _recover(
        self, state: TaskState, strategy: Strategy, request: TaskRequest, why: str
    ) -> None:
        lost = self._last_handle(state)
        if state.status != S.RECOVERING:
            await self.transition(state, S.RECOVERING, why)
        await self._terminate(lost)
        state.handle = None
        number = state.recovery_count + 1
        self.host.note(
            f"task {state.task_id}: recovery {number} with {strategy.name}; "
            f"{lost.cluster_name} was lost in {lost.region or 'an unknown region'}"
        )
        handle = await strategy.recover(request, lost)
        state.recovery_count = number
        await self._launched(state, handle, f"recovery {number}: running")

    async def _watch(self, state: TaskState, strategy: Strategy, request: TaskRequest) -> JobStatus:
        look_now = True
        while True:
            assert state.handle is not None
            handle = state.handle
            if not look_now:
                await self.host.cluster_changed(handle.cluster_name, self.config.poll_interval)
            look_now = False
            seen = await self._observe(handle)
            if seen is None:
                continue
            cluster, status = seen
            if cluster != ClusterStatus.UP or status is None:
                what = "its task is unreadable" if cluster == ClusterStatus.UP else cluster.value
                self.host.note(
                    f"task {state.task_id}: {handle.cluster_name} in {handle.region or '-'} "
                    f"is {what}: preempted"
                )
                await self._recover(state, strategy, request, f"{handle.cluster_name} was lost")
                look_now = True
                continue
            if status == TaskStatus.SUCCEEDED:
                return await self._succeeded(state, handle)
            if status in _USER_FAILED:
                final = await self._user_failed(state, strategy, request, handle, status)
                if final is not None:
                    return final
                look_now = True
                continue
            if status not in _IN_PROGRESS:
                reason = f"unknown task status {status!r} on {handle.cluster_name}"
                self.host.note(f"task {state.task_id}: {reason}")
                await self.transition(state, S.FAILED_CONTROLLER, reason, failure_reason=reason)
                return S.FAILED_CONTROLLER

    async def _observe(
        self, handle: ClusterHandle
    ) -> tuple[ClusterStatus, TaskStatus | None] | None:
        """The cluster's status and its task's, or None when the backend cannot say now."""
        try:
            if await self.backend.reachable():
                cluster = await self.backend.cluster_status(handle)
                up = cluster == ClusterStatus.UP
                return cluster, (await self.backend.task_status(handle) if up else None)
            why = "backend unreachable"
        except BackendError as error:
            why = f"backend error ({error})"
        self.host.note(f"{handle.cluster_name}: {why}; concluding nothing, looking again later")
        return None

    async def _succeeded(self, state: TaskState, handle: ClusterHandle) -> JobStatus:
        end = await self._end_time(handle)
        await self.transition(
            state, S.SUCCEEDED, f"succeeded on {handle.cluster_name}", end_time=end
        )
        await self.host.fetch_logs(state.task_id, handle)
        await self._terminate(handle)
        return S.SUCCEEDED

    async def _user_failed(
        self,
        state: TaskState,
        strategy: Strategy,
        request: TaskRequest,
        handle: ClusterHandle,
        status: TaskStatus,
    ) -> JobStatus | None:
        """Tells crashed user code from a preemption; None when the task goes on running."""
        what = "setup" if status == TaskStatus.FAILED_SETUP else "run"
        self.host.note(
            f"task {state.task_id}: user {what} failed on {handle.cluster_name}; "
            f"checking the cluster after a {self.config.grace_seconds:g}s grace period"
        )
        await self.config.sleep(self.config.grace_seconds)
        try:
            reachable = await self.backend.reachable()
            healthy = reachable and await self.backend.cluster_status(handle) == ClusterStatus.UP
        except BackendError:
            reachable = False
        if not reachable:
            # Conclude nothing: the next look sees the failure again and decides then.
            self.host.note(f"task {state.task_id}: backend unreachable; deciding later")
            return None
        if not healthy:
            self.host.note(f"task {state.task_id}: {handle.cluster_name} went down: preempted")
            await self._recover(state, strategy, request, f"{handle.cluster_name} was lost")
            return None
        await self.host.fetch_logs(state.task_id, handle)
        if strategy.may_restart(state.restart_count):
            state.restart_count += 1
            reason = f"user {what} failed; restart {state.restart_count} of {strategy.max_restarts}"
            await self.transition(state, S.RECOVERING, reason)
            await self._terminate(handle)
            state.handle = None
            new = await strategy.restart(request, handle)
            await self._launched(state, new, f"restart {state.restart_count}: running")
            return None
        final = S.FAILED_SETUP if status == TaskStatus.FAILED_SETUP else S.FAILED
        reason = f"user {what} exited non-zero on {handle.cluster_name}"
        if strategy.max_restarts:
            reason += f" after {state.restart_count} restarts"
        end = await self._end_time(handle)
        await self.transition(state, final, reason, failure_reason=reason, end_time=end)
        await self._terminate(handle)
        return final

    async def _end_time(self, handle: ClusterHandle) -> float:
        try:
            end = await self.backend.task_end(handle)
            return end.end_time if end is not None else self.config.clock()
        except BackendError:
            return self.config.clock()

    # --- cleanup ---------------------------------------------------------------------------

    async def _terminate(self, handle: ClusterHandle) -> None:
        """Terminates a cluster and verifies it is gone.

        Raises:
            CleanupFailed: it was still there after `terminate_attempts` attempts.
        """
        name = handle.cluster_name
        attempts = max(1, self.config.terminate_attempts)
        attempt = 0
        while True:
            try:
                await self.backend.terminate(handle, self.host.epoch)
                if not await self.backend.cluster_exists(name):
                    return
                error = "it still exists after terminate"
            except BackendUnreachableError as unreachable:
                # Nothing can be concluded while the backend cannot answer: wait, uncounted.
                self.host.note(f"terminate {name}: {unreachable}; retrying")
                await self.config.sleep(self.config.terminate_retry_delay)
                continue
            except BackendError as failed:
                error = str(failed)
            attempt += 1
            self.host.note(f"terminate {name} failed (attempt {attempt} of {attempts}): {error}")
            if attempt >= attempts:
                raise CleanupFailed(
                    f"cluster {name} could not be terminated ({error}); it may have leaked"
                )
            await self.config.sleep(self.config.terminate_retry_delay * attempt)

    async def cleanup(self, cancelled: bool, error: str = "") -> None:
        """Ends every unfinished task and removes every cluster of the job.

        With `cancelled`, a task in flight goes CANCELLING, then CANCELLED once its
        cluster is verified gone. Tasks that never ran end CANCELLED either way
        (after a cancel, or after an earlier task did not succeed). A task whose
        cluster cannot be terminated ends FAILED_CONTROLLER with the reason, even
        from a terminal status. A task the main path left in flight without a
        cancel (it raised `error`) ends FAILED_CONTROLLER.
        """
        await self.host.slot.release()
        if cancelled:
            for state in self.tasks:
                if state.status in ACTIVE - {S.CANCELLING}:
                    await self.transition(state, S.CANCELLING, "cancel requested")
        failures: dict[int, str] = {}
        for state in self.tasks:
            if state.status == S.PENDING or not state.task.spec.run:
                continue  # never launched: no cluster can exist
            handle = self._last_handle(state)
            try:
                await self._terminate(handle)
            except CleanupFailed as failed:
                failures[state.task_id] = f"cleanup failed: {failed}"
                continue
            self.host.note(f"task {state.task_id}: {handle.cluster_name} is gone")
        for state in self.tasks:
            failure = failures.get(state.task_id)
            if failure:
                if state.status != S.FAILED_CONTROLLER:
                    await self.transition(
                        state, S.FAILED_CONTROLLER, failure, failure_reason=failure
                    )
            elif state.status == S.CANCELLING:
                await self.transition(state, S.CANCELLED, "cancelled; its cluster is gone")
            elif state.status == S.PENDING:
                why = "cancelled" if cancelled else "not run: an earlier task did not succeed"
                await self.transition(state, S.CANCELLED, why)
            elif state.status in ACTIVE:
                reason = error or "the lifecycle stopped before the task finished"
                await self.transition(state, S.FAILED_CONTROLLER, reason, failure_reason=reason)


class CancelRequest:
    """A job's cancel request: set once, from any task; interrupts the main path at once.

    Cheaper than an `asyncio.Event` plus a task waiting on it, which matters with
    20,000 jobs on one replica.
    """

    def __init__(self, requested: bool = False) -> None:
        self._requested = requested
        self._main: asyncio.Task[None] | None = None

    def set(self) -> None:
        """Requests the cancel (idempotent)."""
        self._requested = True
        if self._main is not None and not self._main.done():
            self._main.cancel()

    def is_set(self) -> bool:
        return self._requested


async def run_job(
    lifecycle: JobLifecycle,
    cancel: CancelRequest,
    stop_on: tuple[type[BaseException], ...] = (),
) -> None:
    """Runs a job's main path, then its cleanup, whatever happened (SPEC §6, §8).

    The main path runs as its own task, so that a cancel interrupts it wherever it
    waits (for a grant, a launch, a backoff, a poll) at once, and the cleanup
    still runs here afterwards. The cleanup itself is never interrupted by a
    cancel: it is already ending the job, so every task ends in exactly one
    terminal status and no cluster is left.

    Args:
        lifecycle: The job.
        cancel: Its cancel request, set before or during the run.
        stop_on: Errors that mean this replica no longer holds the job: re-raised at
            once, without cleanup (the new holder cleans up).

    Cancelling the task that runs `run_job` (a revoke) stops the main path too and
    reports nothing more.
    """
    cancelled = cancel.is_set() or lifecycle.cancelling
    error = ""
    if not cancelled:
        main = asyncio.create_task(lifecycle.run(), name=f"lifecycle-{lifecycle.job.job_id}")
        cancel._main = main
        try:
            await asyncio.wait({main})
        finally:
            cancel._main = None
            if not main.done():
                main.cancel()
                # The main path unwinds (its awaits are cancelled) before anything else.
                await asyncio.wait({main})
        cancelled = main.cancelled() or cancel.is_set()
        failure = None if main.cancelled() else main.exception()
        if failure is not None:
            if isinstance(failure, stop_on):
                raise failure
            log.error("lifecycle failed", exc_info=failure, extra={"job_id": lifecycle.job.job_id})
            error = f"controller error: {failure!r}"
            lifecycle.host.note(error)
    await lifecycle.cleanup(cancelled, error=error)


__all__ = [
    "CancelRequest",
    "CleanupFailed",
    "JobHost",
    "JobLifecycle",
    "TaskState",
    "cluster_name",
    "run_job",
    "task_request",
]
