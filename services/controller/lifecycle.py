"""The lifecycle of one job (contract §6, §8), run as one asyncio task on a replica.

For each task in order: skip what already finished (resume); a task without
`run` goes STARTING then SUCCEEDED at once; otherwise STARTING (with its
resources), launch under the job's launch slot through the task's strategy
(strategies.py, launching.py), report RUNNING and give the slot back, then watch.

Watching (`_until_verdict`) takes one look at the cluster at once (a resumed
job may have missed news), then sleeps until there is news of it (pushed by the
backend, or from the replica's batched poll; watch.py). Each look is one
`Observation`, judged in this order:
- The task's end first, whatever the cluster's state: a task that SUCCEEDED
  stays SUCCEEDED even if its cluster vanished right after, and is never run
  again. SUCCEEDED: mark SUCCEEDED first (the user sees it at once), have the
  logs copied off the cluster, tear it down. User code failed: a node being
  preempted can look like crashed code, so wait a grace period and look again:
  the cluster not UP is a preemption; UP means restart while
  `max_restarts_on_errors` allows, else FAILED or FAILED_SETUP with the reason.
- The cluster not UP, or UP with its task unreadable: preempted. Logs are copied
  off, the cluster torn down, RECOVERING, relaunch through the strategy (under a
  grant), RUNNING with recovery_count + 1.
- The backend cannot tell (unreachable): nothing is concluded. The task stays
  RUNNING with the condition "unreachable since T" (in the lifecycle log and as
  an event); it is recovered only once the backend says the cluster is gone, or
  after `unreachable_timeout` (the task's `job_recovery.unreachable_timeout`, else
  the backend's, e.g. an SSH pool's, else the replica's). A cluster given up that
  way is terminated (with the job's epoch) before the relaunch, but if it still
  cannot be reached the relaunch does not wait for it a second time: every
  backend's launch of a cluster name replaces any older cluster of that name,
  so the backend stops the old one once it can (the ssh backend's reaper, when
  the host answers again).
- Any other task status is one we do not understand: FAILED_CONTROLLER.

Every status goes through `JobLifecycle.transition`, which refuses any move that
`TASK_TRANSITIONS` forbids. Every teardown copies the attempt's logs off first
(`_teardown`), and a cluster verified gone is not torn down twice.

`run_job` runs the main path as its own task and then, whatever happened, the
cleanup (`cleanup.py`). A report refused because the job moved to another
replica (`MovedAway`) stops everything at once, silently: the new holder owns
the job. Any other failure ends the job FAILED_CONTROLLER with the reason,
after the cleanup was attempted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    Observation,
    PrecheckError,
    StaleEpochError,
    TaskEnd,
    TaskRequest,
    TaskStatus,
    cluster_name,
)
from services.common.statuses import TASK_TRANSITIONS, TERMINAL, IllegalTransition, JobStatus
from services.controller.config import LifecycleConfig
from services.controller.launching import Deadline, NoResources, Slot
from services.controller.link import MovedAway
from services.controller.strategies import Strategy, strategy_for

log = logging.getLogger(__name__)
S = JobStatus

# Task statuses a running task may report while we keep watching it.
_IN_PROGRESS = frozenset({TaskStatus.PENDING, TaskStatus.SETTING_UP, TaskStatus.RUNNING})
News = Observation | BackendError


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

    async def report(
        self, task_id: int, status: JobStatus, message: str = "", **fields: Any
    ) -> None:
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


class CleanupFailed(Exception):
    """A cluster could not be terminated: resources may have leaked (FAILED_CONTROLLER)."""


def task_request(
    job_id: int, epoch: int, task: job_pb2.Task, secrets: Mapping[str, str] | None = None
) -> TaskRequest:
    """What to launch for a task attempt; its secrets join its envs only here."""
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
        envs={**spec.envs, **(secrets or {})},
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


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a look at a cluster calls for."""

    kind: str  # "ended", "lost" or "unknown"
    why: str = ""
    end: TaskEnd | None = None
    # Lost because it stayed unreachable: its teardown does not wait for it again.
    silent: bool = False


