"""Fencing: a replica without a valid lease makes no backend call that changes anything.

`LeaseGuard` wraps the replica's backend. Launches and terminations check the
lease first and raise `LeaseLost` when it ran out; the job's runner then stops
without cleanup (another replica owns the job now). Reads pass through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from services.backends import (
    Backend,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    TaskRequest,
    TaskStatus,
)
from services.controller.link import LeaseLost


class LeaseGuard(Backend):
    def __init__(self, inner: Backend, lease_valid: Callable[[], bool]) -> None:
        self.inner = inner
        self.name = inner.name
        self._lease_valid = lease_valid

    def _check(self, what: str) -> None:
        if not self._lease_valid():
            raise LeaseLost(f"lease lost; not calling {what}")

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        self._check(f"launch of {request.cluster_name}")
        return await self.inner.launch(request, candidate_regions, blocked_regions)

    async def terminate(self, handle: ClusterHandle) -> None:
        self._check(f"terminate of {handle.cluster_name}")
        await self.inner.terminate(handle)

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        return self.inner.handle_for(cluster_name)

    async def cluster_status(self, handle: ClusterHandle) -> ClusterStatus:
        return await self.inner.cluster_status(handle)

    async def task_status(self, handle: ClusterHandle) -> TaskStatus | None:
        return await self.inner.task_status(handle)

    async def task_end_time(self, handle: ClusterHandle) -> float | None:
        return await self.inner.task_end_time(handle)

    async def cluster_exists(self, cluster_name: str) -> bool:
        return await self.inner.cluster_exists(cluster_name)

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        return await self.inner.read_logs(handle)

    def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        return self.inner.tail_logs(handle)

    async def reachable(self) -> bool:
        return await self.inner.reachable()

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return self.inner.events()

    async def close(self) -> None:
        await self.inner.close()
