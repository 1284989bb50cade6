"""`BackendWrapper`: a backend that forwards every call to another one.

Subclasses override only the calls they change: the controller's lease guard
checks its lease before launching or terminating, and tests inject faults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from services.backends.base import (
    Backend,
    BackendError,
    ClusterEvent,
    ClusterHandle,
    LaunchPlan,
    Observation,
)


class BackendWrapper(Backend):
    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.launch_concurrency = inner.launch_concurrency

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        return await self.inner.launch(plan)

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        return self.inner.handle_for(cluster_name)

    def fence_own_calls(self, fence: Callable[[str], Awaitable[None]]) -> None:
        self.inner.fence_own_calls(fence)

    async def observe(self, handle: ClusterHandle) -> Observation:
        return await self.inner.observe(handle)

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        return await self.inner.observe_many(handles)

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        return await self.inner.terminate(handle, epoch, grace)

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        await self.inner.stop(handle, epoch, grace)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        await self.inner.notify_preemption(handle, epoch, deadline)

    async def cluster_exists(self, cluster_name: str) -> bool:
        return await self.inner.cluster_exists(cluster_name)

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        return await self.inner.read_logs(handle)

    def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        return self.inner.tail_logs(handle)

    async def reachable(self) -> bool:
        return await self.inner.reachable()

    def regions(self) -> Sequence[str] | None:
        return self.inner.regions()

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return self.inner.events()

    async def prepare(self) -> None:
        await self.inner.prepare()

    async def close(self) -> None:
        await self.inner.close()
