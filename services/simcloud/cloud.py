"""The simulated cloud: launches, the timed life of clusters, chaos, and the inventory.

`Cloud` owns every region, every cluster ever launched (the inventory, in
launch order), the event log and one timer heap. With a `ScaledClock`, `run()`
is the only background task: it sleeps until the earliest timer is due and
fires what is due. With a `ManualClock`, tests call `advance()` instead. Either
way a timer's due time is the simulated "now" of what it does and timers fire
in (due, insertion) order, so the same seed and the same calls give the same
events (`Event.key`); on a `ManualClock`, the same times as well.

Rules kept here (regions.py has placement and the precheck):
- Launch: a request whose epoch is below the highest seen for its job is
  refused (`StaleEpoch`, counted). A live or preempted cluster of the same name
  is terminated first (`replaced` when it was still INIT or UP). Regions are
  tried in order, each one recorded; the first with room in the right pool
  (and no injected failure) gets an INIT cluster that is UP after the region's
  launch latency; none -> `NoCapacity` with the regions tried.
- Preemption: spot clusters only, at `preempt_after_seconds` after UP for the
  first spot cluster of a (job, task), and/or at an exponential random time
  drawn from the seeded RNG at UP when the region's rate is above 0. The
  operator may preempt anything, any time. DOWN frees capacity at once.
- Terminate is idempotent and frees capacity; the record stays, with its
  terminate time. Every status change is an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random

from services.common.errors import InvalidArgument, NotFound
from services.simcloud.clock import Clock, ManualClock, ScaledClock, TimerHeap
from services.simcloud.clusters import Cluster, ClusterState, TaskState
from services.simcloud.config import CloudConfig
from services.simcloud.errors import (
    CloudUnreachable,
    ClusterNotFound,
    NoCapacity,
    PrecheckFailed,
    PrecheckInvalid,
    StaleEpoch,
)
from services.simcloud.events import EventKind, EventLog
from services.simcloud.inventory import CloudState, count_violations
from services.simcloud.regions import LaunchSpec, Region, candidates

log = logging.getLogger(__name__)

_UP, _SETUP_END, _RUN_END, _PREEMPT = "up", "setup_end", "run_end", "preempt"
# Timers due within this much real time are fired now rather than slept for.
_REAL_TOLERANCE = 0.0005


class Cloud:
    def __init__(self, config: CloudConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock or ScaledClock(config.time_scale)
        self.rng = random.Random(config.seed)
        self.regions = {r.name: Region(r, config) for r in config.regions}
        self.events = EventLog(config.event_buffer)
        self.inventory: list[Cluster] = []
        self._by_name: dict[str, Cluster] = {}
        self._timers = TimerHeap()
        self._wake = asyncio.Event()
        self._epochs: dict[int, int] = {}
        self._scripted: set[tuple[int, int]] = set()
        self._live = 0
        self._terminated = 0
        self._preempted = 0
        self._replaced = 0
        self._stale = 0
        self._stale_terminates = 0
        self._prechecks = 0
        self._no_capacity = 0
        self.unreachable_until = -math.inf

    # --- driving time ------------------------------------------------------------------------

    async def run(self) -> None:
        """Fires timers as they come due, forever (the one scheduler task)."""
        tolerance = _REAL_TOLERANCE * self.clock.time_scale
        while True:
            self._fire_due(self.clock.now() + tolerance)
            self._wake.clear()
            due = self._timers.next_due()
            delay = None if due is None else self.clock.real_delay(due - self.clock.now())
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)

    def advance(self, seconds: float) -> None:
        """Moves a `ManualClock` forward, firing every timer due on the way, in order."""
        if not isinstance(self.clock, ManualClock):
            raise TypeError("advance() needs a ManualClock")
        target = self.clock.now() + seconds
        while (due := self._timers.next_due()) is not None and due <= target:
            self.clock.set(due)
            self._fire_due(due)
        self.clock.set(target)

    def _fire_due(self, now: float) -> None:
        while (entry := self._timers.pop_due(now)) is not None:
            due, kind, cluster = entry
            try:
                if kind == _UP:
                    self._on_up(cluster, due)
                elif kind == _SETUP_END:
                    self._on_setup_end(cluster, due)
                elif kind == _RUN_END:
                    self._on_run_end(cluster, due)
                elif kind == _PREEMPT and cluster.live:
                    self._preempt(cluster, due, "preempted (spot)")
            except Exception:
                # A bug in one cluster's timer must not stop time for every other cluster.
                log.exception("timer failed", extra={"kind": kind, "cluster": cluster.name})

    def _schedule(self, due: float, kind: str, cluster: Cluster) -> None:
        if self._timers.push(due, kind, cluster):
            self._wake.set()

    # --- the cloud API -----------------------------------------------------------------------

    def check_reachable(self) -> None:
        """Raises `CloudUnreachable` during an injected outage."""
        left = self.unreachable_until - self.clock.now()
        if left > 0:
            raise CloudUnreachable(f"the cloud API is unreachable for another {left:.1f} sim s")

    def begin_launch(self, spec: LaunchSpec) -> tuple[Cluster, list[str]]:
        """Places an INIT cluster (UP after the latency) and returns it with the regions tried.

        Raises:
            CloudUnreachable, StaleEpoch, PrecheckInvalid, PrecheckFailed, NoCapacity.
        """
        self.check_reachable()
        if spec.epoch < self._epochs.get(spec.job_id, spec.epoch):
            self._stale += 1
            raise StaleEpoch(
                f"stale epoch {spec.epoch} for job {spec.job_id}: "
                f"epoch {self._epochs[spec.job_id]} already launched",
                job_id=str(spec.job_id),
            )
        try:
            targets = candidates(spec, self.regions, self.config)
        except (PrecheckInvalid, PrecheckFailed):
            self._prechecks += 1
            raise
        self._epochs[spec.job_id] = spec.epoch
        now = self.clock.now()
        old = self._by_name.get(spec.cluster_name)
        if old is not None and old.status != ClusterState.TERMINATED:
            self._terminate(old, now, replaced=old.live)
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
            self._schedule(now + region.launch_latency, _UP, cluster)
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

    def get(self, name: str) -> Cluster:
        """The latest cluster of this name, terminated or not."""
        cluster = self._by_name.get(name)
        if cluster is None:
            raise ClusterNotFound(f"no cluster named {name!r} was ever launched", name=name)
        return cluster

    def terminate(self, name: str, epoch: int = 0) -> bool:
        """Terminates the cluster of this name; False when there was nothing to terminate.

        Raises:
            StaleEpoch: `epoch` (when given) is below the highest seen for the job.
        """
        cluster = self._by_name.get(name)
        if cluster is None or cluster.status == ClusterState.TERMINATED:
            return False
        latest = self._epochs.get(cluster.job_id, 0)
        if epoch and epoch < latest:
            self._stale_terminates += 1
            raise StaleEpoch(
                f"stale epoch {epoch} for job {cluster.job_id}: epoch {latest} holds {name}",
                job_id=str(cluster.job_id),
            )
        self._terminate(cluster, self.clock.now(), replaced=False)
        return True

    # --- the timed life of a cluster -------------------------------------------------------

    def _on_up(self, cluster: Cluster, now: float) -> None:
        if cluster.status != ClusterState.INIT:
            return
        cluster.status = ClusterState.UP
        cluster.up_time = now
        plan = cluster.plan
        if plan.has_setup:
            cluster.task_status = TaskState.SETTING_UP
            self._schedule(now + plan.setup_seconds, _SETUP_END, cluster)
        else:
            self._start_run(cluster, now)
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, "up")
        if cluster.spot:
            key = (cluster.job_id, cluster.task_id)
            if plan.preempt_after is not None and key not in self._scripted:
                self._scripted.add(key)
                self._schedule(now + plan.preempt_after, _PREEMPT, cluster)
            rate = self.regions[cluster.region].preemptions_per_hour
            if rate > 0:
                self._schedule(now + self.rng.expovariate(rate / 3600.0), _PREEMPT, cluster)
        self._settle(cluster)

    def _start_run(self, cluster: Cluster, now: float) -> None:
        cluster.task_status = TaskState.RUNNING
        cluster.run_start = now
        self._schedule(now + cluster.plan.runtime, _RUN_END, cluster)

    def _on_setup_end(self, cluster: Cluster, now: float) -> None:
        if cluster.status != ClusterState.UP or cluster.task_status != TaskState.SETTING_UP:
            return
        code = cluster.plan.setup_exit_code
        if code != 0:
            cluster.task_status = TaskState.FAILED_SETUP
            cluster.exit_code = code
            cluster.task_end_time = now
            message = f"setup exited with {code}"
        else:
            self._start_run(cluster, now)
            message = "setup done"
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, message)

    def _on_run_end(self, cluster: Cluster, now: float) -> None:
        if cluster.status != ClusterState.UP or cluster.task_status != TaskState.RUNNING:
            return
        code = cluster.plan.exit_code
        cluster.task_status = TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
        cluster.exit_code = code
        cluster.task_end_time = now
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, f"run exited with {code}")

    def _release(self, cluster: Cluster) -> None:
        if cluster.live:
            self.regions[cluster.region].give(cluster.zone, cluster.spot, cluster.num_nodes)
            self._live -= 1

    def _preempt(self, cluster: Cluster, now: float, message: str) -> None:
        self._release(cluster)
        cluster.status = ClusterState.DOWN
        cluster.preempted = True
        cluster.preempt_time = now
        self._preempted += 1
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, message)
        self._settle(cluster)

    def _terminate(self, cluster: Cluster, now: float, replaced: bool) -> None:
        self._release(cluster)
        cluster.status = ClusterState.TERMINATED
        cluster.terminate_time = now
        cluster.replaced = replaced
        self._terminated += 1
        self._replaced += int(replaced)
        message = "terminated: replaced by a new launch" if replaced else "terminated"
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, message)
        self._settle(cluster)

    def _settle(self, cluster: Cluster) -> None:
        """Lets a Launch waiting on this cluster return (UP) or fail (anything else)."""
        if cluster.waiter is not None and not cluster.waiter.done():
            cluster.waiter.set_result(None)

    def _publish(self, kind: EventKind, cluster: Cluster, now: float, message: str) -> None:
        self.events.publish(now, kind, cluster, message)

    # --- the operator API --------------------------------------------------------------------

    def region(self, name: str) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise NotFound(f"unknown region {name!r} (regions: {', '.join(self.regions)})")
        return region

    def preempt_cluster(self, name: str) -> bool:
        """Preempts the cluster now; False when it was not INIT or UP."""
        cluster = self.get(name)
        if not cluster.live:
            return False
        self._preempt(cluster, self.clock.now(), "preempted by the operator")
        return True

    def preempt_region(self, name: str, include_on_demand: bool = False) -> list[str]:
        """Preempts every live spot (and optionally on-demand) cluster of the region."""
        self.region(name)
        now = self.clock.now()
        hit = [
            c
            for c in self._by_name.values()
            if c.live and c.region == name and (c.spot or include_on_demand)
        ]
        for cluster in sorted(hit, key=lambda c: c.cluster_id):
            self._preempt(cluster, now, f"preempted with region {name}")
        return [c.name for c in hit]

    def set_capacity(self, name: str, spot: int | None, on_demand: int | None) -> Region:
        region = self.region(name)
        for value in (spot, on_demand):
            if value is not None and value < 0:
                raise InvalidArgument(f"capacity must not be negative, got {value}")
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
    ) -> None:
        """Applies faults to one region, or to all of them when `region` is empty."""
        values = (launch_latency, fail_next_launches, unreachable_seconds, preemptions_per_hour)
        for value in values:
            if value is not None and not (0 <= value < math.inf):
                raise InvalidArgument(f"fault values must be finite and >= 0, got {value}")
        targets = [self.region(region)] if region else list(self.regions.values())
        for target in targets:
            if launch_latency is not None:
                target.launch_latency = launch_latency
            if preemptions_per_hour is not None:
                target.preemptions_per_hour = preemptions_per_hour
            target.failing_launches += fail_next_launches
        if unreachable_seconds > 0:
            self.unreachable_until = self.clock.now() + unreachable_seconds
            # Open streams notice the outage and end UNAVAILABLE.
            self.events.wake()

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
            stale_launches_rejected=self._stale,
            stale_terminates_rejected=self._stale_terminates,
            launches_rejected_precheck=self._prechecks,
            launches_without_capacity=self._no_capacity,
            violations=count_violations(self.inventory),
            head_seq=self.events.head_seq,
            unreachable_until=self.unreachable_until if self.unreachable_until > now else None,
        )
