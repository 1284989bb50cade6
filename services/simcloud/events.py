"""The event log: every cluster and task status change and every preemption notice.

`EventLog.publish` appends an `Event` with the next sequence number (from 1) to
a bounded ring and wakes every waiter at once. Watchers never get a queue of
their own: each keeps a cursor (the last seq it sent) and reads what follows it
from the ring, so a slow watcher costs no memory and a broken stream resumes
from `after_seq` as long as the ring still holds it (`EventsGone` otherwise).

An event is a whole snapshot of what a watcher decides from: the cluster's
status, the task's readable status, and once the task finished its exit code and
end time (still there after a preemption), so a watcher need not ask again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum

from services.simcloud.clusters import Cluster, ClusterState, TaskState
from services.simcloud.errors import EventsAhead, EventsGone


class EventKind(enum.IntEnum):
    """Mirrors simcloud.v1.EventKind."""

    CLUSTER_STATUS_CHANGED = 1
    TASK_STATUS_CHANGED = 2
    PREEMPTION_NOTICE = 3


class Event:
    """A snapshot of a cluster at one change."""

    __slots__ = (
        "cluster_id",
        "cluster_name",
        "cluster_status",
        "exit_code",
        "job_id",
        "kind",
        "message",
        "notice_deadline",
        "region",
        "seq",
        "sim_time",
        "task_end_time",
        "task_id",
        "task_status",
    )

    def __init__(
        self, seq: int, sim_time: float, kind: EventKind, cluster: Cluster, message: str
    ) -> None:
        self.seq = seq
        self.sim_time = sim_time
        self.kind = kind
        self.cluster_name = cluster.name
        self.cluster_id = cluster.cluster_id
        self.job_id = cluster.job_id
        self.task_id = cluster.task_id
        self.region = cluster.region
        self.cluster_status: ClusterState = cluster.status
        # As through GetCluster: readable while UP, and a finished task's while DOWN.
        self.task_status: TaskState | None = cluster.readable_task_status()
        self.exit_code = cluster.exit_code
        # Simulated times; the end only while the task's end is readable.
        self.task_end_time = cluster.task_end_time if self.task_status is not None else None
        notice = kind == EventKind.PREEMPTION_NOTICE
        self.notice_deadline = cluster.notice_deadline if notice else None
        self.message = message

    def key(self) -> tuple[int, str, str, int, int, int, str]:
        """Everything but the time: what the same seed must reproduce exactly."""
        return (
            self.seq,
            self.kind.name,
            self.cluster_name,
            self.cluster_id,
            int(self.cluster_status),
            int(self.task_status or 0),
            self.message,
        )


class EventLog:
    def __init__(self, capacity: int) -> None:
        self._ring: collections.deque[Event] = collections.deque(maxlen=capacity)
        self.head_seq = 0
        self._changed = asyncio.Event()

    def publish(self, sim_time: float, kind: EventKind, cluster: Cluster, message: str) -> Event:
        self.head_seq += 1
        event = Event(self.head_seq, sim_time, kind, cluster, message)
        self._ring.append(event)
        self.wake()
        return event

    def wake(self) -> None:
        """Wakes every waiter (new events, or something else they watch changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def after(self, seq: int, limit: int = 1000) -> list[Event]:
        """Up to `limit` events with a sequence number above `seq`.

        Raises:
            EventsAhead: `seq` is past the head (it came from an earlier run of the cloud).
            EventsGone: events right after `seq` were dropped from the ring.
        """
        if seq > self.head_seq:
            raise EventsAhead(
                f"after_seq: {seq} is past the latest event {self.head_seq} "
                "(the cloud restarted); watch again from now (after_seq 0)",
                field="after_seq",
                head_seq=str(self.head_seq),
            )
        if not self._ring or seq == self.head_seq:
            return []
        first = self._ring[0].seq
        if seq + 1 < first:
            raise EventsGone(
                f"events {seq + 1}..{first - 1} are no longer kept; "
                "watch again from now (after_seq 0)",
                oldest_seq=str(first),
            )
        start = seq + 1 - first
        return [self._ring[i] for i in range(start, min(len(self._ring), start + limit))]

    def all(self) -> list[Event]:
        return list(self._ring)

    async def wait(self, timeout: float | None = None) -> None:
        """Returns at the next publish or wake, or after `timeout` real seconds."""
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)
