"""The lifecycle of one job (contract §6, §8), run as one asyncio task on a replica.

For each task in order: skip what already finished (resume); a task without
`run` goes STARTING then SUCCEEDED at once; otherwise STARTING (with its
resources), launch under the job's launch slot through the task's strategy
(attempts.py, strategies.py, launching.py), report RUNNING and give the slot
back, then act on what each look at its cluster calls for (verdicts.py):
- Ended: SUCCEEDED first (the user sees it at once), then the logs copied off
  the cluster and the cluster torn down; a task that SUCCEEDED is never run
  again. User code failed: a node being preempted can look like crashed code,
  so wait a grace period and look again: the cluster not UP is a preemption; UP
  means restart while `max_restarts_on_errors` allows, else FAILED or
  FAILED_SETUP with the reason (exit codes the policy names recover or fail at
  once).
- Lost (preempted, or unreachable past its timeout): logs copied off, the
  cluster torn down, RECOVERING, relaunch through the strategy (under a grant),
  RUNNING with recovery_count + 1.
- Timeout (max_duration, limits.py): the task is stopped with its grace period,
  its logs kept, and FAILED with the reason.
- Unknown task status: FAILED_CONTROLLER.

Every status goes through `TaskState.transition` (tasks.py), and every
teardown copies the attempt's logs off first (teardown.py).

`run_job` (cleanup.py) runs the main path as its own task and then, whatever
happened, the cleanup. A report refused because the job moved to another
replica (`MovedAway`) stops everything at once, silently: the new holder owns
the job. Any other failure ends the job FAILED_CONTROLLER with the reason,
after the cleanup was attempted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    BackendError,
    ClusterHandle,
    ClusterStatus,
    PrecheckError,
    TaskEnd,
    TaskStatus,
)
from services.common.statuses import TERMINAL, JobStatus
from services.controller.attempts import Attempts, launch_plan
from services.controller.config import LifecycleConfig
from services.controller.host import JobHost
from services.controller.launching import NoResources
from services.controller.limits import Limits
from services.controller.strategies import strategy_for
from services.controller.tasks import TaskState
from services.controller.teardown import Teardown
from services.controller.verdicts import Judge

S = JobStatus


class JobLifecycle:
    """Runs one job's tasks in order, each until it ends or one does not succeed."""

    def __init__(
        self,
        job: job_pb2.Job,
        host: JobHost,
        backend: Backend,
        config: LifecycleConfig,
        secrets: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        self.job = job
        self.host = host
        self.backend = backend
        self.config = config
        # Per task: given to its environment, never logged or reported.
        self._secrets = dict(secrets or {})
        self.tasks = [
            TaskState(job.job_id, t, host) for t in sorted(job.tasks, key=lambda t: t.task_id)
        ]
        self.limits = Limits(job, config)
        self.teardown = Teardown(host, backend, config)
        self._judge = Judge(host, backend, config, self.limits)

    @property
    def cancelling(self) -> bool:
        """Whether the job is to be finished as cancelled without running anything more.

        True when a cancel was requested before this replica took the job, or when a
        previous holder died while cancelling it (a task left CANCELLING).
        """
        return self.job.cancel_requested or any(s.status == S.CANCELLING for s in self.tasks)

    async def run(self) -> None:
        """Runs the tasks in order until one does not succeed.

        Raises:
            asyncio.CancelledError: a previous holder was cancelling the job; the
                caller's cleanup finishes the cancel.
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

    def _attempts(self, state: TaskState) -> Attempts:
        """The task's attempts, through the strategy its spec names."""
        request = launch_plan(
            self.job.job_id, self.host.epoch, state.task, self._secrets.get(state.task_id)
        )
        strategy = strategy_for(
            state.task.spec,
            self.backend,
            self.host.slot,
            self.config,
            self.host.note,
            pending=self.limits.pending_deadline(),
        )
        if strategy.policy.unreachable_timeout is not None:
            state.unreachable_timeout = strategy.policy.unreachable_timeout
        return Attempts(
            state, strategy, request, self.host, self.backend, self.teardown, self.limits
        )

    async def _run_task(self, state: TaskState) -> JobStatus:
        attempts = self._attempts(state)
        try:
            if state.status == S.PENDING:
                await state.transition(S.STARTING, f"resources {state.task.resources}")
                if not state.task.spec.run:
                    await state.transition(
                        S.SUCCEEDED, "nothing to run", end_time=self.config.clock()
                    )
                    # A grant that came with the assignment is not needed for this task.
                    await self.host.slot.release()
                    return S.SUCCEEDED
                await attempts.launch()
            else:
                await attempts.resume()
            return await self._settle(attempts)
        except PrecheckError as error:
            await self.host.slot.release()
            reason = f"precheck failed: {error}"
            await state.transition(S.FAILED_PRECHECKS, reason, failure_reason=reason)
        except NoResources as error:
            await self.host.slot.release()
            reason = f"no resources: {error}"
            await state.transition(S.FAILED_NO_RESOURCE, reason, failure_reason=reason)
        return state.status

    async def _settle(self, attempts: Attempts) -> JobStatus:
        """Acts on each verdict on the running task until it ends."""
        state = attempts.state
        while True:
            verdict = await self._judge.until_verdict(state)
            assert state.handle is not None
            handle = state.handle
            if verdict.kind == "ended" and verdict.end is not None:
                if verdict.end.status == TaskStatus.SUCCEEDED:
                    return await self._succeeded(state, handle, verdict.end)
                final = await self._user_failed(attempts, handle, verdict.end)
                if final is not None:
                    return final
            elif verdict.kind == "timeout":
                return await self._timed_out(state, handle, verdict.why)
            elif verdict.kind == "lost":
                self.host.note(
                    f"task {state.task_id}: {handle.cluster_name} in {handle.region or '-'} "
                    f"{verdict.why}: preempted"
                )
                await attempts.recover(f"{handle.cluster_name} was lost", silent=verdict.silent)
            else:
                self.host.note(f"task {state.task_id}: {verdict.why}")
                await state.transition(S.FAILED_CONTROLLER, verdict.why, failure_reason=verdict.why)
                return S.FAILED_CONTROLLER

    async def _succeeded(self, state: TaskState, handle: ClusterHandle, end: TaskEnd) -> JobStatus:
        await state.transition(
            S.SUCCEEDED,
            f"succeeded on {handle.cluster_name}",
            end_time=end.end_time,
            exit_code=end.exit_code,
        )
        await self.teardown.remove(state, handle)
        return S.SUCCEEDED

    async def _timed_out(self, state: TaskState, handle: ClusterHandle, why: str) -> JobStatus:
        """max_duration ran out: stop the task gracefully (SIGTERM, SIGKILL after the grace),
        keep its logs, and fail the job with the reason."""
        grace = self.limits.grace(state)
        self.host.note(f"task {state.task_id}: {why}; stopping it (grace {grace:g}s)")
        await self.teardown.remove(state, handle, grace)
        await state.transition(S.FAILED, why, failure_reason=why)
        return S.FAILED

    async def _user_failed(
        self, attempts: Attempts, handle: ClusterHandle, end: TaskEnd
    ) -> JobStatus | None:
        """Tells crashed user code from a preemption; None when the task goes on running."""
        state, strategy = attempts.state, attempts.strategy
        what = "setup" if end.status == TaskStatus.FAILED_SETUP else "run"
        code = f" with exit code {end.exit_code}" if end.exit_code is not None else ""
        self.host.note(
            f"task {state.task_id}: user {what} failed{code} on {handle.cluster_name}; "
            f"checking the cluster after a {self.config.grace_seconds:g}s grace period"
        )
        await self.config.sleep(self.config.grace_seconds)
        seen = await self.host.look(handle)
        if isinstance(seen, BackendError):
            # Conclude nothing: the next look sees the failure again and decides then.
            self.host.note(f"task {state.task_id}: backend unreachable; deciding later")
            return None
        if seen.cluster != ClusterStatus.UP:
            self.host.note(f"task {state.task_id}: {handle.cluster_name} went down: preempted")
            await attempts.recover(f"{handle.cluster_name} was lost")
            return None
        rule = strategy.on_exit(end.exit_code)
        if rule == "recover":
            why = f"exit code {end.exit_code} is in recover_on_exit_codes"
            self.host.note(f"task {state.task_id}: {why}: recovering like a preemption")
            await attempts.recover(why, end)
            return None
        if rule != "fail" and strategy.may_restart(state.restart_count):
            await attempts.restart(handle, what, end)
            return None
        final = S.FAILED_SETUP if end.status == TaskStatus.FAILED_SETUP else S.FAILED
        reason = f"user {what} exited non-zero{code} on {handle.cluster_name}"
        if rule == "fail":
            reason += f"; exit code {end.exit_code} is in fail_on_exit_codes"
        elif strategy.max_restarts:
            reason += f" after {state.restart_count} restarts"
        await state.transition(
            final,
            reason,
            failure_reason=reason,
            end_time=end.end_time,
            exit_code=end.exit_code,
        )
        await self.teardown.remove(state, handle)
        return final


__all__ = ["JobLifecycle"]
