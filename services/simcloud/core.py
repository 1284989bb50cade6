"""What every part of the simulated cloud shares: its state, its timers, a cluster's end.

`CloudCore` holds every region, every cluster ever launched (the inventory, in
launch order, and the latest of each name), the event log, the fence and one
timer heap. With a `ScaledClock`, `run()` is the only background task: it sleeps
until the earliest timer is due and fires what is due. With a `ManualClock`,
tests call `advance()` instead. Either way a timer's due time is the simulated
"now" of what it does and timers fire in (due, insertion) order, so the same seed
and the same calls give the same events (`Event.key`); on a `ManualClock`, the
same times as well.

A timer names its kind; the cloud maps each kind to the method that handles it
(`Cloud.__init__`), and a handler first checks that the cluster is still in the
state the timer expects. Each part of the cloud is a class over this one:
processes.py (the task a cluster runs), preemption.py (reclaims and notices) and
cloud.py (launches, terminations, the operator's knobs), joined as `Cloud`.

Also here, as every part ends clusters: DOWN or TERMINATED frees capacity at once;
terminating is idempotent, keeps the record with its terminate time, and ends a
graceful terminate as soon as no live task is left to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable

from services.common.errors import NotFound
from services.simcloud import bounds
from services.simcloud.clock import Clock, ManualClock, ScaledClock, TimerHeap
from services.simcloud.clusters import Cluster, ClusterState
from services.simcloud.config import CloudConfig
from services.simcloud.errors import CloudUnreachable, ClusterNotFound
from services.simcloud.events import EventKind, EventLog
from services.simcloud.fence import Fence
from services.simcloud.regions import Region

log = logging.getLogger(__name__)

# What a timer does when it comes due: given its cluster, due time and message.
TimerAction = Callable[[Cluster, float, str], None]
# Timers due within this much real time are fired now rather than slept for.
_REAL_TOLERANCE = 0.0005


class CloudCore:
    """The state and the timers every part of the cloud builds on."""

    def __init__(self, config: CloudConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock or ScaledClock(config.time_scale)
        self.rng = random.Random(config.seed)
        self.regions = {r.name: Region(r, config) for r in config.regions}
        self.events = EventLog(config.event_buffer)
        self.fence = Fence()
        self.inventory: list[Cluster] = []
        self._by_name: dict[str, Cluster] = {}
        self._timers = TimerHeap()
        # Timer kind -> what it does (filled in by `Cloud`).
        self._timer_actions: dict[str, TimerAction] = {}
        self._wake = asyncio.Event()
        self._live = 0
        self._terminated = 0
        self._replaced = 0
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
                self._timer_actions[kind](cluster, due, message)
            except Exception:
                # A bug in one cluster's timer must not stop time for every other cluster.
                log.exception("timer failed", extra={"kind": kind, "cluster": cluster.name})

    def _schedule(self, due: float, kind: str, cluster: Cluster, message: str = "") -> None:
        if self._timers.push(due, kind, (cluster, message)):
            self._wake.set()

    # --- looking things up -------------------------------------------------------------------

    def check_reachable(self) -> None:
        """Raises `CloudUnreachable` during an injected outage."""
        left = self.unreachable_until - self.clock.now()
        if left > 0:
            raise CloudUnreachable(f"the cloud API is unreachable for another {left:.1f} sim s")

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

    def region(self, name: str) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise NotFound(
                f"unknown region {bounds.quote(name)} (regions: {', '.join(self.regions)})",
                field="region",
            )
        return region

    # --- a cluster's end ---------------------------------------------------------------------

    def _release(self, cluster: Cluster) -> None:
        if cluster.live:
            self.regions[cluster.region].give(cluster.zone, cluster.spot, cluster.num_nodes)
            self._live -= 1

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

    def _end_if_terminating(self, cluster: Cluster, now: float) -> None:
        """A graceful terminate ends as soon as there is no live task left to wait for."""
        if cluster.kill_at is not None and not cluster.task_live:
            self._terminate(cluster, now, replaced=False)

    def _settle(self, cluster: Cluster) -> None:
        """Lets a Launch waiting on this cluster return (UP) or fail (anything else)."""
        if cluster.waiter is not None and not cluster.waiter.done():
            cluster.waiter.set_result(None)

    def _publish(self, kind: EventKind, cluster: Cluster, now: float, message: str) -> None:
        cluster.event_seq = self.events.publish(now, kind, cluster, message).seq
