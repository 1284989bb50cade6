"""Recovery and restart strategies (contract §7), chosen by name from the spec.

Every strategy launches the same way (launching.py). They differ in how they
relaunch a task whose cluster was preempted:
- FAILOVER relaunches in the region it lost first (data and quota are there),
  then anywhere allowed.
- EAGER_NEXT_REGION relaunches with the lost region blocked (spot capacity
  there has just proved scarce), then anywhere allowed. SkyPilot's default.

After user code failed on a healthy cluster, `restart` relaunches anywhere
allowed while `max_restarts_on_errors` allows: the region is not to blame.

Beyond SkyPilot (contract §18), every strategy carries the task's `RecoveryPolicy`:
exit codes that mean "recover" (like a preemption, no restart consumed) or
"fail at once"; a cap on recoveries; on-demand capacity after N preemptions;
and `NONE`, which never recovers.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

from managedjobs.v1 import job_pb2
from services.backends import Backend, ClusterHandle, LaunchPlan, PrecheckError
from services.controller.config import LifecycleConfig
from services.controller.launching import ClusterLauncher, Deadline, NoResources, Slot


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    """What the spec's `job_recovery` says beyond the strategy's name (contract §18)."""

    max_restarts: int = 0
    recover_on_exit_codes: frozenset[int] = frozenset()
    fail_on_exit_codes: frozenset[int] = frozenset()
    # None: unlimited recoveries; never switch to on-demand.
    max_recoveries: int | None = None
    on_demand_after_preemptions: int | None = None
    unreachable_timeout: float | None = None

    @classmethod
    def of(cls, resources: job_pb2.Resources) -> RecoveryPolicy:
        return cls(
            max_restarts=resources.max_restarts_on_errors,
            recover_on_exit_codes=frozenset(resources.recover_on_exit_codes),
            fail_on_exit_codes=frozenset(resources.fail_on_exit_codes),
            max_recoveries=(
                resources.max_recoveries if resources.HasField("max_recoveries") else None
            ),
            on_demand_after_preemptions=(
                resources.on_demand_after_preemptions
                if resources.HasField("on_demand_after_preemptions")
                else None
            ),
            unreachable_timeout=(
                resources.unreachable_timeout_seconds
                if resources.HasField("unreachable_timeout_seconds")
                else None
            ),
        )


class Strategy(abc.ABC):
    """How one task is launched, recovered after a preemption and restarted after a crash."""

    name: ClassVar[str] = ""

    def __init__(
        self,
        launcher: ClusterLauncher,
        note: Callable[[str], None],
        policy: RecoveryPolicy | None = None,
    ) -> None:
        self.launcher = launcher
        self.note = note
        self.policy = policy or RecoveryPolicy()
        # max_restarts_on_errors: restarts allowed after user code failed.
        self.max_restarts = self.policy.max_restarts

    def may_restart(self, restarts_so_far: int) -> bool:
        return restarts_so_far < self.max_restarts

    def may_recover(self, recoveries_so_far: int) -> str:
        """Why a preempted task may not be recovered ("" when it may)."""
        cap = self.policy.max_recoveries
        if cap is not None and recoveries_so_far >= cap:
            return f"preempted after {recoveries_so_far} recoveries; max_recoveries is {cap}"
        return ""

    def on_exit(self, exit_code: int | None) -> str:
        """What a failed run's exit code asks for: "recover", "fail" or "" (the usual rules).

        A death by signal N matches both -N (the spec's spelling) and 128 + N (the shell's).
        """
        if exit_code is None:
            return ""
        same = {exit_code}
        if exit_code > 128 or exit_code < 0:
            same.add(128 - exit_code)
        if same & self.policy.fail_on_exit_codes:
            return "fail"
        if same & self.policy.recover_on_exit_codes:
            return "recover"
        return ""

    def for_recovery(self, request: LaunchPlan, preemptions: int) -> LaunchPlan:
        """The request for the attempt after `preemptions` preemptions: on-demand once the
        policy says so."""
        after = self.policy.on_demand_after_preemptions
        if request.use_spot and after is not None and preemptions >= after:
            self.note(
                f"task {request.task_id}: preempted {preemptions} times; "
                "relaunching on on-demand capacity"
            )
            return dataclasses.replace(request, use_spot=False)
        return request

    async def launch(self, request: LaunchPlan) -> ClusterHandle:
        """The task's first launch: anywhere allowed."""
        return await self.launcher.launch(request)

    @abc.abstractmethod
    async def recover(self, request: LaunchPlan, lost: ClusterHandle) -> ClusterHandle:
        """Relaunches a task whose cluster was lost (already terminated by the caller)."""

    async def restart(self, request: LaunchPlan, failed: ClusterHandle) -> ClusterHandle:
        """Relaunches after user code failed on a healthy cluster: anywhere allowed."""
        self.note(f"task {request.task_id}: restarting after user code failed")
        return await self.launcher.launch(request)


