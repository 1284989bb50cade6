"""Fencing: a replica without a valid lease makes no backend call that changes anything.

`LeaseGuard` wraps the replica's backend. Launches, terminations and notices
need the stream to the scheduler up and the lease valid: while the stream is
down they wait (at most as long as the lease lasts), then raise `LeaseLost`;
the job's runner then stops without cleanup (another replica owns the job now).
Once the replica drains (`handed_back`), its jobs are the scheduler's again and
every such call is refused at once (`MovedAway`): so the jobs can go back while
the runners are still unwinding. Reads pass through. The calls a backend makes
of its own accord (tearing down a launch whose runner gave up) pass the same check
(`fence_own_calls`): a runner stopped because its lease ran out leaves that
cluster to the job's next holder. Every such call also carries the job's epoch, so
a backend that can fence refuses it too: two layers, each tested on its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.backends import Backend, ClusterHandle, LaunchPlan
from services.backends.wrapper import BackendWrapper
from services.common.test_switches import LEASE_GUARD, disabled
from services.controller.messages import LeaseLost, MovedAway


class LeaseGuard(BackendWrapper):
    def __init__(
        self,
        inner: Backend,
        wait_lease: Callable[[], Awaitable[bool]],
        handed_back: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(inner)
        self._wait_lease = wait_lease
        self._handed_back = handed_back
        inner.fence_own_calls(self._check)

    async def _check(self, what: str) -> None:
        if not disabled(LEASE_GUARD) and not await self._wait_lease():
            raise LeaseLost(f"lease lost; not calling {what}")
        # Checked last, right before the call: nothing can be awaited in between.
        if self._handed_back():
            raise MovedAway(f"this replica is draining; not calling {what}")

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        await self._check(f"launch of {plan.cluster_name}")
        return await self.inner.launch(plan)

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        await self._check(f"terminate of {handle.cluster_name}")
        return await self.inner.terminate(handle, epoch, grace)

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        await self._check(f"stop {handle.cluster_name}")
        await self.inner.stop(handle, epoch, grace)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        await self._check(f"preemption notice to {handle.cluster_name}")
        await self.inner.notify_preemption(handle, epoch, deadline)
