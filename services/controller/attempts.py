"""Getting a task running on a cluster, once per attempt (contract §6-§7).

An attempt is one cluster the task runs on: the first launch, a recovery after
the cluster was lost (RECOVERING, relaunch through the strategy, RUNNING with
recovery_count + 1), a restart after user code failed on a healthy cluster
(restart_count + 1). A task taken over from a previous holder resumes instead:
RUNNING keeps watching the same cluster; STARTING or RECOVERING adopts a
cluster that is up with the task running (or done), and recovers otherwise.

Every relaunch tears the old cluster down first (teardown.py). Each attempt
becomes RUNNING with the launch slot given back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    TaskEnd,
    TaskStatus,
    cluster_name,
)
from services.common.statuses import JobStatus
from services.controller.host import JobHost
from services.controller.launching import NoResources
from services.controller.limits import Limits
from services.controller.strategies import Strategy
from services.controller.tasks import TaskState
from services.controller.teardown import Teardown
from services.controller.verdicts import IN_PROGRESS

S = JobStatus


def launch_plan(
    job_id: int, epoch: int, task: job_pb2.Task, secrets: Mapping[str, str] | None = None
) -> LaunchPlan:
    """What to launch for a task attempt; its secrets join its envs only here."""
    spec = task.spec
    r = spec.resources
    return LaunchPlan(
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
        # The spec's `sim` key: how the task behaves on the sim backend.
        extensions={"sim": json.loads(spec.sim_json)} if spec.sim_json else {},
    )


class Attempts:
    """The attempts of one task: launched through its strategy, each torn down before the next."""

    def __init__(
        self,
        state: TaskState,
        strategy: Strategy,
        request: LaunchPlan,
        host: JobHost,
        backend: Backend,
        teardown: Teardown,
        limits: Limits,
    ) -> None:
        self.state = state
        self.strategy = strategy
        self.request = request
        self.host = host
        self.backend = backend
        self.teardown = teardown
        self.limits = limits

    async def launch(self) -> None:
        """The first attempt."""
        handle = await self.strategy.launch(self.request)
        await self._running(handle, "launched")

    async def resume(self) -> None:
        """Takes a task up where a previous holder left it, from one look at its cluster.

        RUNNING: keep watching the same cluster. STARTING or RECOVERING: the
        previous holder's launch may or may not have happened; a cluster that is up
        with the task running (or done) is adopted rather than relaunched.
        """
        state = self.state
        state.handle = state.last_cluster(self.backend)
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
            or (seen.cluster == ClusterStatus.UP and (seen.task in IN_PROGRESS or seen.end))
        ):
            await self._running(state.handle, f"resumed: {name} is up; adopted")
            return
        await self.recover("resumed: the cluster's state is unknown")

    async def recover(self, why: str, end: TaskEnd | None = None, silent: bool = False) -> None:
        """Relaunches a task whose cluster was lost, if the policy allows.

        With `silent` (the cluster stayed unreachable past the timeout), a terminate
        the backend still cannot carry out does not hold the relaunch back: the
        relaunch of the name replaces the old cluster (see teardown.py).

        Raises:
            NoResources: no recovery allowed (strategy NONE, max_recoveries reached), or
                launching gave up.
        """
        state, strategy = self.state, self.strategy
        lost = state.last_cluster(self.backend)
        refused = strategy.may_recover(state.recovery_count)
        if refused:
            await self.teardown.remove(state, lost)
            raise NoResources(refused)
        if state.status != S.RECOVERING:
            await state.transition(
                S.RECOVERING, why, exit_code=end.exit_code if end is not None else None
            )
        await self.teardown.remove(state, lost, silent=silent)
        number = state.recovery_count + 1
        self.host.note(
            f"task {state.task_id}: recovery {number} with {strategy.name}; "
            f"{lost.cluster_name} was lost in {lost.region or 'an unknown region'}"
        )
        handle = await strategy.recover(strategy.for_recovery(self.request, number), lost)
        state.recovery_count = number
        await self._running(handle, f"recovery {number}: running")

    async def restart(self, failed: ClusterHandle, what: str, end: TaskEnd) -> None:
        """Relaunches after user `what` ("setup" or "run") failed on a healthy cluster."""
        state = self.state
        attempt = state.attempt
        state.restart_count += 1
        reason = (
            f"user {what} failed; restart {state.restart_count} of {self.strategy.max_restarts}"
        )
        await state.transition(S.RECOVERING, reason, attempt=attempt, exit_code=end.exit_code)
        await self.teardown.remove(state, failed, attempt=attempt)
        state.handle = None
        handle = await self.strategy.restart(self.request, failed)
        await self._running(handle, f"restart {state.restart_count}: running")

    async def _running(self, handle: ClusterHandle, what: str) -> None:
        state = self.state
        state.handle = handle
        state.gone = False
        state.region = handle.region or state.region
        self.limits.started(state)
        where = state.region or "-"
        await state.transition(S.RUNNING, f"{what} on {handle.cluster_name} in {where}")
        await self.host.slot.release()


__all__ = ["Attempts", "launch_plan"]
