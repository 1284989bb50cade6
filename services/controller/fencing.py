"""Fencing: a replica without a valid lease makes no backend call that changes anything.

`LeaseGuard` wraps the replica's backend. Launches and terminations check the
lease first and raise `LeaseLost` when it ran out; the job's runner then stops
without cleanup (another replica owns the job now). Reads pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.backends import Backend, ClusterHandle, TaskRequest
from services.backends.wrapper import BackendWrapper
from services.controller.link import LeaseLost


class LeaseGuard(BackendWrapper):
    def __init__(self, inner: Backend, lease_valid: Callable[[], bool]) -> None:
        super().__init__(inner)
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

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> None:
        self._check(f"terminate of {handle.cluster_name}")
        await self.inner.terminate(handle, epoch, grace)