class JobLifecycle:
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
        self.tasks = [TaskState(t) for t in sorted(job.tasks, key=lambda t: t.task_id)]
        # When the job first started (Unix seconds), if it has: max_pending no longer applies.
        self.job_start: float | None = (
            job.start_time.ToNanoseconds() / 1e9 if job.HasField("start_time") else None
        )

    def grace(self, state: TaskState) -> float:
        """Seconds between SIGTERM and SIGKILL when the task is stopped (contract §18)."""
        spec = state.task.spec
        if spec.HasField("grace_period_seconds"):
            return spec.grace_period_seconds
        return self.config.grace_period

    def _pending_deadline(self) -> Deadline | None:
        """While the job never started: when its max_pending runs out (monotonic seconds)."""
        timeouts = self.job.timeouts
        if self.job_start is not None or not timeouts.HasField("max_pending_seconds"):
            return None
        submitted = self.job.submit_time.ToNanoseconds() / 1e9
        left = submitted + timeouts.max_pending_seconds - self.config.clock()
        label = f"max_pending of {timeouts.max_pending_seconds:g}s"
        return Deadline(self.config.monotonic() + left, label)

    def _duration_left(self, state: TaskState) -> tuple[float, str] | None:
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
        extra.setdefault("attempt", state.attempt)
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

    async def _run_task(self, state: TaskState) -> JobStatus:
        request = task_request(
            self.job.job_id, self.host.epoch, state.task, self._secrets.get(state.task_id)
        )
        strategy = strategy_for(
            state.task.spec,
            self.backend,
            self.host.slot,
            self.config,
            self.host.note,
            pending=self._pending_deadline(),
        )
        if strategy.policy.unreachable_timeout is not None:
            state.unreachable_timeout = strategy.policy.unreachable_timeout
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
            else:
                await self._resume(state, strategy, request)
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

    async def _resume(self, state: TaskState, strategy: Strategy, request: TaskRequest) -> None:
        """Takes a task up where a previous holder left it, from one look at its cluster.

        RUNNING: keep watching the same cluster. STARTING or RECOVERING: the
        previous holder's launch may or may not have happened; a cluster that is up
        with the task running (or done) is adopted rather than relaunched.
        """
        state.handle = self._last_handle(state)
        name = state.handle.cluster_name
        if state.status == S.RUNNING:
            self.host.note(
                f"task {state.task_id}: resumed; watching {name} in {state.region or '-'}"
            )
            await self.host.slot.release()
            return
        seen = await self.host.look(state.handle)
        if isinstance(seen, Observation) and (
            (seen.end is not None and seen.end.status == TaskStatus.SUCCEEDED)
            or (seen.cluster == ClusterStatus.UP and (seen.task in _IN_PROGRESS or seen.end))
        ):
            await self._launched(state, state.handle, f"resumed: {name} is up; adopted")
            return
        await self._recover(state, strategy, request, "resumed: the cluster's state is unknown")

    def _last_handle(self, state: TaskState) -> ClusterHandle:
        """The task's cluster as last known, found by name (from another process if need be)."""
        if state.handle is not None:
            return state.handle
        handle = self.backend.handle_for(cluster_name(self.job.job_id, state.task_id))
        return dataclasses.replace(handle, region=handle.region or state.region)

    async def _launched(self, state: TaskState, handle: ClusterHandle, what: str) -> None:
        state.handle = handle
        state.gone = False
        state.region = handle.region or state.region
        now = self.config.clock()
        state.first_start = state.first_start or now
        self.job_start = self.job_start or now
        where = state.region or "-"
        await self.transition(state, S.RUNNING, f"{what} on {handle.cluster_name} in {where}")
        await self.host.slot.release()

    async def _recover(
        self,
        state: TaskState,
        strategy: Strategy,
        request: TaskRequest,
        why: str,
        end: TaskEnd | None = None,
        silent: bool = False,
    ) -> None:
        """Relaunches a task whose cluster was lost, if the policy allows.

        With `silent` (the cluster stayed unreachable past the timeout), a terminate
        the backend still cannot carry out does not hold the relaunch back: the
        relaunch of the name replaces the old cluster (see the module docstring).

        Raises:
            NoResources: no recovery allowed (strategy NONE, max_recoveries reached), or
                launching gave up.
        """
        lost = self._last_handle(state)
        refused = strategy.may_recover(state.recovery_count)
        if refused:
            await self._teardown(state, lost)
            raise NoResources(refused)
        if state.status != S.RECOVERING:
            await self.transition(state, S.RECOVERING, why, **_exit(end))
        await self._teardown(state, lost, silent=silent)
        number = state.recovery_count + 1
        self.host.note(
            f"task {state.task_id}: recovery {number} with {strategy.name}; "
            f"{lost.cluster_name} was lost in {lost.region or 'an unknown region'}"
        )
        handle = await strategy.recover(strategy.for_recovery(request, number), lost)
        state.recovery_count = number
        await self._launched(state, handle, f"recovery {number}: running")

    # --- watching ----------------------------------------------------------------------------

    async def _watch(self, state: TaskState, strategy: Strategy, request: TaskRequest) -> JobStatus:
        while True:
            verdict = await self._until_verdict(state)
            assert state.handle is not None
            handle = state.handle
            if verdict.kind == "ended" and verdict.end is not None:
                if verdict.end.status == TaskStatus.SUCCEEDED:
                    return await self._succeeded(state, handle, verdict.end)
                final = await self._user_failed(state, strategy, request, handle, verdict.end)
                if final is not None:
                    return final
            elif verdict.kind == "timeout":
                return await self._timed_out(state, handle, verdict.why)
            elif verdict.kind == "lost":
                self.host.note(
                    f"task {state.task_id}: {handle.cluster_name} in {handle.region or '-'} "
                    f"{verdict.why}: preempted"
                )
                await self._recover(
                    state,
                    strategy,
                    request,
                    f"{handle.cluster_name} was lost",
                    silent=verdict.silent,
                )
            else:
                self.host.note(f"task {state.task_id}: {verdict.why}")
                await self.transition(
                    state, S.FAILED_CONTROLLER, verdict.why, failure_reason=verdict.why
                )
                return S.FAILED_CONTROLLER

    async def _until_verdict(self, state: TaskState) -> Verdict:
        """Watches the task's cluster until a look calls for action."""
        assert state.handle is not None
        watcher = self.host.watch(state.handle)
        try:
            news: News | None = await self.host.look(state.handle)
            while True:
                verdict = await self._judge(state, news)
                if verdict is not None:
                    return verdict
                news = await watcher.next(self._next_deadline(state))
                deadline = watcher.notice_deadline
                if deadline is not None and deadline != state.notice_passed:
                    state.notice_passed = deadline
                    await self._pass_notice(state, deadline)
        finally:
            watcher.close()

    def _next_deadline(self, state: TaskState) -> float | None:
        """How long to wait for news at most: until the unreachable timeout (if counting) or
        the max_duration, whichever comes first."""
        waits: list[float] = []
        if state.unreachable_since is not None:
            timeout = state.unreachable_timeout or self.config.unreachable_timeout
            waits.append(state.unreachable_since + timeout - self.config.monotonic())
        duration = self._duration_left(state)
        if duration is not None:
            waits.append(duration[0])
        return max(0.0, min(waits)) if waits else None

    async def _judge(self, state: TaskState, news: News | None) -> Verdict | None:
        assert state.handle is not None
        name = state.handle.cluster_name
        duration = self._duration_left(state)
        if duration is not None and duration[0] <= 0:
            return Verdict("timeout", f"{duration[1]} exceeded")
        if news is None or isinstance(news, BackendError):
            return await self._unreachable(state, news)
        if news.notice_deadline is not None and news.notice_deadline != state.notice_passed:
            state.notice_passed = news.notice_deadline
            await self._pass_notice(state, news.notice_deadline)
        if state.unreachable_since is not None:
            state.unreachable_since = None
            await self._condition(state, f"{name} answers again", "")
        end = news.end
        if end is None and isinstance(news.task, TaskStatus) and news.task.finished:
            # A finished status is an end, even from a backend that gave no end time.
            end = TaskEnd(news.task, None, self.config.clock())
        if end is not None:
            return Verdict("ended", end=end)
        if news.cluster != ClusterStatus.UP:
            return Verdict("lost", f"is {news.cluster.value}")
        if news.task is None:
            return Verdict("lost", "is up but its task is unreadable")
        if news.task in _IN_PROGRESS:
            return None
        return Verdict("unknown", f"unknown task status {news.task!r} on {name}")

    async def _unreachable(self, state: TaskState, error: BackendError | None) -> Verdict | None:
        """Nothing is concluded while the backend cannot tell, until the timeout."""
        assert state.handle is not None
        now = self.config.monotonic()
        # The backend's timeout for this cluster (an SSH pool's), from any error that carries
        # it; the task's own job_recovery.unreachable_timeout wins over it.
        own = state.task.spec.resources.HasField("unreachable_timeout_seconds")
        if not own and isinstance(error, BackendUnreachableError) and error.timeout is not None:
            state.unreachable_timeout = error.timeout
        if state.unreachable_since is None:
            if error is None:
                return None  # a quiet interval, nothing to say
            state.unreachable_since = now
            since = time.strftime("%H:%M:%S", time.gmtime(self.config.clock()))
            condition = f"{state.handle.cluster_name} unreachable since {since} UTC ({error})"
            await self._condition(state, f"{condition}; concluding nothing yet", condition)
            return None
        timeout = state.unreachable_timeout or self.config.unreachable_timeout
        if now - state.unreachable_since >= timeout:
            state.unreachable_since = None
            return Verdict("lost", f"stayed unreachable for {timeout:g}s", silent=True)
        return None

    async def _pass_notice(self, state: TaskState, deadline: float) -> None:
        """A spot reclaim was announced: the task gets SIGTERM and the notice file now, so it
        can checkpoint before its cluster goes (contract §18)."""
        assert state.handle is not None
        name = state.handle.cluster_name
        at = time.strftime("%H:%M:%S", time.gmtime(deadline))
        self.host.note(f"task {state.task_id}: {name} will be reclaimed at {at} UTC; notifying")
        try:
            await self.backend.notify_preemption(state.handle, self.host.epoch, deadline)
        except StaleEpochError as stale:
            raise MovedAway(f"notice to {name}: {stale}") from stale
        except BackendError as error:
            self.host.note(f"task {state.task_id}: the notice could not be passed on: {error}")

    async def _condition(self, state: TaskState, message: str, condition: str) -> None:
        """A visible condition of a running task (no status change): set or cleared ("")."""
        self.host.note(f"task {state.task_id}: {message}")
        await self.host.report(
            state.task_id,
            state.status,
            message,
            cluster_name=state.handle.cluster_name if state.handle else "",
            region=state.region,
            resources=state.task.resources,
            recovery_count=state.recovery_count,
            restart_count=state.restart_count,
            condition=condition,
        )

    # --- outcomes ------------------------------------------------------------------------------

    async def _succeeded(self, state: TaskState, handle: ClusterHandle, end: TaskEnd) -> JobStatus:
        await self.transition(
            state,
            S.SUCCEEDED,
            f"succeeded on {handle.cluster_name}",
            end_time=end.end_time,
            **_exit(end),
        )
        await self._teardown(state, handle)
        return S.SUCCEEDED

    async def _timed_out(self, state: TaskState, handle: ClusterHandle, why: str) -> JobStatus:
        """max_duration ran out: stop the task gracefully (SIGTERM, SIGKILL after the grace),
        keep its logs, and fail the job with the reason."""
        grace = self.grace(state)
        self.host.note(f"task {state.task_id}: {why}; stopping it (grace {grace:g}s)")
        await self._teardown(state, handle, grace)
        reason = f"{why}"
        await self.transition(state, S.FAILED, reason, failure_reason=reason)
        return S.FAILED

    async def _user_failed(
        self,
        state: TaskState,
        strategy: Strategy,
        request: TaskRequest,
        handle: ClusterHandle,
        end: TaskEnd,
    ) -> JobStatus | None:
        """Tells crashed user code from a preemption; None when the task goes on running."""
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
            await self._recover(state, strategy, request, f"{handle.cluster_name} was lost")
            return None
        rule = strategy.on_exit(end.exit_code)
        if rule == "recover":
            why = f"exit code {end.exit_code} is in recover_on_exit_codes"
            self.host.note(f"task {state.task_id}: {why}: recovering like a preemption")
            await self._recover(state, strategy, request, why, end)
            return None
        if rule != "fail" and strategy.may_restart(state.restart_count):
            attempt = state.attempt
            state.restart_count += 1
            reason = f"user {what} failed; restart {state.restart_count} of {strategy.max_restarts}"
            await self.transition(state, S.RECOVERING, reason, attempt=attempt, **_exit(end))
            await self._teardown(state, handle, attempt=attempt)
            state.handle = None
            new = await strategy.restart(request, handle)
            await self._launched(state, new, f"restart {state.restart_count}: running")
            return None
        final = S.FAILED_SETUP if end.status == TaskStatus.FAILED_SETUP else S.FAILED
        reason = f"user {what} exited non-zero{code} on {handle.cluster_name}"
        if rule == "fail":
            reason += f"; exit code {end.exit_code} is in fail_on_exit_codes"
        elif strategy.max_restarts:
            reason += f" after {state.restart_count} restarts"
        await self.transition(
            state, final, reason, failure_reason=reason, end_time=end.end_time, **_exit(end)
        )
        await self._teardown(state, handle)
        return final

    # --- teardown -----------------------------------------------------------------------------

    async def _teardown(
        self,
        state: TaskState,
        handle: ClusterHandle,
        grace: float = 0.0,
        attempt: int | None = None,
        silent: bool = False,
    ) -> None:
        """Copies the attempt's logs off the cluster, then terminates it and verifies it is gone.

        With a `grace` the task is stopped first (SIGTERM, SIGKILL after the grace) and
        its logs copied once it stopped, so what it wrote while stopping is kept. With
        `silent`, one terminate is tried and a backend that still cannot be reached is
        left to stop the cluster itself (see `_recover`).

        Raises:
            CleanupFailed: it could not be terminated (resources may have leaked).
            MovedAway: a newer epoch of the job holds the cluster.
        """
        if state.gone and state.handle is handle:
            return
        if grace > 0 and await self._stop(handle, grace):
            grace = 0.0  # stopped: nothing is left to wait for
        await self.host.fetch_logs(state.task_id, handle, attempt or state.attempt)
        if not await self._terminate(handle, grace, silent=silent):
            return
        if state.handle is handle or state.handle is None:
            state.gone = True

    async def _stop(self, handle: ClusterHandle, grace: float) -> bool:
        """Stops the task gracefully, keeping its cluster; False when the backend could not
        (the terminate that follows then gives the grace).

        Raises:
            MovedAway: a newer epoch of the job holds the cluster.
        """
        try:
            await self.backend.stop(handle, self.host.epoch, grace)
        except StaleEpochError as stale:
            raise MovedAway(f"stop {handle.cluster_name}: {stale}") from stale
        except BackendError as error:
            self.host.note(f"stop {handle.cluster_name}: {error}; terminating with the grace")
            return False
        return True

    async def _terminate(
        self, handle: ClusterHandle, grace: float = 0.0, silent: bool = False
    ) -> bool:
        """Terminates a cluster and verifies it is gone, bounded in time and attempts.

        Gone means the backend's terminate said it saw the cluster gone, or else a
        `cluster_exists` asked afterwards says so.

        While the backend is unreachable nothing is concluded and attempts are not
        counted, but only for `unreachable_timeout`: then the cleanup has failed.
        With `silent` (the cluster already stayed unreachable past its timeout) an
        unreachable backend is not waited for again.

        Returns:
            True once the cluster is verified gone; False when, with `silent`, the
            backend could not be reached.

        Raises:
            CleanupFailed: still there after `terminate_attempts` attempts, or the backend
                stayed unreachable past `unreachable_timeout`.
            MovedAway: a newer epoch of the job holds the cluster.
        """
        name = handle.cluster_name
        attempts = max(1, self.config.terminate_attempts)
        attempt = 0
        unreachable_since: float | None = None
        while True:
            try:
                if await self.backend.terminate(handle, self.host.epoch, grace):
                    return True
                if not await self.backend.cluster_exists(name):
                    return True
                error = "it still exists after terminate"
            except StaleEpochError as stale:
                raise MovedAway(f"terminate {name}: {stale}") from stale
            except BackendUnreachableError as unreachable:
                if silent:
                    self.host.note(
                        f"terminate {name}: {unreachable}; relaunching without waiting again: "
                        "the relaunch replaces it, and the backend stops it once it answers"
                    )
                    return False
                now = self.config.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    self.host.note(f"terminate {name}: {unreachable}; retrying until it answers")
                elif now - unreachable_since >= self.config.unreachable_timeout:
                    raise CleanupFailed(
                        f"cluster {name} could not be terminated: the backend stayed unreachable "
                        f"for {self.config.unreachable_timeout:g}s; it may have leaked"
                    ) from unreachable
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


def _exit(end: TaskEnd | None) -> dict[str, Any]:
    """The exit code field of a report, when the task's end gave one."""
    return {"exit_code": end.exit_code} if end is not None and end.exit_code is not None else {}


__all__ = [
    "CleanupFailed",
    "JobHost",
    "JobLifecycle",
    "TaskState",
    "Watcher",
    "cluster_name",
    "task_request",
]
