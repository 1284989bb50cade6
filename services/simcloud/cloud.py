"""The simulated cloud: launches, terminations, the operator's knobs and the inventory.

`Cloud` joins the parts of the model over one core (core.py: state, timers, a
cluster's end): processes.py runs each cluster's task, preemption.py reclaims
spot clusters and delivers notices, fence.py fences calls by epoch and keeps
the record of those let through. This module places clusters and ends them.

- Launch: a request whose epoch is below the highest seen for its job is
  refused (`StaleEpoch`, counted). A live or preempted cluster of the same name
  is terminated first (`replaced` when it was still INIT or UP). Regions are
  tried in order, each one recorded; the first with room in the right pool
  (and no injected failure) gets an INIT cluster that is UP after the region's
  launch latency; none -> `NoCapacity` with the regions tried (regions.py has
  placement and the precheck). A Launch whose caller gives up is rolled back.
- Terminate is idempotent and frees capacity; the record stays, with its
  terminate time. A live task (UP, not ended) gets SIGTERM first (`sigterm_time`,
  a line in its log) and the cluster goes `grace` simulated seconds later, or as
  soon as the task ends or the cluster is preempted; a later Terminate may only
  shorten the grace. Every status change is an event.
- The operator sets capacity, injects faults (latency, failing launches, an
  outage of the cloud API, preemption rates and notices) and reads the inventory
  and the counters (inventory.py).
"""

from __future__ import annotations

import asyncio
import math

from services.common.errors import InvalidArgument
from services.simcloud import bounds
from services.simcloud.clock import Clock
from services.simcloud.clusters import CallKind, Cluster, ClusterState
from services.simcloud.config import CloudConfig
from services.simcloud.errors import NoCapacity, PrecheckFailed, PrecheckInvalid
from services.simcloud.events import EventKind
from services.simcloud.inventory import CloudState, count_violations
from services.simcloud.preemption import PREEMPT, RECLAIM, Preemptions
from services.simcloud.processes import RUN_END, SETUP_END, SIGTERM_EXIT, STOP_KILL, Processes
from services.simcloud.regions import LaunchSpec, Region, candidates, check_shape

# Timer kinds: a launch is UP; a graceful terminate's grace ends.
UP, KILL = "up", "kill"


