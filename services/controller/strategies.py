"""Launch and recovery strategies (SPEC §7), chosen by name from the task's spec.

Every strategy launches the same way: take a launch slot, ask the backend, and
on "no capacity" give the slot back while backing off (exponential, with
jitter) so other jobs can launch meanwhile. A request that can never launch is
a precheck failure at once. They differ in how they recover a preempted task:

- FAILOVER relaunches in the region it lost first, then anywhere allowed.
- EAGER_NEXT_REGION relaunches with the lost region blocked, then anywhere.
"""

from __future__ import annotations

import abc
import logging
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    ClusterHandle,
    PrecheckError,
    ResourcesUnavailableError,
    TaskRequest,
)
from services.controller.config import LifecycleConfig

log = logging.getLogger(__name__)


class NoResources(Exception):
    """Launch retries exhausted (FAILED_NO_RESOURCE)."""


class Slot(Protocol):
    async def acquire(self, reason: str) -> None: ...

    async def release(self, wait_reason: str = "") -> None: ...


class Backoff:
    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self._next = initial
        self._max = maximum
        self._rng = rng or random.Random()

    def next(self) -> float:
        value = self._next
        self._next = min(self._next * 2, self._max)
        # Full jitter over the upper half keeps retries of many jobs apart.
        return value * (0.5 + self._rng.random() / 2)


class Strategy(abc.ABC):
    name = ""

    def __init__(
        self,
        backend: Backend,
        slot: Slot,
        config: LifecycleConfig,
        note: Callable[[str], None],
    ) -> None:
        self.backend = backend
        self.slot = slot
        self.config = config
        self.note = note

    async def launch(
        self,
        request: TaskRequest,
        regions: Sequence[str] = (),
        blocked: Sequence[str] = (),
        attempts: int = 0,
    ) -> ClusterHandle:
        """Launches until the task has started on a cluster.

        Raises:
            PrecheckError: the request can never launch.
            NoResources: `attempts` (or the configured retry limit) ran out.
        """
        limit = attempts or self.config.max_launch_retries
        backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
        attempt = 0
        while True:
            attempt += 1
            await self.slot.acquire("waiting for a launch slot")
            where = _where(regions, blocked)
            self.note(f"launching {request.cluster_name} (attempt {attempt}{where})")
            try:
                handle = await self.backend.launch(request, regions, blocked)
            except ResourcesUnavailableError as error:
                if not error.regions_tried:
                    raise PrecheckError(f"no region can serve this request: {error}") from error
                tried = ", ".join(error.regions_tried)
                if limit and attempt >= limit:
                    raise NoResources(f"no capacity after {attempt} attempts ({tried})") from error
                delay = backoff.next()
                reason = f"backing off {delay:.1f}s after no capacity in {tried}"
                self.note(reason)
                await self.slot.release(reason)
                await self.config.sleep(delay)
                continue
            if await self._started(handle):
                self.note(f"task started on {handle.cluster_name} in {handle.region or '-'}")
                return handle
            self.note(f"task did not start on {handle.cluster_name}; terminating and retrying")
            await self.backend.terminate(handle)
            if limit and attempt >= limit:
                raise NoResources(f"the task did not start after {attempt} attempts")

    async def _started(self, handle: ClusterHandle) -> bool:
        for _ in range(max(1, self.config.start_checks)):
            status = await self.backend.task_status(handle)
            if status is not None and status.name != "PENDING":
                return True
            await self.config.sleep(self.config.start_check_interval)
        return False

    @abc.abstractmethod
    async def recover(self, request: TaskRequest, lost: ClusterHandle) -> ClusterHandle:
        """Relaunches a task whose cluster was lost."""


class Failover(Strategy):
    name = "FAILOVER"

    async def recover(self, request: TaskRequest, lost: ClusterHandle) -> ClusterHandle:
        if lost.region:
            try:
                return await self.launch(request, regions=[lost.region], attempts=1)
            except (NoResources, PrecheckError) as error:
                self.note(f"cannot relaunch in {lost.region} ({error}); trying any allowed region")
        return await self.launch(request)


class EagerNextRegion(Strategy):
    name = "EAGER_NEXT_REGION"

    async def recover(self, request: TaskRequest, lost: ClusterHandle) -> ClusterHandle:
        if lost.region:
            try:
                return await self.launch(request, blocked=[lost.region], attempts=1)
            except (NoResources, PrecheckError) as error:
                # A task pinned to the lost region has nowhere else to go.
                self.note(
                    f"cannot relaunch outside {lost.region} ({error}); trying any allowed region"
                )
        return await self.launch(request)


STRATEGIES: dict[int, type[Strategy]] = {
    job_pb2.RECOVERY_STRATEGY_FAILOVER: Failover,
    job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION: EagerNextRegion,
    # SkyPilot's default.
    job_pb2.RECOVERY_STRATEGY_UNSPECIFIED: EagerNextRegion,
}


def strategy_for(
    spec: job_pb2.TaskSpec,
    backend: Backend,
    slot: Slot,
    config: LifecycleConfig,
    note: Callable[[str], None],
) -> Strategy:
    return STRATEGIES[spec.resources.recovery_strategy](backend, slot, config, note)


def _where(regions: Sequence[str], blocked: Sequence[str]) -> str:
    parts = []
    if regions:
        parts.append(f"in {', '.join(regions)}")
    if blocked:
        parts.append(f"not in {', '.join(blocked)}")
    return "; " + "; ".join(parts) if parts else ""
