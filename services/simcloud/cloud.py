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
- Preemption: spot clusters only, decided at `preempt_after_seconds` after UP for
  the first spot cluster of a (job, task), and/or at an exponential random time
  drawn from the seeded RNG at UP when the region's rate is above 0. The
  operator may preempt anything, any time. A reclaim decided with the region's
  `notice_seconds` above 0 (or an operator's notice) is announced at once as a
  PREEMPTION_NOTICE event carrying the deadline, and happens at the deadline; an
  earlier reclaim may overtake it, a later one never postpones it. DOWN frees
  capacity at once; a task that had finished stays readable until termination.
- Terminate is idempotent and frees capacity; the record stays, with its
  terminate time. A live task (UP, not ended) gets SIGTERM first (`sigterm_time`,
  a line in its log) and the cluster goes `grace` simulated seconds later, or as
  soon as the task ends or the cluster is preempted; a later Terminate may only
  shorten the grace. A stop sends the same SIGTERM and kills the task (SIGKILL,
  137) at the end of its grace, keeping the cluster. The SIGTERM of either ends
  the task at once (FAILED, 143) unless its plan traps it (`sigterm_exit`): then
  it exits that many seconds later, or never; a preemption notice's SIGTERM never
  ends it. Every status change is an event.
- Fencing: a launch, a terminate or a notice delivery whose epoch is below the
  highest launched for the job is refused (`StaleEpoch`, counted); epoch 0 on a
  terminate or a notice means an operator and is never fenced. Every terminate,
  stop and notice let through is kept in the cluster's record with its epoch and
  time: one from an epoch the job no longer holds, at a cluster its new holder
  adopted without launching, passes the fence and shows there.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import random

from services.common.errors import InvalidArgument, NotFound
from services.simcloud import bounds
from services.simcloud.clock import Clock, ManualClock, ScaledClock, TimerHeap
from services.simcloud.clusters import CallKind, Cluster, ClusterState, TaskState
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
from services.simcloud.regions import LaunchSpec, Region, candidates, check_shape

log = logging.getLogger(__name__)

# Timer kinds. _PREEMPT decides a spot reclaim (announced when the region gives
# notice); _RECLAIM is a notice's deadline; _KILL ends a graceful terminate and
# _STOP_KILL a graceful stop (the task killed, the cluster kept); _SIGTERM_EXIT is when a
# task that traps SIGTERM exits on it.
_UP, _SETUP_END, _RUN_END = "up", "setup_end", "run_end"
_PREEMPT, _RECLAIM, _KILL, _STOP_KILL = "preempt", "reclaim", "kill", "stop_kill"
_SIGTERM_EXIT = "sigterm_exit"
# The exit codes of a task ended by SIGKILL and by SIGTERM, as a shell reports them.
SIGKILL_EXIT_CODE = 137
SIGTERM_EXIT_CODE = 143
# Signal -> (exit code, the note in the task's log).
_ENDED_BY = {
    "SIGKILL": (SIGKILL_EXIT_CODE, "killed (SIGKILL)"),
    "SIGTERM": (SIGTERM_EXIT_CODE, "exited (SIGTERM)"),
}
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
        # Per (job, task) with `exit_code_runs`: how many of its runs exited with exit_code.
        self._failing_runs: dict[tuple[int, int], int] = {}
        self._live = 0
        self._terminated = 0
        self._preempted = 0
        self._replaced = 0
        self._stale = 0
        self._stale_terminates = 0
        self._stale_notices = 0
        self._notices = 0
        self._delivered = 0
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
            due, kind, (cluster, message) = entry
            try:
                if kind == _UP:
                    self._on_up(cluster, due)
                elif kind == _SETUP_END:
                    self._on_setup_end(cluster, due)
                elif kind == _RUN_END:
                    self._on_run_end(cluster, due)
                elif kind == _PREEMPT and cluster.live:
                    notice = self.regions[cluster.region].notice_seconds
                    self._announce(cluster, due, notice, message)
                elif kind == _RECLAIM and cluster.live and cluster.notice_deadline == due:
                    self._preempt(cluster, due, message)
                elif kind == _KILL and cluster.kill_at == due:
                    self._terminate(cluster, due, replaced=False)
                elif kind == _STOP_KILL and cluster.stop_at == due and cluster.task_live:
                    self._end_by_signal(cluster, due, "SIGKILL")
                elif kind == _SIGTERM_EXIT and cluster.exit_at == due and cluster.task_live:
                    self._end_by_signal(cluster, due, "SIGTERM")
                    self._end_if_terminating(cluster, due)
            except Exception:
                # A bug in one cluster's timer must not stop time for every other cluster.
                log.exception("timer failed", extra={"kind": kind, "cluster": cluster.name})

    def _schedule(self, due: float, kind: str, cluster: Cluster, message: str = "") -> None:
        if self._timers.push(due, kind, (cluster, message)):
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
        try:
            check_shape(spec, self.config)
        except (PrecheckInvalid, PrecheckFailed):
            self._prechecks += 1
            raise
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
            raise ClusterNotFound(
                f"no cluster named {bounds.quote(name)} was ever launched", name=name[:128]
            )
        return cluster

    def find(self, name: str) -> Cluster | None:
        """The latest cluster of this name, or None if it was never launched."""
        return self._by_name.get(name)

    def _fence(self, cluster: Cluster, epoch: int, what: str) -> None:
        latest = self._epochs.get(cluster.job_id, 0)
        if epoch and epoch < latest:
            raise StaleEpoch(
                f"stale epoch {epoch} for job {cluster.job_id}: epoch {latest} holds "
                f"{cluster.name}; {what} refused",
                job_id=str(cluster.job_id),
            )

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
        try:
            self._fence(cluster, epoch, "terminate")
        except StaleEpoch:
            self._stale_terminates += 1
            raise
        now = self.clock.now()
        cluster.record_call(CallKind.TERMINATE, epoch, now)
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

    def begin_stop(self, name: str, epoch: int = 0, grace: float = 0.0) -> Cluster | None:
        """Stops the task of the cluster of this name and keeps the cluster: SIGTERM now
        (recorded, a line in its log), which ends the task at once (FAILED, exit code 143)
        unless its plan traps it, else SIGKILL `grace` simulated seconds later (FAILED,
        exit code 137). None when there is no live task to stop.

        Raises:
            StaleEpoch: `epoch` (when given) is below the highest seen for the job.
        """
        cluster = self._by_name.get(name)
        if cluster is None or not cluster.task_live:
            return None
        try:
            self._fence(cluster, epoch, "stop")
        except StaleEpoch:
            self._stale_terminates += 1
            raise
        now = self.clock.now()
        cluster.record_call(CallKind.STOP, epoch, now)
        if cluster.stop_at is None:
            self._sigterm(cluster, now, f"received SIGTERM: stopping, SIGKILL in {grace:g}s")
            if not cluster.task_live:
                return cluster
        if cluster.stop_at is None or now + grace < cluster.stop_at:
            if grace <= 0:
                self._end_by_signal(cluster, now, "SIGKILL")
            else:
                cluster.stop_at = now + grace
                self._schedule(cluster.stop_at, _STOP_KILL, cluster)
        return cluster

    def _sigterm(self, cluster: Cluster, now: float, note: str) -> None:
        """Sends the live task SIGTERM (a stop's or a terminate's): it exits now, later
        (a plan that traps it) or never; a second SIGTERM never makes it exit later."""
        cluster.sigterm_time = now
        cluster.add_note(now, note)
        self.events.wake()  # log followers read the note now
        after = cluster.plan.sigterm_exit
        if after is None or (cluster.exit_at is not None and cluster.exit_at <= now + after):
            return
        if after <= 0:
            self._end_by_signal(cluster, now, "SIGTERM")
        else:
            cluster.exit_at = now + after
            self._schedule(cluster.exit_at, _SIGTERM_EXIT, cluster)

    def _end_by_signal(self, cluster: Cluster, now: float, signal: str) -> None:
        """The live task ends FAILED, with the signal's exit code (`_ENDED_BY`)."""
        code, note = _ENDED_BY[signal]
        cluster.stop_at = cluster.exit_at = None
        cluster.task_status = TaskState.FAILED
        cluster.exit_code = code
        cluster.task_end_time = now
        cluster.add_note(now, note)
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, f"run ended by {signal}")

    async def wait_stopped(self, cluster: Cluster) -> None:
        """Returns once the cluster's task is no longer live."""
        while cluster.task_live:
            await self.events.wait(None)

    def _kill_at(self, cluster: Cluster, now: float, grace: float) -> None:
        if grace <= 0:
            self._terminate(cluster, now, replaced=False)
            return
        cluster.kill_at = now + grace
        self._schedule(cluster.kill_at, _KILL, cluster)

    async def wait_terminated(self, cluster: Cluster) -> None:
        """Returns once the cluster is terminated (a caller giving up cancels nothing)."""
        if cluster.status == ClusterState.TERMINATED:
            return
        if cluster.gone is None:
            cluster.gone = asyncio.get_running_loop().create_future()
        await asyncio.shield(cluster.gone)

    def notify(self, name: str, epoch: int, deadline: float) -> float | None:
        """Delivers a preemption notice to the cluster's task: SIGTERM and the notice file.

        Args:
            name: The cluster.
            epoch: The caller's epoch for the cluster's job (0: an operator).
            deadline: When the cluster will be reclaimed, Unix seconds.

        Returns:
            The simulated time of delivery (of the first one, for a repeat of the same
            deadline); None when there was no live task to tell.

        Raises:
            ClusterNotFound: never launched.
            StaleEpoch: a newer epoch of the job holds the cluster.
        """
        cluster = self.get(name)
        try:
            self._fence(cluster, epoch, "preemption notice")
        except StaleEpoch:
            self._stale_notices += 1
            raise
        now = self.clock.now()
        cluster.record_call(CallKind.NOTICE, epoch, now)
        if not cluster.task_live:
            return None
        delivered = cluster.notice_delivered_time
        if delivered is not None and cluster.notice_delivered_deadline == deadline:
            return delivered
        cluster.notice_delivered_time = now
        cluster.notice_delivered_deadline = deadline
        self._delivered += 1
        cluster.add_note(now, f"received SIGTERM: preemption notice, reclaim at {_iso(deadline)}")
        self.events.wake()  # log followers read the note now
        return now

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
            message = "preempted (spot)"
            if plan.preempt_after is not None and key not in self._scripted:
                self._scripted.add(key)
                self._schedule(now + plan.preempt_after, _PREEMPT, cluster, message)
            rate = self.regions[cluster.region].preemptions_per_hour
            if rate > 0:
                draw = self.rng.expovariate(rate / 3600.0)
                self._schedule(now + draw, _PREEMPT, cluster, message)
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
        self._end_if_terminating(cluster, now)

    def _on_run_end(self, cluster: Cluster, now: float) -> None:
        if cluster.status != ClusterState.UP or cluster.task_status != TaskState.RUNNING:
            return
        code = self._run_exit_code(cluster)
        cluster.task_status = TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
        cluster.exit_code = code
        cluster.task_end_time = now
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, f"run exited with {code}")
        self._end_if_terminating(cluster, now)

    def _run_exit_code(self, cluster: Cluster) -> int:
        """The plan's exit code, or 0 once `exit_code_runs` runs of the task exited with it."""
        plan = cluster.plan
        if plan.exit_code_runs <= 0:
            return plan.exit_code
        key = (cluster.job_id, cluster.task_id)
        runs = self._failing_runs.get(key, 0)
        if runs >= plan.exit_code_runs:
            return 0
        self._failing_runs[key] = runs + 1
        return plan.exit_code

    def _end_if_terminating(self, cluster: Cluster, now: float) -> None:
        """A graceful terminate ends as soon as there is no live task left to wait for."""
        if cluster.kill_at is not None and not cluster.task_live:
            self._terminate(cluster, now, replaced=False)

    def _release(self, cluster: Cluster) -> None:
        if cluster.live:
            self.regions[cluster.region].give(cluster.zone, cluster.spot, cluster.num_nodes)
            self._live -= 1

    def _announce(self, cluster: Cluster, now: float, notice: float, message: str) -> float | None:
        """Reclaims the live cluster after `notice` simulated seconds (0: now).

        Returns:
            The reclaim's simulated deadline when it was announced, else None.
        """
        if notice <= 0:
            self._preempt(cluster, now, message)
            return None
        deadline = now + notice
        if cluster.notice_deadline is not None and cluster.notice_deadline <= deadline:
            # Already announced for no later: the first notice stands.
            return cluster.notice_deadline
        cluster.notice_deadline = deadline
        self._notices += 1
        self._publish(
            EventKind.PREEMPTION_NOTICE,
            cluster,
            now,
            f"preemption notice: reclaimed in {notice:g}s ({message})",
        )
        self._schedule(deadline, _RECLAIM, cluster, message)
        return deadline

    def _preempt(self, cluster: Cluster, now: float, message: str) -> None:
        self._release(cluster)
        cluster.status = ClusterState.DOWN
        cluster.preempted = True
        cluster.preempt_time = now
        self._preempted += 1
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, message)
        self._settle(cluster)
        # A graceful terminate has nothing left to wait for.
        self._end_if_terminating(cluster, now)

    def _terminate(self, cluster: Cluster, now: float, replaced: bool) -> None:
        self._release(cluster)
        cluster.status = ClusterState.TERMINATED
        cluster.terminate_time = now
        cluster.replaced = replaced
        cluster.kill_at = None
        self._terminated += 1
        self._replaced += int(replaced)
        message = "terminated: replaced by a new launch" if replaced else "terminated"
        self._publish(EventKind.CLUSTER_STATUS_CHANGED, cluster, now, message)
        self._settle(cluster)
        if cluster.gone is not None and not cluster.gone.done():
            cluster.gone.set_result(None)

    def _settle(self, cluster: Cluster) -> None:
        """Lets a Launch waiting on this cluster return (UP) or fail (anything else)."""
        if cluster.waiter is not None and not cluster.waiter.done():
            cluster.waiter.set_result(None)

    def _publish(self, kind: EventKind, cluster: Cluster, now: float, message: str) -> None:
        cluster.event_seq = self.events.publish(now, kind, cluster, message).seq

    # --- the operator API --------------------------------------------------------------------

    def region(self, name: str) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise NotFound(
                f"unknown region {bounds.quote(name)} (regions: {', '.join(self.regions)})",
                field="region",
            )
        return region

    def preempt_cluster(self, name: str, notice: float = 0.0) -> tuple[bool, float | None]:
        """Preempts the cluster, now or after a notice of `notice` simulated seconds.

        Returns:
            Whether it was INIT or UP, and the reclaim's simulated deadline when announced.
        """
        cluster = self.get(name)
        if not cluster.live:
            return False, None
        return True, self._announce(cluster, self.clock.now(), notice, "preempted by the operator")

    def preempt_region(
        self, name: str, include_on_demand: bool = False, notice: float = 0.0
    ) -> tuple[list[str], float | None]:
        """Preempts every live spot (and optionally on-demand) cluster of the region.

        Returns:
            The clusters hit, and the reclaims' simulated deadline when announced.
        """
        self.region(name)
        now = self.clock.now()
        hit = [
            c
            for c in self._by_name.values()
            if c.live and c.region == name and (c.spot or include_on_demand)
        ]
        for cluster in sorted(hit, key=lambda c: c.cluster_id):
            self._announce(cluster, now, notice, f"preempted with region {name}")
        return [c.name for c in hit], (now + notice if hit and notice > 0 else None)

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
            stale_launches_rejected=self._stale,
            stale_terminates_rejected=self._stale_terminates,
            stale_notices_rejected=self._stale_notices,
            preemption_notices_total=self._notices,
            notices_delivered_total=self._delivered,
            launches_rejected_precheck=self._prechecks,
            launches_without_capacity=self._no_capacity,
            violations=count_violations(self.inventory),
            head_seq=self.events.head_seq,
            unreachable_until=self.unreachable_until if self.unreachable_until > now else None,
        )


def _iso(unix_seconds: float) -> str:
    """A Unix time as UTC ISO 8601 to the second, as the notice file's reader would print it."""
    moment = datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