class Cloud(Processes, Preemptions):
    """The simulated cloud, every part joined; what the servicers and tests call."""

    def __init__(self, config: CloudConfig, clock: Clock | None = None) -> None:
        super().__init__(config, clock)
        self._prechecks = 0
        self._no_capacity = 0
        self._timer_actions.update(
            {
                UP: self._on_up,
                SETUP_END: self._on_setup_end,
                RUN_END: self._on_run_end,
                PREEMPT: self._on_preempt,
                RECLAIM: self._on_reclaim,
                KILL: self._on_kill,
                STOP_KILL: self._on_stop_kill,
                SIGTERM_EXIT: self._on_sigterm_exit,
            }
        )

    # --- launches ----------------------------------------------------------------------------

    def begin_launch(self, spec: LaunchSpec) -> tuple[Cluster, list[str]]:
        """Places an INIT cluster (UP after the latency) and returns it with the regions tried.

        Raises:
            CloudUnreachable, StaleEpoch, PrecheckInvalid, PrecheckFailed, NoCapacity.
        """
        self.check_reachable()
        try:
            check_shape(spec, self.config)
        except (PrecheckInvalid, PrecheckFailed):
            self._prechecks += 1
            raise
        self.fence.check_launch(spec.job_id, spec.epoch)
        try:
            targets = candidates(spec, self.regions, self.config)
        except (PrecheckInvalid, PrecheckFailed):
            self._prechecks += 1
            raise
        self.fence.launched(spec.job_id, spec.epoch)
        now = self.clock.now()
        old = self._by_name.get(spec.cluster_name)
        if old is not None and old.status != ClusterState.TERMINATED:
            # A cluster whose owner already asked to terminate it is not a surprise.
            self._terminate(old, now, replaced=old.live and old.kill_at is None)
        tried: list[str] = []
        for region, zones in targets:
            tried.append(region.name)
            if region.failing_launches > 0:
                region.failing_launches -= 1
                continue
            if not region.has_room(spec.use_spot, spec.num_nodes):
                continue
            zone = region.pick_zone(zones)
            region.take(zone, spec.use_spot, spec.num_nodes)
            cluster = Cluster(
                cluster_id=len(self.inventory) + 1,
                name=spec.cluster_name,
                job_id=spec.job_id,
                task_id=spec.task_id,
                epoch=spec.epoch,
                region=region.name,
                zone=zone,
                spot=spec.use_spot,
                num_nodes=spec.num_nodes,
                plan=spec.plan,
                launch_time=now,
            )
            self.inventory.append(cluster)
            self._by_name[cluster.name] = cluster
            self._live += 1
            self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, f"launching in {zone}")
            self._schedule(now + region.launch_latency, UP, cluster)
            return cluster, tried
        self._no_capacity += 1
        pool = "spot" if spec.use_spot else "on-demand"
        raise NoCapacity(
            f"no {pool} capacity for {spec.num_nodes} node(s) in {', '.join(tried)}", tried
        )

    async def wait_up(self, cluster: Cluster) -> None:
        """Returns once the cluster is UP.

        Raises:
            NoCapacity: it was preempted or terminated while launching.
        """
        if cluster.status == ClusterState.INIT:
            cluster.waiter = asyncio.get_running_loop().create_future()
            try:
                await cluster.waiter
            finally:
                cluster.waiter = None
        if cluster.status != ClusterState.UP:
            # Retryable, like any capacity lost while provisioning: the region was tried.
            raise NoCapacity(
                f"{cluster.name} went {cluster.status.name} while launching", [cluster.region]
            )

    async def launch(self, spec: LaunchSpec) -> tuple[Cluster, list[str]]:
        """Launches and waits for UP; see `begin_launch` for the errors."""
        cluster, tried = self.begin_launch(spec)
        try:
            await self.wait_up(cluster)
        except asyncio.CancelledError:
            # The caller gave up (its RPC was cancelled): roll the launch back, so a
            # cluster nobody knows of is not left running.
            if cluster.status in (ClusterState.INIT, ClusterState.UP):
                self._terminate(cluster, self.clock.now(), replaced=False)
            raise
        return cluster, tried

    def _on_up(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.status != ClusterState.INIT:
            return
        cluster.status = ClusterState.UP
        cluster.up_time = now
        self._start_task(cluster, now)
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, "up")
        self._arm_preemption(cluster, now)
        self._settle(cluster)

    # --- terminations ------------------------------------------------------------------------

    def terminate(self, name: str, epoch: int = 0, grace: float = 0.0) -> bool:
        """Terminates the cluster of this name; False when there was nothing to terminate.

        See `begin_terminate`; with a grace the cluster is still there on return.
        """
        return self.begin_terminate(name, epoch, grace) is not None

    def begin_terminate(self, name: str, epoch: int = 0, grace: float = 0.0) -> Cluster | None:
        """Starts terminating the cluster of this name; None when there is nothing to end.

        A live task gets SIGTERM (recorded, a line in its log), which ends it at once
        unless its plan traps it; the cluster ends now when there is no live task left
        or no grace, else `grace` simulated seconds later (sooner if its task ends or it
        is preempted meanwhile).

        Raises:
            StaleEpoch: `epoch` (when given) is below the highest seen for the job.
        """
        cluster = self._by_name.get(name)
        if cluster is None or cluster.status == ClusterState.TERMINATED:
            return None
        now = self.clock.now()
        self.fence.admit(cluster, CallKind.TERMINATE, epoch, now)
        if cluster.kill_at is not None:
            # Already under way: a second call may hurry it, never delay it.
            if now + grace < cluster.kill_at:
                self._kill_at(cluster, now, grace)
            return cluster
        if cluster.task_live:
            self._sigterm(cluster, now, f"received SIGTERM: terminating, SIGKILL in {grace:g}s")
        if cluster.task_live and grace > 0:
            self._kill_at(cluster, now, grace)
        else:
            self._terminate(cluster, now, replaced=False)
        return cluster

    def _kill_at(self, cluster: Cluster, now: float, grace: float) -> None:
        if grace <= 0:
            self._terminate(cluster, now, replaced=False)
            return
        cluster.kill_at = now + grace
        self._schedule(cluster.kill_at, KILL, cluster)

    def _on_kill(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.kill_at == now:
            self._terminate(cluster, now, replaced=False)

    async def wait_terminated(self, cluster: Cluster) -> None:
        """Returns once the cluster is terminated (a caller giving up cancels nothing)."""
        if cluster.status == ClusterState.TERMINATED:
            return
        if cluster.gone is None:
            cluster.gone = asyncio.get_running_loop().create_future()
        await asyncio.shield(cluster.gone)

    # --- the operator API --------------------------------------------------------------------

    def set_capacity(self, name: str, spot: int | None, on_demand: int | None) -> Region:
        region = self.region(name)
        for field, value in (("spot_nodes", spot), ("on_demand_nodes", on_demand)):
            if value is not None:
                bounds.integer(value, field, 0, bounds.MAX_CAPACITY)
        if spot is not None:
            region.spot_capacity = spot
        if on_demand is not None:
            region.on_demand_capacity = on_demand
        return region

    def inject_faults(
        self,
        region: str = "",
        launch_latency: float | None = None,
        fail_next_launches: int = 0,
        unreachable_seconds: float = 0.0,
        preemptions_per_hour: float | None = None,
        notice_seconds: float | None = None,
    ) -> None:
        """Applies faults to one region, or to all of them when `region` is empty.

        Raises:
            InvalidArgument: a value out of bounds (nothing is applied), named.
            NotFound: an unknown region.
        """
        for field, value, high in (
            ("launch_latency_seconds", launch_latency, bounds.MAX_SECONDS),
            ("unreachable_seconds", unreachable_seconds, bounds.MAX_SECONDS),
            ("preemptions_per_hour", preemptions_per_hour, bounds.MAX_RATE),
            ("notice_seconds", notice_seconds, bounds.MAX_SECONDS),
        ):
            if value is not None:
                bounds.number(value, field, high)
        limit = bounds.MAX_FAILING_LAUNCHES
        bounds.integer(fail_next_launches, "fail_next_launches", 0, limit)
        targets = [self.region(region)] if region else list(self.regions.values())
        for target in targets:
            if target.failing_launches + fail_next_launches > limit:
                raise InvalidArgument(
                    f"fail_next_launches: {target.name} would have more than {limit} "
                    f"launches set to fail ({target.failing_launches} already)",
                    field="fail_next_launches",
                )
        for target in targets:
            if launch_latency is not None:
                target.launch_latency = launch_latency
            if preemptions_per_hour is not None:
                target.preemptions_per_hour = preemptions_per_hour
            if notice_seconds is not None:
                target.notice_seconds = notice_seconds
            target.failing_launches += fail_next_launches
        if unreachable_seconds > 0:
            self.unreachable_until = self.clock.now() + unreachable_seconds
            # Open streams notice the outage and end UNAVAILABLE.
            self.events.wake()

    def reset_faults(self, region: str = "") -> list[Region]:
        """Undoes injected faults of one region, or of all of them and the outage."""
        targets = [self.region(region)] if region else list(self.regions.values())
        for target in targets:
            target.reset_faults()
        if not region:
            self.unreachable_until = -math.inf
        return targets

    def list_inventory(
        self, start: int, size: int, job_id: int | None = None
    ) -> tuple[list[Cluster], int | None]:
        """Clusters from inventory index `start`, at most `size`, and where the next page starts."""
        out: list[Cluster] = []
        index = start
        while index < len(self.inventory) and len(out) < size:
            cluster = self.inventory[index]
            index += 1
            if job_id is None or cluster.job_id == job_id:
                out.append(cluster)
        return out, (index if index < len(self.inventory) else None)

    def state(self) -> CloudState:
        now = self.clock.now()
        return CloudState(
            sim_seconds=now,
            live_clusters=self._live,
            unterminated_clusters=len(self.inventory) - self._terminated,
            launched_total=len(self.inventory),
            terminated_total=self._terminated,
            preempted_total=self._preempted,
            replaced_total=self._replaced,
            stale_launches_rejected=self.fence.stale_launches,
            stale_terminates_rejected=self.fence.stale_terminates,
            stale_notices_rejected=self.fence.stale_notices,
            preemption_notices_total=self._notices,
            notices_delivered_total=self._delivered,
            launches_rejected_precheck=self._prechecks,
            launches_without_capacity=self._no_capacity,
            violations=count_violations(self.inventory),
            head_seq=self.events.head_seq,
            unreachable_until=self.unreachable_until if self.unreachable_until > now else None,
        )
