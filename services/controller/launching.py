"""Launching a task's cluster until the task starts (contract §7), the same for every strategy.

`ClusterLauncher.launch`:
- takes the job's launch slot, asks the backend, and waits a bounded number of
  checks for the task to start on the new cluster; a task that never starts is a
  failed attempt (its cluster is terminated);
- fails at once for a request that can never launch (`PrecheckError`, or
  "unavailable" without a single region tried): retrying cannot help;
- backs off after any other failed attempt (exponential, with jitter) *after
  giving the slot back*, so other jobs launch meanwhile; the slot is held only
  while actually launching;
- ends in `NoResources` (FAILED_NO_RESOURCE) after an optional retry limit.
  Attempts refused because the backend is unreachable do not count: they say
  nothing about capacity.

Launch retries stop at `launch_timeout`, and a job that never started stops at
its `max_pending` deadline, even while it waits for a launch slot.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    PrecheckError,
    ResourcesUnavailableError,
    TaskStatus,
)
from services.controller.config import LifecycleConfig


class NoResources(Exception):
    """Launch retries exhausted, a launch or pending deadline passed, or no recovery
    allowed (FAILED_NO_RESOURCE)."""


class Deadline:
    """A moment (monotonic seconds) past which launching stops, and what it is called."""

    def __init__(self, at: float, what: str) -> None:
        self.at = at
        self.what = what

    def left(self, now: float) -> float:
        return self.at - now


class Slot(Protocol):
    """A job's launch slot: granted by the scheduler under the launch limits (contract §5)."""

    async def acquire(self, reason: str) -> None:
        """Returns once the slot is held (at once if it already is)."""

    async def release(self, wait_reason: str = "") -> None:
        """Gives the slot back (nothing if not held); `wait_reason` says why the job waits."""


class Backoff:
    """Exponential backoff with jitter: each delay doubles up to `maximum`.

    The jitter draws each delay from the upper half of its step, so the retries
    of many jobs that failed together spread out instead of hitting the cloud at
    the same instant, while a delay never drops below half its step.
    """

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self._next = initial
        self._max = maximum
        self._rng = rng or random.Random()

    def next(self) -> float:
        value = min(self._next, self._max)
        self._next = min(self._next * 2, self._max)
        return value * (0.5 + self._rng.random() / 2)


