"""`BackendWrapper`: a backend that forwards every call to another one.

Subclasses override only the calls they change: the controller's lease guard
checks its lease before launching or terminating, and tests inject faults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from services.backends.base import (
    Backend,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    TaskRequest,
    TaskStatus,
)


class BackendWrapper(Backend):
    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        return await self.inner.launch(request, candidate_regions, blocked_regions)

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        return self.inner.handle_for(cluster_name)

    async def cluster_status(self, handle: ClusterHandle) -> ClusterStatus:
        return await self.inner.cluster_status(handle)

    async def task_status(self, handle: ClusterHandle) -> TaskStatus | None:
        return await self.inner.task_status(handle)

    async def task_end_time(self, handle: ClusterHandle) -> float | None:
        return await self.inner.task_end_time(handle)

    async def terminate(self, handle: ClusterHandle, epoch: int = 0) -> None:
        await self.inner.terminate(handle, epoch)

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
