"""Preemption: spot reclaims decided by the cloud or the operator, and their notices.

Spot clusters only, decided at `preempt_after_seconds` after UP for the first spot
cluster of a (job, task), and/or at an exponential random time drawn from the
seeded RNG at UP when the region's rate is above 0. The operator may preempt
anything, any time. A reclaim decided with the region's `notice_seconds` above 0
(or an operator's notice) is announced at once as a PREEMPTION_NOTICE event
carrying the deadline, and happens at the deadline; an earlier reclaim may
overtake it, a later one never postpones it. A preempted cluster goes DOWN and
frees its capacity at once; a task that had finished stays readable until
termination, and a graceful terminate under way ends.

Delivering a notice to the task (NotifyPreemption, from the control plane) is
fenced like a terminate (fence.py) and writes the SIGTERM and the deadline into
the task's log; it never ends the task.
"""

from __future__ import annotations

import datetime

from services.simcloud.clock import Clock
from services.simcloud.clusters import CallKind, Cluster, ClusterState
from services.simcloud.config import CloudConfig
from services.simcloud.core import CloudCore
from services.simcloud.events import EventKind

# Timer kinds: a spot reclaim is decided (announced when the region gives notice); a
# notice's deadline comes.
PREEMPT, RECLAIM = "preempt", "reclaim"


class Preemptions(CloudCore):
    """Reclaims spot clusters, announces reclaims and delivers notices."""

    def __init__(self, config: CloudConfig, clock: Clock | None = None) -> None:
        super().__init__(config, clock)
        # (job, task) whose scripted preemption was scheduled (it comes once).
        self._scripted: set[tuple[int, int]] = set()
        self._preempted = 0
        self._notices = 0
        self._delivered = 0

    def _arm_preemption(self, cluster: Cluster, now: float) -> None:
        """Decides when a spot cluster just UP is reclaimed: scripted, drawn, or both."""
        if not cluster.spot:
            return
        key = (cluster.job_id, cluster.task_id)
        message = "preempted (spot)"
        preempt_after = cluster.plan.preempt_after
        if preempt_after is not None and key not in self._scripted:
            self._scripted.add(key)
            self._schedule(now + preempt_after, PREEMPT, cluster, message)
        rate = self.regions[cluster.region].preemptions_per_hour
        if rate > 0:
            draw = self.rng.expovariate(rate / 3600.0)
            self._schedule(now + draw, PREEMPT, cluster, message)

    def _on_preempt(self, cluster: Cluster, now: float, message: str) -> None:
        if cluster.live:
            self._announce(cluster, now, self.regions[cluster.region].notice_seconds, message)

    def _on_reclaim(self, cluster: Cluster, now: float, message: str) -> None:
        if cluster.live and cluster.notice_deadline == now:
            self._preempt(cluster, now, message)

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
        self._schedule(deadline, RECLAIM, cluster, message)
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
        now = self.clock.now()
        self.fence.admit(cluster, CallKind.NOTICE, epoch, now)
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

    # --- the operator's preemptions ----------------------------------------------------------

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


def _iso(unix_seconds: float) -> str:
    """A Unix time as UTC ISO 8601 to the second, as the notice file's reader would print it."""
    moment = datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