class Failover(Strategy):
    name = "FAILOVER"

    async def recover(self, request: LaunchPlan, lost: ClusterHandle) -> ClusterHandle:
        if lost.region:
            self.note(f"task {request.task_id}: {self.name}: relaunching in {lost.region} first")
            try:
                return await self.launcher.launch(request, regions=[lost.region], attempts=1)
            except (NoResources, PrecheckError) as error:
                self.note(
                    f"task {request.task_id}: cannot relaunch in {lost.region} ({error}); "
                    "trying every allowed region"
                )
        return await self.launcher.launch(request)


class NoRecovery(Strategy):
    """`strategy: NONE`: a preemption ends the task (FAILED_NO_RESOURCE with the reason)."""

    name = "NONE"

    def may_recover(self, recoveries_so_far: int) -> str:
        return "preempted, and the task's recovery strategy is NONE"

    async def recover(self, request: LaunchPlan, lost: ClusterHandle) -> ClusterHandle:
        raise NoResources(self.may_recover(0))


class EagerNextRegion(Strategy):
    name = "EAGER_NEXT_REGION"

    async def recover(self, request: LaunchPlan, lost: ClusterHandle) -> ClusterHandle:
        if lost.region:
            self.note(
                f"task {request.task_id}: {self.name}: relaunching outside {lost.region} first"
            )
            try:
                return await self.launcher.launch(request, blocked=[lost.region], attempts=1)
            except (NoResources, PrecheckError) as error:
                # A task pinned to the lost region has nowhere else to go.
                self.note(
                    f"task {request.task_id}: cannot relaunch outside {lost.region} ({error}); "
                    "trying every allowed region"
                )
        return await self.launcher.launch(request)


STRATEGIES: dict[int, type[Strategy]] = {
    job_pb2.RECOVERY_STRATEGY_FAILOVER: Failover,
    job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION: EagerNextRegion,
    job_pb2.RECOVERY_STRATEGY_NONE: NoRecovery,
    # SkyPilot's default.
    job_pb2.RECOVERY_STRATEGY_UNSPECIFIED: EagerNextRegion,
}


def strategy_for(
    spec: job_pb2.TaskSpec,
    backend: Backend,
    slot: Slot,
    config: LifecycleConfig,
    note: Callable[[str], None],
    pending: Deadline | None = None,
) -> Strategy:
    """The strategy the task's `resources.job_recovery` names, with its policy and timeouts.

    `pending` is the job's max_pending deadline while it never started.
    """
    resources = spec.resources
    cls = STRATEGIES[resources.recovery_strategy]
    timeout = spec.launch_timeout_seconds if spec.HasField("launch_timeout_seconds") else None
    launcher = ClusterLauncher(backend, slot, config, note, timeout, pending)
    return cls(launcher, note, RecoveryPolicy.of(resources))


__all__ = [
    "STRATEGIES",
    "EagerNextRegion",
    "Failover",
    "NoRecovery",
    "RecoveryPolicy",
    "Strategy",
    "strategy_for",
]