class ClusterLauncher:
    """Launches one task's clusters under the job's launch slot, with retries and deadlines."""

    def __init__(
        self,
        backend: Backend,
        slot: Slot,
        config: LifecycleConfig,
        note: Callable[[str], None],
        launch_timeout: float | None = None,
        pending: Deadline | None = None,
    ) -> None:
        self.backend = backend
        self.slot = slot
        self.config = config
        self.note = note
        # Seconds launch retries go on (each launch, from its first attempt); None: forever.
        self.launch_timeout = launch_timeout
        # While the job has never started: its max_pending deadline.
        self.pending = pending
        self._launch_deadline: Deadline | None = None

    def _deadline(self) -> Deadline | None:
        """The nearest of the pending deadline and this launch's timeout (set by `launch`)."""
        deadlines = [d for d in (self.pending, self._launch_deadline) if d is not None]
        return min(deadlines, key=lambda d: d.at) if deadlines else None

    async def _acquire(self, reason: str, failed: str = "") -> None:
        """Takes the launch slot, waiting no longer than the nearest deadline.

        `failed` is why the previous attempt failed: when the deadline passes
        while a retry waits for the slot, that failure is what kept the task
        from starting and leads the error.
        """
        deadline = self._deadline()
        if deadline is None:
            await self.slot.acquire(reason)
            return
        try:
            left = max(0.0, deadline.left(self._now()))
            await asyncio.wait_for(self.slot.acquire(reason), left)
        except TimeoutError:
            if failed:
                raise NoResources(f"{deadline.what} exceeded: {failed}; then {reason}") from None
            raise NoResources(f"{deadline.what} exceeded while {reason}") from None

    def _now(self) -> float:
        return self.config.monotonic()

    async def launch(
        self,
        request: LaunchPlan,
        regions: Sequence[str] = (),
        blocked: Sequence[str] = (),
        attempts: int = 0,
    ) -> ClusterHandle:
        """Launches until the task has started on a cluster; returns with the slot held.

        Args:
            request: The task attempt.
            regions: Only these regions, in this order (empty: any allowed).
            blocked: Never these regions.
            attempts: Failed attempts allowed (0: the configured retry limit).

        Raises:
            PrecheckError: the request can never launch.
            NoResources: the allowed attempts failed.
        """
        limit = attempts or self.config.max_launch_retries
        backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
        task = request.task_id
        attempt = failures = 0
        why = ""
        self._launch_deadline = None
        if self.launch_timeout:
            label = f"launch_timeout of {self.launch_timeout:g}s"
            self._launch_deadline = Deadline(self._now() + self.launch_timeout, label)
        while True:
            attempt += 1
            await self._acquire(f"waiting for a launch slot (task {task}, attempt {attempt})", why)
            prefix = f"task {task}: launch attempt {attempt}" + (f" of {limit}" if limit else "")
            self.note(f"{prefix}: launching {request.cluster_name}{_where(regions, blocked)}")
            counted = True
            try:
                handle = await self.backend.launch(request.within(regions, blocked))
            except PrecheckError as error:
                self.note(f"{prefix}: precheck failed, never retried: {error}")
                raise
            except ResourcesUnavailableError as error:
                if not error.regions_tried:
                    # Nothing could even be tried: retrying until up would retry forever.
                    self.note(f"{prefix}: no region can serve this request: {error}")
                    raise PrecheckError(f"no region can serve this request: {error}") from error
                why = f"no capacity in {', '.join(error.regions_tried)}"
            except BackendUnreachableError as error:
                why = f"backend unreachable ({error})"
                counted = False
            except BackendError as error:
                why = f"launch failed: {error}"
            else:
                where = f"{handle.region or '-'}" + (f" ({handle.zone})" if handle.zone else "")
                if await self._started(handle):
                    self.note(f"{prefix}: {handle.cluster_name} is up in {where}; task started")
                    return handle
                why = f"the task did not start on {handle.cluster_name} in {where}"
                await self._discard(handle, request.epoch)
            if counted:
                failures += 1
            if limit and failures >= limit:
                self.note(f"{prefix}: {why}; giving up after {failures} failed attempts")
                raise NoResources(f"{why}; gave up after {failures} failed launch attempts")
            deadline = self._deadline()
            delay = backoff.next()
            left = deadline.left(self._now()) if deadline is not None else None
            if deadline is not None and left is not None and left <= delay:
                # No retry fits before the deadline: wait it out, then give up.
                await self.slot.release(f"{why}; {deadline.what} ends in {max(left, 0):.2f}s")
                await self.config.sleep(max(left, 0.0))
                self.note(f"{prefix}: {why}; {deadline.what} exceeded, giving up")
                raise NoResources(f"{deadline.what} exceeded: {why}")
            reason = f"backing off {delay:.2f}s after attempt {attempt}: {why}"
            self.note(f"{prefix}: {reason}")
            await self.slot.release(reason)
            await self.config.sleep(delay)

    async def _started(self, handle: ClusterHandle) -> bool:
        """Whether the task starts on a new cluster within `start_checks` checks.

        A task that already ended there has started. A cluster that went down
        meanwhile (preempted while the task was being submitted) is a failed attempt
        at once, as in SkyPilot.
        """
        for check in range(max(1, self.config.start_checks)):
            if check:
                await self.config.sleep(self.config.start_check_interval)
            try:
                # The first look comes with the launch's answer when the backend gives it.
                if check == 0 and handle.seen is not None:
                    seen = handle.seen
                else:
                    seen = await self.backend.observe(handle)
            except BackendError as error:
                self.note(f"cannot read the task on {handle.cluster_name} yet: {error}")
                continue
            if seen.end is not None:
                return True
            if seen.cluster != ClusterStatus.UP:
                return False
            if seen.task is not None and seen.task != TaskStatus.PENDING:
                return True
        return False

    async def _discard(self, handle: ClusterHandle, epoch: int) -> None:
        """Terminates the cluster of a failed attempt; the next launch of the name replaces it."""
        try:
            await self.backend.terminate(handle, epoch)
        except BackendError as error:
            # The cleanup terminates every cluster of the job by name and verifies it.
            self.note(f"terminating {handle.cluster_name} failed ({error}); retrying anyway")


def _where(regions: Sequence[str], blocked: Sequence[str]) -> str:
    parts = []
    if regions:
        parts.append(f"in {', '.join(regions)}")
    if blocked:
        parts.append(f"not in {', '.join(blocked)}")
    return " (" + "; ".join(parts) + ")" if parts else " (any allowed region)"


__all__ = ["Backoff", "ClusterLauncher", "Deadline", "NoResources", "Slot"]
