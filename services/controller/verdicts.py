"""Watching a running task until a look at its cluster calls for action (contract §6, §18).

`Judge.until_verdict` takes one look at the cluster at once (a resumed job may
have missed news), then sleeps until there is news of it (pushed by the
backend, or from the replica's batched poll; watch.py), or until a timeout
counting down runs out. Each look is one `Observation`, judged in this order:
- A max_duration that ran out: "timeout".
- The task's end, whatever the cluster's state: "ended" (a task that SUCCEEDED
  stays SUCCEEDED even if its cluster vanished right after).
- The cluster not UP, or UP with its task unreadable: "lost" (preempted).
- The backend cannot tell (unreachable): nothing is concluded. The task stays
  RUNNING with the condition "unreachable since T" (in the lifecycle log and as
  an event); it is "lost" only once the backend says the cluster is gone, or
  after `unreachable_timeout` (the task's `job_recovery.unreachable_timeout`,
  else the backend's, e.g. an SSH pool's, else the replica's), then `silent`:
  its teardown does not wait for it a second time.
- Any other task status is one we do not understand: "unknown".

A preemption notice (a spot reclaim announced) is passed on to the task while
watching: SIGTERM and the notice file, so it can checkpoint (contract §18).
"""

from __future__ import annotations

import dataclasses
import time

from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterStatus,
    StaleEpochError,
    TaskEnd,
    TaskStatus,
)
from services.controller.config import LifecycleConfig
from services.controller.host import JobHost
from services.controller.limits import Limits
from services.controller.messages import MovedAway
from services.controller.tasks import TaskState
from services.controller.watch import News

# Task statuses a running task may report while we keep watching it.
IN_PROGRESS = frozenset({TaskStatus.PENDING, TaskStatus.SETTING_UP, TaskStatus.RUNNING})


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a look at a cluster calls for."""

    kind: str  # "timeout", "ended", "lost" or "unknown"
    why: str = ""
    end: TaskEnd | None = None
    # Lost because it stayed unreachable: its teardown does not wait for it again.
    silent: bool = False


class Judge:
    """Watches the running tasks of one job and says what each look calls for."""

    def __init__(
        self, host: JobHost, backend: Backend, config: LifecycleConfig, limits: Limits
    ) -> None:
        self.host = host
        self.backend = backend
        self.config = config
        self.limits = limits

    async def until_verdict(self, state: TaskState) -> Verdict:
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
        duration = self.limits.duration_left(state)
        if duration is not None:
            waits.append(duration[0])
        return max(0.0, min(waits)) if waits else None

    async def _judge(self, state: TaskState, news: News | None) -> Verdict | None:
        assert state.handle is not None
        name = state.handle.cluster_name
        duration = self.limits.duration_left(state)
        if duration is not None and duration[0] <= 0:
            return Verdict("timeout", f"{duration[1]} exceeded")
        if news is None or isinstance(news, BackendError):
            return await self._unreachable(state, news)
        if news.notice_deadline is not None and news.notice_deadline != state.notice_passed:
            state.notice_passed = news.notice_deadline
            await self._pass_notice(state, news.notice_deadline)
        if state.unreachable_since is not None:
            state.unreachable_since = None
            await state.condition(f"{name} answers again", "")
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
        if news.task in IN_PROGRESS:
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
            await state.condition(f"{condition}; concluding nothing yet", condition)
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


__all__ = ["IN_PROGRESS", "Judge", "Verdict"]
